"""The OPD loss's optional GRPO verifier-reward term (opd.distill.loss, source.py).

The term is ``grpo_coef · policy_loss(log p_s(y), old_logprobs, advantages)``
on the student's sampled tokens; the references below rebuild it in numpy
from materialised logits, and the advantages from rewards grouped by prompt
id (not by row position), so a source that mixed prompts in a group fails.
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd import rollout as rollout_lib
from opd.distill import loss as loss_lib
from opd.distill.faults import FaultTolerantTeachers
from opd.distill.source import OPDSource
from opd.distill.teachers import TeacherPool
from opd.models import forward
from opd.rollout.batches import PromptStream
from opd.tasks import Example, Reward

from test_distill_loss import STUDENT as SMALL, WIDE as SMALL_WIDE, _model
from test_distill_trainer import OPD, STUDENT, TOK, V, mesh, student, teachers  # noqa: F401

EPS32 = float(np.finfo(np.float32).eps)
B, T, COEF, TAU = 4, 10, 0.7, 0.8
CLIP = loss_lib.OPDLossConfig(grpo_coef=COEF)


@pytest.fixture(scope="module")
def batch_and_models():
  """A constructed batch: one teacher, old log-probs off the current ones by
  up to ±0.5 (so both clip sides are hit), advantages of both signs."""
  rng = np.random.default_rng(0)
  v = SMALL.vocab_size
  tokens = rng.integers(0, v, size=(B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[2, 7:] = False
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, 3:] = 1.0
  student, teacher = _model(SMALL, 0, head_scale=20.0), _model(SMALL_WIDE, 1, head_scale=20.0)
  hidden = forward(SMALL_WIDE, teacher, tokens[:, :-1], None, mask, return_logits=False,
                   return_hidden=True).hidden
  z = np.asarray(forward(SMALL, student, tokens[:, :-1], None, mask).logits, np.float64) / TAU
  lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(
      -1, keepdims=True)
  logp = np.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
           "loss_mask": loss_mask * mask, "teacher_hidden": [hidden],
           "teacher_weights": np.ones((B, T, 1), np.float32),
           "old_logprobs": (logp + rng.uniform(-0.5, 0.5, logp.shape)).astype(np.float32),
           "advantages": np.asarray([1.3, -0.8, 0.4, -1.9], np.float32)}
  return batch, student, (teacher["lm_head"],), z, logp


def _numpy_policy_loss(logp, old, adv, keep, eps_low, eps_high):
  """Token mean over ``keep`` of −min(r A, clip(r) A), r = exp(logp − old)."""
  r = np.exp(logp - old)
  a = adv[:, None].astype(np.float64)
  pg = -np.minimum(r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a)
  return float((pg * keep).sum() / keep.sum()), r


def _loss(cfg, params, batch, heads):
  fn = loss_lib.make_opd_loss(SMALL, heads, cfg, sampling_temperature=TAU)
  return jax.value_and_grad(fn, has_aux=True)(params, batch, None)


def test_the_loss_is_kl_plus_coef_times_a_numpy_policy_gradient(batch_and_models):
  """Bound: log p_s(y) comes from float32 logits (a D-term dot product) and a
  V-term logsumexp, so |δ log p| <= (D + V)·eps·(1 + max|z|); the term moves
  by at most max|A|·max r·|δ log p| per token, and so does its mean."""
  batch, student, heads, z, logp = batch_and_models
  (kl, _), kl_g = _loss(loss_lib.OPDLossConfig(), student, batch, heads)
  (total, m), g = _loss(CLIP, student, batch, heads)
  keep = batch["loss_mask"] > 0
  want_pg, r = _numpy_policy_loss(logp, batch["old_logprobs"], batch["advantages"], keep,
                                  CLIP.grpo_clip_eps_low, CLIP.grpo_clip_eps_high)
  assert (r[keep] < 1 - CLIP.grpo_clip_eps_low).any()
  assert (r[keep] > 1 + CLIP.grpo_clip_eps_high).any()
  delta = (SMALL.d_model + SMALL.vocab_size) * EPS32 * (1 + np.abs(z).max())
  tol = float(np.abs(batch["advantages"]).max() * r[keep].max() * delta)
  assert abs(want_pg) > 100 * tol  # the term is visibly non-zero
  assert float(m["grpo_loss"]) == pytest.approx(want_pg, abs=tol)
  assert float(m["kl_loss"]) == float(kl) and float(kl) > 0.1
  assert float(total) == pytest.approx(float(kl) + COEF * want_pg,
                                       abs=COEF * tol + 4 * EPS32 * abs(float(total)))

  # The gradient's extra part is coef x the policy gradient of a jnp reference
  # on materialised logits (same float32 inputs, same error bound per token).
  def ref_pg(params):
    zz = forward(SMALL, params, batch["tokens"], None, batch["mask"]).logits / TAU
    lp = jnp.take_along_axis(jax.nn.log_softmax(zz, -1), batch["targets"][..., None], -1)[..., 0]
    r = jnp.exp(lp - batch["old_logprobs"])
    a = batch["advantages"][:, None]
    pg = -jnp.minimum(r * a, jnp.clip(r, 1 - CLIP.grpo_clip_eps_low,
                                      1 + CLIP.grpo_clip_eps_high) * a)
    return jnp.sum(pg * keep) / keep.sum()

  want_g = jax.grad(ref_pg)(student)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want_g))
  assert scale > 0
  for got, base, want in zip(jax.tree.leaves(g), jax.tree.leaves(kl_g), jax.tree.leaves(want_g)):
    atol = COEF * scale * delta + 4 * EPS32 * float(jnp.max(jnp.abs(got)))
    np.testing.assert_allclose(np.asarray(got) - np.asarray(base), COEF * np.asarray(want),
                               rtol=0, atol=atol)


def test_grpo_coef_zero_leaves_loss_and_gradients_exactly_unchanged(batch_and_models):
  """With grpo_coef = 0 the term is not built: NaN advantages and old
  log-probs in the batch change nothing, bit for bit (with the term on they
  turn the loss NaN, so the keys would be read)."""
  batch, student, heads, _, _ = batch_and_models
  plain = {k: v for k, v in batch.items() if k not in loss_lib.GRPO_KEYS}
  poisoned = {**batch, "advantages": np.full((B,), np.nan, np.float32),
              "old_logprobs": np.full((B, T), np.nan, np.float32)}
  (l0, m0), g0 = _loss(loss_lib.OPDLossConfig(), student, plain, heads)
  (l1, m1), g1 = _loss(loss_lib.OPDLossConfig(grpo_coef=0.0), student, poisoned, heads)
  assert float(l0) == float(l1) and set(m0) == set(m1) and "grpo_loss" not in m1
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  (l2, _), _ = _loss(CLIP, student, poisoned, heads)
  assert np.isnan(float(l2))
  with pytest.raises(ValueError, match="missing \\['old_logprobs', 'advantages'\\]"):
    _loss(CLIP, student, plain, heads)
  with pytest.raises(ValueError, match="advantages"):
    _loss(CLIP, student, {**batch, "advantages": np.zeros((B, 1), np.float32)}, heads)
  with pytest.raises(ValueError, match="grpo_coef"):
    loss_lib.OPDLossConfig(grpo_coef=-0.1)
  with pytest.raises(ValueError, match="grpo_clip_eps_low"):
    loss_lib.OPDLossConfig(grpo_clip_eps_low=1.0)
  with pytest.raises(ValueError, match="sampling_temperature must be a finite number > 0"):
    loss_lib.make_opd_loss(SMALL, heads, CLIP, sampling_temperature=0.0)


def _math_prompts(n):
  return [Example("math", f"m{i}", "train", 1, f"What is {i} + {i}?", (("assistant", "x"),), {})
          for i in range(n)]


def _source(cfg, mesh, teachers):
  pool = TeacherPool(teachers, V, mesh)
  return OPDSource(STUDENT, cfg, PromptStream(_math_prompts(8), seed=0),
                   teachers=FaultTolerantTeachers.from_pool(pool, deadline_s=60.0),
                   heads=pool.heads, domains=[t.domain for t in teachers], total_steps=1,
                   tokenizer=TOK, mesh=mesh), pool


@pytest.mark.parametrize("grpo_coef", [0.0, 0.5])
def test_advantages_are_normalised_within_same_prompt_groups(mesh, student, teachers,
                                                             monkeypatch, grpo_coef):
  """A prompt-dependent reward (0.15 per prompt index, + 0.1 per sample):
  the batch's advantages equal (r − mean) / (std + 1e-6) over the rows of
  the same prompt id, computed here; mixing prompts in a group gives other
  values. The batch carries the sampler's old log-probs. With grpo_coef = 0
  nothing is verified and no GRPO key appears."""
  real_rollout, seen, recorded = rollout_lib.rollout, [], []

  def rewarded(*args, **kwargs):
    seen.append(kwargs["verify"])
    eps = real_rollout(*args, **{**kwargs, "verify": False})
    for i, ep in enumerate(eps):
      ep.reward = Reward(0.15 * (int(ep.example.id[1:]) % 5) + 0.1 * (i % 3), 1.0)
    recorded.append(eps)
    return eps

  monkeypatch.setattr(rollout_lib.episodes, "rollout", rewarded)  # what the sources call
  cfg = OPD.replace(weighting=dict(schedule="uniform"), rollout=dict(group_size=3),
                    loss=dict(grpo_coef=grpo_coef))
  source, pool = _source(cfg, mesh, teachers)
  batch, metrics = source.next_batch(types.SimpleNamespace(params=student), 0)
  assert seen == [grpo_coef > 0]
  if not grpo_coef:
    assert not set(loss_lib.GRPO_KEYS) & set(batch) and "advantage/abs_mean" not in metrics
    return
  eps = recorded[0]
  ids = np.asarray([ep.example.id for ep in eps])
  r = np.asarray([ep.reward.reward for ep in eps], np.float64)
  want = np.zeros_like(r)
  for pid in set(ids):
    on = ids == pid
    assert on.sum() == cfg.rollout.group_size
    want[on] = (r[on] - r[on].mean()) / (r[on].std() + 1e-6)
  adv = np.asarray(batch["advantages"])
  assert len(set(ids)) == cfg.rollout.prompts_per_step and np.abs(want).max() > 1.0
  # float32 storage of a float64 value.
  np.testing.assert_allclose(adv, want, rtol=4 * EPS32, atol=0)
  assert metrics["advantage/abs_mean"] == pytest.approx(np.abs(want).mean(), rel=4 * EPS32)
  host = rollout_lib.batch_episodes(eps, seq_len=batch["tokens"].shape[1], pad_id=TOK.pad_id)
  np.testing.assert_array_equal(np.asarray(batch["old_logprobs"]), host["old_logprobs"])
  assert np.abs(host["old_logprobs"]).sum() > 0
  loss_fn = loss_lib.make_opd_loss(STUDENT, pool.heads, cfg.loss,
                                   sampling_temperature=cfg.rollout.temperature)
  loss, m = loss_fn(student, batch, None)
  # Sampled at the same params: ratio 1 up to the sampler's float32 rounding.
  # Sampled at the same params: each log-ratio is the float32 rounding of two
  # programs' logits, |δ| <= (D + V)·eps·(1 + max|z|), so the ratio is 1 to 2|δ|.
  z_max = float(jnp.max(jnp.abs(forward(STUDENT, student, batch["tokens"], None,
                                        batch["mask"]).logits)))
  bound = 2 * (STUDENT.d_model + V) * EPS32 * (1 + z_max / cfg.rollout.temperature)
  assert np.isfinite(float(loss)) and abs(float(m["grpo_ratio_mean"]) - 1) <= bound
