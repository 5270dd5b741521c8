"""The GRPO trainer (opd/rl/grpo.py): it learns a toy bandit, normalises
advantages within same-prompt groups, never crashes on garbage, stops on too
many verifier errors or NaN, logs what it promises, resumes exactly and
checkpoints like every other trainer.

Every trainer run here uses the same model, batch shape and optimizer; each
``train_grpo`` call compiles its own train step and reference forward (no
module-level caches).
"""
import re
import os

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from opd import rollout as rollout_lib
from opd.models import ModelConfig, init_params
from opd.parallel import sharding
from opd.rl import GRPOConfig, train_grpo
from opd.rl.grpo import GRPOExtras
from opd.rl import grpo as grpo_module
from opd.tasks import Example, VerifierFailureError, get_task
from opd.text.tokenizers import ByteTokenizer
from opd.training.checkpoints import CheckpointManager
from opd.training.lm_trainer import LMTrainConfig, train_lm
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.metrics_writer import read_metrics
from opd.training.train_step import NonFiniteError, OptimConfig

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64)
GRPO = GRPOConfig(group_size=8, prompts_per_step=4, max_new_tokens=4, seq_len=64, kl_coef=0.01,
                  clip_eps_low=0.2, clip_eps_high=0.28, updates_per_batch=2, num_text_samples=2)
OPTIM = OptimConfig(lr=5e-3)
LOWER = range(ord("a"), ord("z") + 1)  # byte ids of 'a'..'z'


def bandit_prompts(n):
  # Long enough (> 32 tokens) to share the math prompts' sampler bucket.
  return [Example("bandit", f"bandit-{i}", "train", 1, f"Name a thing, any thing at all ({i}).",
                  (("assistant", "a"),), {}) for i in range(n)]


def starts_lowercase(episodes):
  """The bandit's reward: 1 if the first sampled byte is a lowercase letter."""
  return [float(len(ep.response_ids) > 0 and int(ep.response_ids[0]) in LOWER)
          for ep in episodes]


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


def _run(params, prompts, steps, mesh, cfg=GRPO, *, seed=0, save_every=0, keep_checkpoints=2,
         eval_every=0, reward_fn=starts_lowercase, loss_fn=None, batch_extras=None, **io):
  """``train_grpo`` on ``TOK``; ``io``: ``RunIO`` fields (workdir, checkpoint_dir, eval_fn)."""
  return train_grpo(CFG, params, params, prompts, cfg, OPTIM,
                    LoopConfig(steps, save_every=save_every, eval_every=eval_every,
                               keep_checkpoints=keep_checkpoints, progress=False),
                    RunIO(**io), runtime=Runtime(mesh, seed=seed, tokenizer=TOK),
                    extras=GRPOExtras(reward_fn=reward_fn, loss_fn=loss_fn,
                                      batch_extras=batch_extras))


def test_grpo_learns_a_toy_bandit(mesh, params):
  """30 steps of 4 prompts x 8 samples: the share of responses starting with
  a lowercase letter (26 of 270 tokens at init) rises far above its start."""
  run = _run(params, bandit_prompts(4), 30, mesh, seed=0)
  rewards = np.array([h["reward/mean"] for h in run.history])
  start, end = rewards[:5].mean(), rewards[-5:].mean()
  print(f"bandit reward: first 5 steps {start:.3f}, last 5 steps {end:.3f}")
  # Nine seeds measured: start 0.08-0.18, end 0.87-0.98.
  assert start < 0.3, rewards
  assert end > 0.7 and end > start + 0.5, rewards
  assert int(run.state.step) == 30 * GRPO.updates_per_batch
  assert run.history[-1]["train/kl"] > 0.0


