"""The RL baselines (opd/rl/sequential.py): sequential GRPO stage by stage, and
mixed GRPO (``train_grpo`` over several domains' prompts).

Tiny model and batches; prompts of made-up domains scored by a recording
``reward_fn`` (1 if the first sampled byte is a lowercase letter), which
also tells which domains each step's rollouts came from.
"""
import collections

import jax
import numpy as np
import pytest

from opd.models import ModelConfig, init_params
from opd.parallel import sharding
from opd.rl import GRPOConfig, train_grpo
from opd.rl import sequential
from opd.rl.grpo import GRPOExtras
from opd.tasks import Example
from opd.text.tokenizers import ByteTokenizer
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.train_step import OptimConfig

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64)
GRPO = GRPOConfig(group_size=2, prompts_per_step=2, max_new_tokens=4, seq_len=64, kl_coef=0.01,
                  num_text_samples=0)
OPTIM = OptimConfig(lr=5e-3)
LOWER = range(ord("a"), ord("z") + 1)


def _loops(steps):
  """One ``LoopConfig`` (an int) or one per stage (a list), without a progress bar."""
  if isinstance(steps, int):
    return LoopConfig(steps, progress=False)
  return [LoopConfig(s, progress=False) for s in steps]


def prompts(domain, n):
  return [Example(domain, f"{domain}-{i}", "train", 1, f"Name a thing, any thing ({domain} {i}).",
                  (("assistant", "a"),), {}) for i in range(n)]


class Recorder:
  """A reward_fn that remembers the domain of every scored episode, per call."""

  def __init__(self):
    self.calls = []

  def __call__(self, episodes):
    self.calls.append([ep.example.domain for ep in episodes])
    return [float(len(ep.response_ids) > 0 and int(ep.response_ids[0]) in LOWER)
            for ep in episodes]


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


def test_stages_run_in_order_each_from_the_previous_params(mesh, tmp_path, monkeypatch):
  params0 = init_params(CFG, jax.random.key(0))
  calls = []

  def recording_train_grpo(model_cfg, params, ref_params, prompts, *args, **kw):
    run = train_grpo(model_cfg, params, ref_params, prompts, *args, **kw)
    calls.append(dict(params=params, ref=ref_params, seed=kw["runtime"].seed, run=run,
                      domains={ex.domain for ex in prompts}))
    return run

  monkeypatch.setattr(sequential, "train_grpo", recording_train_grpo)
  rewards = Recorder()
  stages = [("beta", prompts("beta", 2)), ("alpha", prompts("alpha", 2))]
  out = sequential.train_sequential_grpo(
      CFG, params0, stages, GRPO, OPTIM, _loops([2, 1]), RunIO(workdir=tmp_path),
      runtime=Runtime(mesh, seed=3, tokenizer=TOK), extras=GRPOExtras(reward_fn=rewards))
  assert [c["domains"] for c in calls] == [{"beta"}, {"alpha"}]
  assert [n for n, _ in out.stages] == ["beta", "alpha"]
  # Rollouts: 2 steps of beta, then 1 of alpha, each step P·G = 4 episodes.
  assert rewards.calls == [["beta"] * 4] * 2 + [["alpha"] * 4]
  assert [c["seed"] for c in calls] == [3, 4]
  # Stage 1 starts from the given params, stage 2 from stage 1's result,
  # which is also its KL reference.
  assert calls[0]["params"] is params0 and calls[0]["ref"] is params0
  assert calls[1]["params"] is calls[0]["run"].state.params
  assert calls[1]["ref"] is calls[0]["run"].state.params
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params0,
                                       calls[0]["run"].state.params))
  assert max(moved) > 0  # stage 1 trained
  assert int(out.state.step) == 1 and out.state is calls[1]["run"].state
  for i, name in enumerate(["beta", "alpha"]):
    assert (tmp_path / sequential.stage_name(i, name) / "checkpoints").is_dir()

  # Re-running resumes: both stages are finished, nothing is trained again,
  # and the same params come out.
  again = sequential.train_sequential_grpo(
      CFG, params0, stages, GRPO, OPTIM, _loops([2, 1]), RunIO(workdir=tmp_path),
      runtime=Runtime(mesh, seed=3, tokenizer=TOK), extras=GRPOExtras(reward_fn=rewards))
  assert len(rewards.calls) == 3 and all(not run.history for _, run in again.stages)
  for a, b in zip(jax.tree.leaves(out.state.params), jax.tree.leaves(again.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mixed_grpo_draws_every_domain(mesh):
  """Mixed RL is ``train_grpo`` over every domain's prompts: over one epoch of
  the prompt stream (3 steps of P = 2 prompts, 6 prompts) each prompt is
  drawn once, so each domain is rolled out exactly 2 prompts · G times."""
  domains = ("alpha", "beta", "gamma")
  mix = [ex for d in domains for ex in prompts(d, 2)]
  rewards = Recorder()
  run = train_grpo(CFG, init_params(CFG, jax.random.key(1)), None, mix,
                   GRPO.replace(kl_coef=0.0), OPTIM, _loops(3),
                   runtime=Runtime(mesh, tokenizer=TOK), extras=GRPOExtras(reward_fn=rewards))
  counts = collections.Counter(d for call in rewards.calls for d in call)
  assert counts == {d: 2 * GRPO.group_size for d in domains}
  assert len(rewards.calls) == len(run.history) == 3
  for metrics, call in zip(run.history, rewards.calls):  # per-domain reward of each step's mix
    assert {k.split("/")[2] for k in metrics if k.startswith("reward/domain/")} == set(call)


@pytest.mark.parametrize("stages, steps, match", [
    ([], 1, r"stages=\[\]"),
    ([("a", prompts("a", 1)), ("a", prompts("a", 1))], 1, "unique"),
    ([("a/b", prompts("a", 1))], 1, "without '/'"),
    ([("a", [])], 1, "no prompts"),
    ([("a", prompts("a", 1))], [1, 2], "2 entries for 1 stages"),
    ([("a", prompts("a", 1))], 0, r"steps\[0\]"),
])
def test_bad_stages_are_refused(mesh, stages, steps, match):
  with pytest.raises(ValueError, match=match):
    sequential.train_sequential_grpo(CFG, None, stages, GRPO, OPTIM, _loops(steps),
                                     runtime=Runtime(mesh, tokenizer=TOK))
