"""Rollout batches (opd/rollout/batches.py): the resumable prompt stream, the
bucketed training length, the shared rollout config and prompt drawing."""
import collections
import dataclasses
import json

import numpy as np
import pytest

from opd.config.fields import from_group
from opd.distill.source import OPDConfig
from opd.rl.config import GRPOConfig
from opd.rollout.batches import (DomainBalancedStream, PromptStream, RolloutConfig, draw_prompts,
                                 prompt_stream, training_arrays, training_length)
from opd.rollout.episodes import Episode
from opd.tasks import ALL_DOMAINS, RewardStats, VerifierFailureError, domain_examples, get_task


def test_prompt_stream_resumes_its_order():
  a = PromptStream(list(range(5)), seed=4)
  first = [next(a) for _ in range(7)]
  state = a.get_state()
  rest = [next(a) for _ in range(6)]
  b = PromptStream(list(range(5)), seed=4)
  b.set_state(state)
  assert [next(b) for _ in range(6)] == rest
  assert sorted(first[:5]) == list(range(5)) and first[:5] != list(range(5))
  with pytest.raises(ValueError, match="saved for 5 prompts, this stream has 3"):
    PromptStream([1, 2, 3]).set_state(state)


def test_training_length_buckets_to_the_longest_episode():
  ex = get_task("math").examples("train", 1)[0]

  def ep(p, r):
    return Episode(ex, np.zeros(p, np.int32), np.zeros(r, np.int32), np.ones(r, bool),
                   np.zeros(r, np.float32), ["x"], False)

  cfg = GRPOConfig(seq_len=192, max_new_tokens=48, length_bucket=32)
  length = lambda eps, c: training_length(eps, c.seq_len, c.length_bucket)
  assert length([ep(40, 10), ep(50, 20)], cfg) == 96    # 69 targets -> 96
  assert length([ep(60, 5)], cfg) == 64                  # 64 targets exactly
  assert length([ep(150, 48)], cfg) == 192               # capped at seq_len
  assert length([ep(40, 10)], cfg.replace(length_bucket=0)) == 192


def test_training_arrays_cut_overlong_episodes_and_pad_to_the_bucket():
  ex = get_task("math").examples("train", 1)[0]
  # Prompt 10 + response 30 = 39 targets, over seq_len 32: the response is cut
  # to seq_len + 1 - 10 = 23 tokens; the other row (10 + 5 - 1 = 14) is not.
  eps = [Episode(ex, np.arange(10, dtype=np.int32), np.arange(r, dtype=np.int32) + 20,
                 np.ones(r, bool), np.zeros(r, np.float32), ["x"], False) for r in (30, 5)]
  host, cut = training_arrays(eps, seq_len=32, length_bucket=16, pad_id=0)
  assert cut.tolist() == [True, False]
  assert host["tokens"].shape == (2, 32)                   # 32 targets: a full bucket pair
  assert host["mask"].sum(axis=1).tolist() == [32, 14]     # 10 + 23 - 1, 10 + 5 - 1
  host, _ = training_arrays(eps[1:], seq_len=32, length_bucket=16, pad_id=0)
  assert host["tokens"].shape == (1, 16)                   # 14 targets -> one bucket


def test_grpo_and_opd_read_their_rollout_fields_through_one_config():
  grpo = GRPOConfig(prompts_per_step=3, group_size=4, temperature=0.7, top_k=5, top_p=0.9,
                    max_new_tokens=16, seq_len=64, length_bucket=8)
  assert grpo.rollout == RolloutConfig(3, 4, 0.7, 5, 0.9, 16, 64, 8)
  assert grpo.rollout.batch_size == grpo.batch_size == 12
  # OPD's loss.top_k is the loss estimator's k: the student samples at
  # rollout.top_k, untruncated by default.
  opd = from_group(OPDConfig, {"rollout": dict(prompts_per_step=2, group_size=1, temperature=0.5,
                                               max_new_tokens=8, seq_len=32, length_bucket=0),
                               "loss": {"top_k": 3}}, "config.opd")
  assert opd.rollout == RolloutConfig(2, 1, 0.5, 0, 1.0, 8, 32, 0) and opd.loss.top_k == 3
  assert {f.name for f in dataclasses.fields(RolloutConfig)} <= {
      f.name for f in dataclasses.fields(GRPOConfig)}


def _opd_rollout(**fields) -> RolloutConfig:
  """OPD's rollout fields, as a config file's ``config.opd.rollout`` group sets them."""
  return from_group(OPDConfig, {"rollout": fields}, "config.opd").rollout


# OPD's rollout fields live in its nested RolloutConfig, which names itself.
@pytest.mark.parametrize("cls, name", [(RolloutConfig, "RolloutConfig"),
                                       (GRPOConfig, "GRPOConfig"),
                                       (_opd_rollout, "RolloutConfig")])