def test_garbage_and_malformed_prompts_score_zero_and_metrics_are_written(mesh, params, tmp_path):
  """Task verifiers on the random model's garbage give 0 with counted
  reasons; malformed prompts are counted and replaced; every promised
  metric lands in metrics.jsonl and rollouts in TensorBoard text."""
  good = get_task("math").examples("train", 4, seed=0)
  bad = ["not an example",
         Example("nope", "nope-0", "train", 1, "hi", (("assistant", "a"),), {}),
         Example("math", "long-0", "train", 1, "x" * 70, (("assistant", "a"),), {})]
  cfg = GRPO.replace(max_error_fraction=0.25)
  run = _run(params, good + bad, 2, mesh, cfg=cfg, seed=1, reward_fn=None, workdir=tmp_path)
  rows = read_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  required = [
      "reward/mean", "reward/std", "reward/components/format/mean",
      "reward/components/format/std", "reward/domain/math/mean", "reward_reason/error_fraction",
      "groups/zero_std_fraction", "advantage/abs_mean", "response/length_mean",
      "response/length_max", "response/truncation_rate", "response/policy_tokens",
      "response/overlong_fraction", "train/loss", "train/policy_loss", "train/kl",
      "train/entropy", "train/clip_frac_low", "train/clip_frac_high", "train/ratio_mean",
      "train/ratio_max", "train/grad_norm", "train/lr", "perf/tokens_per_s",
      "perf/sample_tokens_per_s", "perf/train_tokens_per_s", "perf/step_time_s",
      "perf/rollout_time_s", "perf/train_time_s", "perf/ref_time_s"]
  bad_seen = 0
  for row, hist in zip(rows, run.history):
    assert not [k for k in required if k not in row], sorted(row)
    assert {k: row[k] for k in hist} == hist  # JSON round-trips floats exactly
    assert row["reward/mean"] == 0.0 and row["groups/zero_std_fraction"] == 1.0
    reasons = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("reward_reason/")}
    bad_seen += reasons.pop("bad_example", 0)
    reasons.pop("error_fraction")
    assert sum(reasons.values()) == GRPO.batch_size and set(reasons) <= {"malformed",
                                                                         "wrong_answer"}
    assert 0 < row["response/length_mean"] <= row["response/length_max"] <= GRPO.max_new_tokens
    assert row["perf/step_time_s"] >= row["perf/rollout_time_s"] + row["perf/train_time_s"]
  assert bad_seen >= 3  # each of the three malformed prompts at least once
  acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
  acc.Reload()
  (text,) = acc.Tensors("rollouts")
  body = text.tensor_proto.string_val[0].decode()
  assert text.step == 1 and body.count("**math**") == GRPO.num_text_samples


def test_reward_errors_are_counted_and_too_many_stop_the_run(mesh, params, tmp_path):
  """A scorer that fails on one prompt in four: counted and scored 0 under
  max_error_fraction=0.3; above max_error_fraction=0.2 the run stops before
  any update or checkpoint."""
  def fails_on_first(episodes):
    if any(ep.example.id == "bandit-0" for ep in episodes):
      raise KeyError("missing rubric")
    return starts_lowercase(episodes)

  prompts = bandit_prompts(4)
  run = _run(params, prompts, 1, mesh, cfg=GRPO.replace(max_error_fraction=0.3), seed=2,
             reward_fn=fails_on_first)
  (m,) = run.history
  assert m["reward_reason/verifier_error"] == GRPO.group_size
  assert m["reward_reason/error_fraction"] == 0.25  # 8 / 32, exact
  ckpt = tmp_path / "ckpt"
  with pytest.raises(VerifierFailureError,
                     match=r"GRPO step 1: 8/32 samples .* above max_error_fraction=20.0%.*"
                           r"verifier_error"):
    _run(params, prompts, 1, mesh, cfg=GRPO.replace(max_error_fraction=0.2), seed=2,
         reward_fn=fails_on_first, checkpoint_dir=ckpt)
  assert CheckpointManager(ckpt).all_steps() == []


def _listing(root):
  return {os.path.relpath(os.path.join(d, f), root): os.stat(os.path.join(d, f)).st_mtime_ns
          for d, _, files in os.walk(root) for f in files}


def test_resume_reproduces_the_uninterrupted_run_and_nan_keeps_checkpoints(mesh, params,
                                                                          tmp_path, monkeypatch):
  prompts, ckpt = bandit_prompts(6), tmp_path / "ckpt"
  straight = _run(params, prompts, 4, mesh, seed=3)

  class Interrupted(Exception):
    pass

  def interrupt_at_3(p):
    if len(read_steps) == 2:
      raise Interrupted
    read_steps.append(1)
    return {"probe": 0.0}

  read_steps = []
  with pytest.raises(Interrupted):  # after step 3's update, before its checkpoint
    _run(params, prompts, 4, mesh, seed=3, checkpoint_dir=ckpt, save_every=1,
         eval_fn=interrupt_at_3, eval_every=1)
  assert CheckpointManager(ckpt).all_steps() == [1, 2]
  resumed = _run(params, prompts, 4, mesh, seed=3, checkpoint_dir=ckpt, save_every=1)
  assert len(resumed.history) == 2
  # The resumed run restores params, optimizer state and rng exactly and runs
  # the same compiled programs (sampler, reference forward, train step) on the
  # same inputs on the same device, so it reproduces the straight run bit for
  # bit (docs/DEVELOPING.md, "Choosing tolerances": things that are exact stay
  # exact); any lost or re-drawn state shows up here.
  for got, want in zip(resumed.history, straight.history[2:]):
    assert got["reward/mean"] == want["reward/mean"]
    assert got["train/loss"] == want["train/loss"]
  assert int(resumed.state.step) == int(straight.state.step) == 8
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A NaN at step 5 stops the run naming the step; the checkpoints are untouched.
  before = _listing(ckpt)
  real_rollout = rollout_lib.rollout

  def poisoned(*args, **kwargs):
    episodes = real_rollout(*args, **kwargs)
    for ep in episodes:
      ep.logprobs = np.full_like(ep.logprobs, np.nan)
    return episodes

  monkeypatch.setattr(rollout_lib.episodes, "rollout", poisoned)  # what the sources call
  with pytest.raises(NonFiniteError, match="at step 5"):
    _run(params, prompts, 5, mesh, seed=3, checkpoint_dir=ckpt, save_every=1)
  assert _listing(ckpt) == before


