"""grm.reward: the GRM and the BT RM as GRPO rewards, checked inside train_grpo."""
import re

import jax
import numpy as np
import pytest

import grm.judge as judge_lib
from grm.format import format_judgement
from grm.meta_rm import add_scalar_head
from grm.reward import BTReward, GRMReward, bt_input_ids, rating_to_reward, response_text
from opd.models import ModelConfig, forward, init_params
from opd.parallel import sharding
from opd.rl import GRPOConfig, GRPOExtras, train_grpo
from opd.rollout.episodes import Completion, sampling_for_chat
from opd.tasks import Example
from opd.text.tokenizers import ByteTokenizer
from opd.training.loop_config import LoopConfig, Runtime
from opd.training.train_step import OptimConfig

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64)
K = 2


def _lower(text: str) -> int:
  return sum("a" <= ch <= "z" for ch in text)


def _rule(c: int) -> int | None:
  """The controlled GRM's base score for a response with c lowercase letters
  (None: it writes no score line)."""
  return None if c % 4 == 3 else 1 + (3 * c) % 9


def _controlled_grm(calls):
  """A GRM whose outputs are fixed by the response it is shown: sample i of
  the batch scores ``_rule(c) + i % 2`` (so k = 2 votes average to +0.5)."""

  def sample(policy, prompts, rng, sampling, **kwargs):
    calls.append(len(prompts))
    out = []
    for i, ids in enumerate(prompts):
      text = policy.tokenizer.decode(ids)
      shown = re.search(r"\[Response 1\]\n(.*)\n\[End of Response 1\]", text, re.S).group(1)
      base = _rule(_lower(shown))
      body = "Critique:\nno verdict." if base is None else format_judgement(
          ["Be lowercase."], "Counted.", [base + i % 2])
      out.append(Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True, body))
    return out

  return sample


def bandit_prompts(n):
  return [Example("bandit", f"bandit-{i}", "train", 1, f"Name a thing, any thing at all ({i}).",
                  (("assistant", "a"),), {}) for i in range(n)]


def test_grm_reward_inside_train_grpo_gives_the_batch_what_the_grm_wrote(monkeypatch):
  calls = []
  monkeypatch.setattr(judge_lib, "sample", _controlled_grm(calls))
  grm_reward = GRMReward(None, None, TOK, sampling=sampling_for_chat(TOK, max_new_tokens=8),
                         k=K, fallback=0.25, seed=3)
  seen = []

  def spy(episodes):
    out = grm_reward(episodes)
    seen.append(([response_text(ep) for ep in episodes], out))
    return out

  cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_new_tokens=4, seq_len=64, kl_coef=0.0,
                   updates_per_batch=1, num_text_samples=1)
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  params = init_params(CFG, jax.random.key(0))
  steps = 2
  run = train_grpo(CFG, params, None, bandit_prompts(4), cfg, OptimConfig(lr=1e-3),
                   LoopConfig(steps, text_every=0, progress=False),
                   runtime=Runtime(mesh, tokenizer=TOK), extras=GRPOExtras(reward_fn=spy))
  B = cfg.group_size * cfg.prompts_per_step
  assert calls == [B * K] * steps  # one batched GRM call per GRPO batch
  assert len(seen) == steps == len(run.history)
  n_invalid_total = 0
  for (texts, rewards), metrics in zip(seen, run.history):
    # Independent expectation from the response texts alone.
    bases = [_rule(_lower(t)) for t in texts]
    expected = np.asarray([0.25 if b is None else (b + 0.5 - 1) / 9 for b in bases])
    np.testing.assert_allclose([r.reward for r in rewards], expected, rtol=0, atol=1e-12)
    n_invalid = sum(b is None for b in bases)
    n_invalid_total += n_invalid
    assert [r.reason.startswith("grm_invalid") for r in rewards] == [b is None for b in bases]
    # ... and the GRPO batch saw exactly those rewards.
    assert metrics["reward/mean"] == pytest.approx(expected.mean(), abs=1e-12)
    assert metrics["reward/min"] == pytest.approx(expected.min(), abs=1e-12)
    assert metrics["reward/max"] == pytest.approx(expected.max(), abs=1e-12)
    assert metrics.get("reward_reason/grm_invalid", 0.0) == n_invalid
  assert grm_reward.totals["fallback_episodes"] == n_invalid_total
  assert grm_reward.totals["invalid_samples"] == K * n_invalid_total
  assert grm_reward.totals["samples"] == steps * B * K