def test_shared_rollout_fields_are_validated_once_naming_the_owner(cls, name):
  with pytest.raises(ValueError, match=rf"{name}.prompts_per_step must be a positive int, got 0"):
    cls(prompts_per_step=0)
  with pytest.raises(ValueError, match=rf"{name}.temperature must be a finite number > 0, got 0"):
    cls(temperature=0)
  with pytest.raises(ValueError, match=rf"{name}.length_bucket must be a non-negative int"):
    cls(length_bucket=-1)
  with pytest.raises(ValueError, match=rf"{name}.seq_len=16 must be >= max_new_tokens \+ 1 = 17"):
    cls(seq_len=16, max_new_tokens=16)
  assert type(cls(seq_len=np.int64(128)).seq_len) is int


def test_draw_prompts_counts_and_replaces_bad_prompts():
  good = get_task("math").examples("train", 3)
  stream = iter([good[0], "junk", good[1], good[2]])
  stats = RewardStats()
  problem = lambda ex: None if not isinstance(ex, str) else "not an Example"
  assert draw_prompts(stream, 3, problem, stats) == good
  # The bad prompt is a pipeline error, counted as such.
  assert (stats.total, stats.errors, dict(stats.reasons)) == (1, 1, {"bad_example": 1})
  assert draw_prompts(iter(good[:1]), 2, problem, RewardStats()) is None  # the stream ended
  with pytest.raises(VerifierFailureError, match="9 malformed prompts while drawing 2"):
    draw_prompts(iter(["junk"] * 20), 2, problem, RewardStats())


@dataclasses.dataclass(frozen=True)
class _Item:
  domain: str
  i: int


# Unequal domain sizes: each domain cycles through its own epochs.
_SIZES = {"math": 3, "code": 7, "instruct": 2, "agent": 5, "writing": 4}
_ITEMS = [_Item(d, i) for i in range(7) for d, n in _SIZES.items() if i < n]  # interleaved


@pytest.mark.parametrize("P", [10, 7])
def test_domain_balanced_stream_draws_each_domain_equally(P):
  stream, K, batches = DomainBalancedStream(_ITEMS, seed=1), len(_SIZES), 15
  drawn = [[next(stream) for _ in range(P)] for _ in range(batches)]
  for batch in drawn:
    counts = collections.Counter(x.domain for x in batch)
    assert set(counts) == set(_SIZES)
    assert all(c in (P // K, -(-P // K)) for c in counts.values()), counts
    if P % K == 0:
      assert set(counts.values()) == {P // K}
  # Over 15 batches (15 * P draws, a multiple of K) the counts are exactly equal,
  # and within a domain every epoch visits each of its items once, in a shuffled order.
  flat = [x for b in drawn for x in b]
  assert set(collections.Counter(x.domain for x in flat).values()) == {batches * P // K}
  for d, n in _SIZES.items():
    seq = [x.i for x in flat if x.domain == d]
    epochs = [seq[e * n:(e + 1) * n] for e in range(len(seq) // n)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    if n > 2:
      assert len({tuple(e) for e in epochs}) > 1, d  # reshuffled per epoch


def test_domain_balanced_stream_resumes_mid_stream():
  a = DomainBalancedStream(_ITEMS, seed=2)
  for _ in range(3 * 7 + 2):  # three batches of 7 and two draws into the fourth
    next(a)
  state = json.loads(json.dumps(a.get_state()))  # survives a JSON checkpoint
  rest = [next(a) for _ in range(40)]
  b = DomainBalancedStream(_ITEMS, seed=2)
  b.set_state(state)
  assert [next(b) for _ in range(40)] == rest
  with pytest.raises(ValueError, match="saved for domains"):
    DomainBalancedStream(_ITEMS[:-1], seed=2).set_state(state)
  with pytest.raises(ValueError, match="invalid draws/streams"):
    b.set_state({**state, "draws": -1})
  with pytest.raises(ValueError, match="item 0 is a int with domain None"):
    DomainBalancedStream([1, 2])


def test_configs_select_the_balanced_stream():
  exs = domain_examples(ALL_DOMAINS, "train", 3, seed=0, difficulties=(1,))
  assert type(prompt_stream(exs, RolloutConfig(), seed=0)) is PromptStream
  cfg = RolloutConfig(prompts_per_step=5, domain_balance=True)
  stream = prompt_stream(exs, cfg, seed=0)
  assert type(stream) is DomainBalancedStream
  batch = draw_prompts(stream, cfg.prompts_per_step, lambda ex: None, RewardStats())
  assert sorted(ex.domain for ex in batch) == sorted(ALL_DOMAINS)
  # GRPO and OPD hand the field on through their rollout config.
  assert GRPOConfig(domain_balance=True).rollout.domain_balance is True
  assert _opd_rollout(domain_balance=True).domain_balance is True
  for cls, name in ((RolloutConfig, "RolloutConfig"), (GRPOConfig, "GRPOConfig"),
                    (_opd_rollout, "RolloutConfig")):
    with pytest.raises(ValueError, match=rf"{name}.domain_balance must be True or False"):
      cls(domain_balance="yes")