def test_train_grpo_validates_arguments(mesh, params):
  with pytest.raises(ValueError, match="kl_coef=0.01 > 0 needs ref_params"):
    train_grpo(CFG, params, None, bandit_prompts(4), GRPO, OPTIM, LoopConfig(1),
               runtime=Runtime(mesh, tokenizer=TOK))
  with pytest.raises(ValueError, match="checkpointing needs a prompt iterator with get_state"):
    train_grpo(CFG, params, params, iter(bandit_prompts(4)), GRPO, OPTIM, LoopConfig(1),
               RunIO(checkpoint_dir="/nonexistent/never-created"),
               runtime=Runtime(mesh, tokenizer=TOK))
  with pytest.raises(ValueError, match=r"LoopConfig.steps must be .*, got -1"):
    train_grpo(CFG, params, params, bandit_prompts(4), GRPO, OPTIM, LoopConfig(-1),
               runtime=Runtime(mesh, tokenizer=TOK))


def _prompt_index(row_tokens, first_target):
  """The i of ``bandit_prompts``' "(i)." in a training row's prompt part."""
  text = TOK.decode(row_tokens[:first_target + 1])
  (i,) = re.findall(r"\((\d+)\)\.", text)
  return int(i)


def test_advantages_are_normalised_within_same_prompt_groups(mesh, params, monkeypatch):
  """The reward depends on the prompt: ``10 * i`` for prompt i plus the
  bandit bit. Within a prompt's group the offset cancels; a trainer whose
  "groups" mixed prompts (e.g. samples interleaved ``p0 p1 p2 p3 p0 ...``
  before the ``[P, G]`` reshape) would give advantages of size ~1 from the
  offsets alone. The batches the train step receives are recorded; each
  row's prompt and first sampled byte are read back from its tokens and the
  advantages recomputed per prompt in numpy."""
  def offset_bandit(episodes):
    return [10.0 * int(ep.example.id.split("-")[1]) + r
            for ep, r in zip(episodes, starts_lowercase(episodes))]

  seen = []
  real_make_train_step = grpo_module.make_train_step

  def recording_make_train_step(*args, **kwargs):
    step = real_make_train_step(*args, **kwargs)

    def recorded(state, batch):
      seen.append(jax.device_get({k: batch[k] for k in ("tokens", "targets", "loss_mask",
                                                         "advantages")}))
      return step(state, batch)
    return recorded

  monkeypatch.setattr(grpo_module, "make_train_step", recording_make_train_step)
  cfg = GRPO.replace(updates_per_batch=1)
  run = _run(params, bandit_prompts(cfg.prompts_per_step), 1, mesh, cfg=cfg, seed=5,
             reward_fn=offset_bandit)
  (batch,) = seen
  rows = []
  for r in range(cfg.batch_size):
    first = int(np.argmax(batch["loss_mask"][r] > 0))
    i = _prompt_index(batch["tokens"][r], first)
    rows.append((i, 10.0 * i + float(int(batch["targets"][r, first]) in LOWER)))
  prompts = sorted({i for i, _ in rows})
  assert prompts == list(range(cfg.prompts_per_step))
  want = np.zeros(cfg.batch_size)
  for p in prompts:
    idx = [r for r, (i, _) in enumerate(rows) if i == p]
    assert len(idx) == cfg.group_size, (p, idx)
    x = np.asarray([rows[r][1] for r in idx], np.float64)
    if x.max() > x.min():
      want[idx] = (x - x.mean()) / (x.std() + cfg.advantage_eps)
  # float32 rounding of O(G)-sized z-scores: a few ulps.
  np.testing.assert_allclose(batch["advantages"], want, rtol=0, atol=8 * np.finfo(np.float32).eps
                             * np.sqrt(cfg.group_size))
  # The logged mean of |A| sums B float32 values (each within the atol above):
  # ~4 sqrt(B) eps relative to the mean, plus that per-element atol.
  B = cfg.batch_size
  np.testing.assert_allclose(run.history[0]["advantage/abs_mean"], np.abs(want).mean(), rtol=0,
                             atol=8 * np.finfo(np.float32).eps * np.sqrt(cfg.group_size)
                             + 4 * np.sqrt(B) * np.finfo(np.float32).eps * np.abs(want).mean())