def test_rating_to_reward_and_bad_arguments():
  assert [rating_to_reward(s) for s in (1, 10, 5.5)] == [0.0, 1.0, 0.5]
  with pytest.raises(ValueError, match="score"):
    rating_to_reward(11)
  sampling = sampling_for_chat(TOK, max_new_tokens=4)
  with pytest.raises(ValueError, match="k"):
    GRMReward(CFG, None, TOK, sampling=sampling, k=0)
  with pytest.raises(ValueError, match="fallback"):
    GRMReward(CFG, None, TOK, sampling=sampling, fallback=1.5)
  with pytest.raises(ValueError, match="scalar_head"):
    BTReward(CFG, None, TOK, seq_len=32)


class _Ep:
  def __init__(self, prompt, text):
    self.example = Example("writing", "w", "train", 1, prompt, (("assistant", "x"),), {})
    self.turns = [text]


def test_bt_reward_is_sigmoid_of_the_scalar_head_at_the_last_token():
  cfg, params = add_scalar_head(CFG, init_params(CFG, jax.random.key(1)), jax.random.key(2))
  eps = [_Ep("Write a haiku.", "leaves fall softly"), _Ep("Write a poem.", "roses"),
         _Ep("Write a haiku.", "x" * 200)]  # the last one is cut at seq_len
  seq_len = 64
  reward = BTReward(cfg, params, TOK, seq_len=seq_len, batch_size=2)
  got = np.asarray([r.reward for r in reward(eps)])
  # Reference: each row alone, unpadded, the value head at its last token.
  raw = []
  for ep in eps:
    ids = bt_input_ids(TOK, ep.example.prompt, ep.turns[0])[:seq_len]
    out = forward(cfg, params, ids[None], return_logits=False)
    raw.append(float(out.values[0, -1]))
  ref = 1 / (1 + np.exp(-np.asarray(raw)))
  # float32 forward, padded/batched vs alone: reductions of <= 64 terms over
  # 2 layers, ~sqrt(64)·eps·|r| ≈ 1e-6 (1 + |r|); sigmoid' <= 1/4. 10x margin.
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * (1 + np.abs(raw)).max())
  assert len(set(np.round(got, 6))) == 3  # distinct inputs, distinct rewards


def test_each_grm_reward_call_samples_with_a_fresh_seed(monkeypatch):
  """Call c uses seed ``seed + c`` (GRMReward's docstring): the same episodes
  judged twice get two different sampler seeds, so a GRPO run does not
  replay the same shuffles and draws every step."""
  seeds = []

  def sample(policy, prompts, rng, sampling, **kwargs):
    seeds.append(rng)
    body = format_judgement(["Be short."], "Fine.", [5])
    return [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True, body)
            for _ in prompts]

  monkeypatch.setattr(judge_lib, "sample", sample)
  reward = GRMReward(None, None, TOK, sampling=sampling_for_chat(TOK, max_new_tokens=8), k=2,
                     seed=7)
  eps = [_Ep("Write a haiku.", "leaves fall softly"), _Ep("Write a poem.", "roses")]
  first, second = reward(eps), reward(eps)
  assert seeds == [7, 8]
  # The voted rewards are what the stub wrote: (5 - 1) / 9 on every episode, both calls.
  assert [r.reward for r in first + second] == [4 / 9] * 4