@pytest.mark.parametrize("save_every,saved", [(0, [3]), (2, [2, 3])])
def test_save_every_means_the_same_in_every_trainer(mesh, params, tmp_path, save_every, saved):
  """0: only after the last step; k: every k steps and after the last; the
  same checkpoint steps from the LM trainer and from GRPO (both run on
  ``opd.training.loop.train``)."""
  rng = np.random.default_rng(0)

  def lm_batches():
    while True:
      tokens = rng.integers(0, 256, (4, 9)).astype(np.int32)
      yield {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": np.ones((4, 8), bool), "loss_mask": np.ones((4, 8), np.float32)}

  train_lm(CFG, lm_batches(), OPTIM, LMTrainConfig(steps=3, save_every=save_every,
                                                   progress=False),
           RunIO(checkpoint_dir=tmp_path / "lm"), runtime=Runtime(mesh, sharding.DEFAULT_RULES),
           params=params)
  _run(params, bandit_prompts(4), 3, mesh, cfg=GRPO.replace(updates_per_batch=1), seed=6,
       checkpoint_dir=tmp_path / "grpo", save_every=save_every, keep_checkpoints=5)
  assert CheckpointManager(tmp_path / "lm").all_steps() == saved
  assert CheckpointManager(tmp_path / "grpo").all_steps() == saved


def test_batch_extras_and_a_custom_loss_reach_the_train_step(mesh, params, monkeypatch):
  """``batch_extras`` adds row-aligned keys from the rollouts' rewards and a
  custom ``loss_fn`` sees them: the extra key holds each row's reward, which
  the test recomputes from the row's own first sampled byte (read back from
  the recorded batch), and the loss logs its mean."""
  seen = []
  real_make_train_step = grpo_module.make_train_step

  def recording_make_train_step(*args, **kwargs):
    step = real_make_train_step(*args, **kwargs)

    def recorded(state, batch):
      seen.append(jax.device_get({k: batch[k] for k in ("targets", "loss_mask", "bit")}))
      return step(state, batch)
    return recorded

  monkeypatch.setattr(grpo_module, "make_train_step", recording_make_train_step)
  grpo_loss = grpo_module.make_grpo_loss(CFG, GRPO)

  def loss_with_bits(p, batch, rng):
    loss, metrics = grpo_loss(p, {k: v for k, v in batch.items() if k != "bit"}, rng)
    return loss, {**metrics, "bit_mean": batch["bit"].mean()}

  cfg = GRPO.replace(updates_per_batch=1)
  run = _run(params, bandit_prompts(cfg.prompts_per_step), 1, mesh, cfg=cfg, seed=3,
             loss_fn=loss_with_bits,
             batch_extras=lambda episodes, rewards: {"bit": rewards.astype(np.float32)})
  (batch,) = seen
  first = np.argmax(batch["loss_mask"] > 0, axis=1)
  want = np.asarray([float(int(batch["targets"][r, f]) in LOWER) for r, f in enumerate(first)])
  np.testing.assert_array_equal(batch["bit"], want)
  # A mean of B values in {0, 1}: exact up to one float32 rounding.
  assert run.history[0]["train/bit_mean"] == pytest.approx(want.mean(), abs=1e-6)

  def bad(extras):
    return lambda episodes, rewards: extras
  with pytest.raises(ValueError, match="already has"):
    _run(params, bandit_prompts(4), 1, mesh, batch_extras=bad({"advantages": np.zeros(32)}))
  with pytest.raises(ValueError, match=r"batch_extras\['x'\] has shape \(3,\)"):
    _run(params, bandit_prompts(4), 1, mesh, batch_extras=bad({"x": np.zeros(3)}))
  with pytest.raises(ValueError, match="loss_fn must be callable"):
    _run(params, bandit_prompts(4), 1, mesh, loss_fn=3)
