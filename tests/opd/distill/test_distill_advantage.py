"""OPD's advantage form (opd.distill.advantage) against independent references.

* Enumeration: V = 4, three response tokens, all 64 responses with their
  probabilities under the student. The expected advantage-form gradient
  ``Σ_y p(y) ∇L(y)`` (each ``∇L(y)`` from the real loss on that one row)
  equals the gradient of the sequence-level reverse KL with γ = 1, and of
  the per-token reverse KL (prefixes held fixed) with γ = 0; both
  references are plain ``log_softmax`` on materialised logits.
* β = 0 is GRPO's update: the gradient of ``opd.rl.loss.make_grpo_loss``.
* Truncated importance weights change nothing on-policy, and on stale
  samples give ``−min(r, c) Â`` with the truncated share counted.
* The teacher's sampled-token log-prob from cached hidden states equals a
  numpy log-softmax; the discounted sum equals a loop; bad fields are refused.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.distill import advantage as adv_lib
from opd.distill import loss as loss_lib
from opd import rollout as rollout_lib
from opd.distill.source import OPDConfig
from opd.distill.teachers import Teacher
from opd.distill.trainer import train_opd
from opd.models import ModelConfig, forward, head_matrix
from opd.rl.config import GRPOConfig
from opd.rl.loss import make_grpo_loss
from opd.tasks import Reward
from opd.training.loop_config import LoopConfig, RunIO, Runtime

from test_distill_loss import STUDENT as SMALL, WIDE as SMALL_WIDE, _hidden, _model
from test_distill_grpo_term import _math_prompts
from test_distill_trainer import (  # noqa: F401
    OPD, OPTIM, STUDENT as T_STUDENT, TOK, _one_batch, mesh, student, teachers)

EPS32 = float(np.finfo(np.float32).eps)
# The enumerable problem: V = 4, a one-token prompt, N = 3 response tokens.
VE, N, TAU = 4, 3, 0.9
ENUM_S = ModelConfig(vocab_size=VE, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16)
ENUM_T = ModelConfig(vocab_size=VE, d_model=12, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24)
# Teacher weights by response position (two teachers): a row-independent
# schedule, so the γ = 1 identity holds for the weighted log-prob mixture.
W_POS = np.asarray([[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]], np.float32)


def _tree_norm(tree) -> float:
  return float(np.sqrt(sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(tree))))


@pytest.fixture(scope="module")
def enum():
  """Every response y ∈ {0..3}³ after prompt token 1, its probability, the
  teachers' cached hidden states and the per-token reference quantities."""
  ys = np.stack(np.meshgrid(*[np.arange(VE)] * N, indexing="ij"), -1).reshape(-1, N)
  rows = np.concatenate([np.ones((len(ys), 1), np.int32), ys.astype(np.int32)], axis=1)
  tokens, targets = rows[:, :-1], rows[:, 1:]
  mask = np.ones(tokens.shape, bool)
  student = _model(ENUM_S, 0, head_scale=60.0)
  teachers = [(ENUM_T, _model(ENUM_T, 1, head_scale=60.0)), (ENUM_S, _model(ENUM_S, 2, 60.0))]
  hidden = [_hidden(c, p, tokens, mask) for c, p in teachers]
  heads = [head_matrix(c, p) for c, p in teachers]
  # The teachers' log-probs at T (materialised, float64): the mixture Σ_k ŵ log q_k.
  lq = sum(W_POS[None, :, k, None] * _log_softmax64(
      np.asarray(h, np.float64) @ np.asarray(w, np.float64) / TAU)
      for k, (h, w) in enumerate(zip(hidden, heads)))  # [64, N, V]
  z = np.asarray(forward(ENUM_S, student, tokens, None, mask).logits, np.float64) / TAU
  lp = _log_softmax64(z)
  lp_y = np.take_along_axis(lp, targets[..., None], -1)[..., 0]
  prob = np.exp(lp_y.sum(1))
  assert abs(prob.sum() - 1) < 1e-5  # the 64 responses are every outcome
  return dict(tokens=tokens, targets=targets, mask=mask, student=student, hidden=hidden,
              heads=heads, lq=jnp.asarray(lq, jnp.float32), lp_y=lp_y, prob=prob,
              lq_y=np.take_along_axis(lq, targets[..., None], -1)[..., 0], z=z)


def _log_softmax64(z):
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _ref_logprobs(params, e):
  """[64, N, V] student log-probs at T from materialised logits."""
  return jax.nn.log_softmax(forward(ENUM_S, params, e["tokens"], None, e["mask"]).logits / TAU, -1)


def _take(lp, targets):
  return jnp.take_along_axis(lp, jnp.asarray(targets)[..., None], -1)[..., 0]


def _expected_advantage_grad(e, gamma):
  """``Σ_y p(y) ∇L(y)``: the real loss on each one-row batch, on-policy."""
  cfg = loss_lib.OPDLossConfig(form="advantage", adv_gamma=gamma)
  fn = loss_lib.make_opd_loss(ENUM_S, e["heads"], cfg, sampling_temperature=TAU)
  grad = jax.jit(jax.grad(lambda p, b: fn(p, b, None)[0]))
  total = None
  for i in range(len(e["prob"])):
    row = {"tokens": e["tokens"][i:i + 1], "targets": e["targets"][i:i + 1],
           "mask": e["mask"][i:i + 1], "loss_mask": np.ones((1, N), np.float32),
           "teacher_hidden": [h[i:i + 1] for h in e["hidden"]],
           "teacher_weights": W_POS[None], "old_logprobs": e["lp_y"][i:i + 1].astype(np.float32)}
    g = jax.tree.map(lambda x: e["prob"][i] * np.asarray(x, np.float64), grad(e["student"], row))
    total = g if total is None else jax.tree.map(np.add, total, g)
  return total


def _error_bound(e, gamma):
  """A bound on |expected gradient − reference| from float32 rounding.

  Per token, log p and log q carry |δ| <= δ1 = (D + V)·eps·(1 + max|z|) (a
  D-term dot product and a V-term logsumexp), so each advantage, a sum of at
  most N log-ratios, is off by <= 2·N·δ1. The per-token gradients
  J_t = ∇log p(y_t) (the jacobian, computed here) come from two autodiff
  programs whose every stage reduces at most n = max(D, F, V, T) terms: a
  relative error ρ <= 4·(2L + 2)·n·eps over the 2L + 2 stages (worst case
  n·eps each). One response then moves by Σ_t (2Nδ1 + ρ(|Â_t| + 1))·|J_t|
  (the "+ 1": the reference's own score term), the expectation by the
  p(y)-weighted sum of that, the token mean by 1/N; ×2 for the two sides.
  """
  jac = jax.jacrev(lambda p: _take(_ref_logprobs(p, e), e["targets"]))(e["student"])
  jnorm = np.sqrt(sum(np.asarray(jnp.sum(jnp.square(x.reshape(x.shape[:2] + (-1,))), -1),
                                 np.float64) for x in jax.tree.leaves(jac)))  # [64, N]
  a = e["lq_y"] - e["lp_y"]
  adv = np.asarray(adv_lib.discounted_future_sum(jnp.asarray(a), jnp.ones(a.shape, bool),
                                                 gamma), np.float64)
  d1 = (ENUM_S.d_model + VE) * EPS32 * (1 + np.abs(e["z"]).max())
  rho = 4 * (2 * ENUM_S.n_layers + 2) * max(ENUM_S.d_model, ENUM_S.d_ff, VE, N) * EPS32
  per_row = ((2 * N * d1 + rho * (np.abs(adv) + 1)) * jnorm).sum(1)
  return 2 * float((e["prob"] * per_row).sum()) / N


def _diff(a, b) -> float:
  return _tree_norm(jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y), a, b))


def test_enumerated_advantage_gradient_equals_sequence_and_per_token_reverse_kl(enum):
  """γ = 1: Σ_y p(y) ∇L(y) = ∇KL(p(y) ‖ Q(y)) / N with log Q(y) = Σ_t Σ_k ŵ_tk
  log q_k(y_t | y_<t); γ = 0: = ∇ Σ_y sg[p(y)] Σ_t Σ_k ŵ_tk KL(p_t ‖ q_kt) / N,
  the per-token (exact-form) reverse KL. The two references differ by far
  more than the bound, so each equality picks out its γ."""
  e = enum

  def kl_sequence(params):
    lp_y = _take(_ref_logprobs(params, e), e["targets"]).sum(1)
    return jnp.sum(jnp.exp(lp_y) * (lp_y - jnp.asarray(e["lq_y"].sum(1), jnp.float32)))

  def kl_per_token(params):
    lp = _ref_logprobs(params, e)
    p_y = jax.lax.stop_gradient(jnp.exp(_take(lp, e["targets"]).sum(1)))
    kl_t = jnp.sum(jnp.exp(lp) * (lp - e["lq"]), -1)  # Σ_k ŵ_k KL(p_t ‖ q_k,t), [64, N]
    return jnp.sum(p_y[:, None] * kl_t)

  want = {1.0: jax.tree.map(lambda g: g / N, jax.grad(kl_sequence)(e["student"])),
          0.0: jax.tree.map(lambda g: g / N, jax.grad(kl_per_token)(e["student"]))}
  gap = _diff(want[1.0], want[0.0])
  for gamma in (1.0, 0.0):
    tol = _error_bound(e, gamma)
    got = _expected_advantage_grad(e, gamma)
    assert _tree_norm(want[gamma]) > 100 * tol and gap > 100 * tol, (gamma, tol, gap)
    assert _diff(got, want[gamma]) <= tol, (gamma, _diff(got, want[gamma]), tol)


# --- β = 0 is GRPO; importance weights --------------------------------------------------------
B, T = 4, 10


@pytest.fixture(scope="module")
def rl_batch():
  """One teacher, old log-probs off the current ones by up to ±0.5 (both clip
  sides hit), advantages of both signs; the current log-probs in float64."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, SMALL.vocab_size, size=(B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[2, 7:] = False
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, 3:] = 1.0
  student, teacher = _model(SMALL, 0, head_scale=20.0), _model(SMALL_WIDE, 1, head_scale=20.0)
  z = np.asarray(forward(SMALL, student, tokens[:, :-1], None, mask).logits, np.float64) / TAU
  logp = np.take_along_axis(_log_softmax64(z), tokens[:, 1:, None], -1)[..., 0]
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
           "loss_mask": loss_mask * mask,
           "teacher_hidden": [_hidden(SMALL_WIDE, teacher, tokens[:, :-1], mask)],
           "teacher_weights": np.ones((B, T, 1), np.float32),
           "old_logprobs": (logp + rng.uniform(-0.5, 0.5, logp.shape)).astype(np.float32),
           "advantages": np.asarray([1.3, -0.8, 0.4, -1.9], np.float32)}
  return batch, student, (head_matrix(SMALL_WIDE, teacher),), z, logp


@functools.partial(jax.jit, static_argnames=("cfg",))
def _opd_grad(params, batch, heads, cfg):
  fn = loss_lib.make_opd_loss(SMALL, heads, cfg, sampling_temperature=TAU)
  return jax.value_and_grad(fn, has_aux=True)(params, batch, None)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_beta_zero_is_exactly_the_grpo_update(rl_batch, aggregation):
  """β = 0, α = 1: loss and gradient of GRPO's own loss (make_grpo_loss, its
  clipped surrogate on materialised logits) on the same batch. They differ
  only in how log p(y) is computed (fused cross-entropy vs log_softmax):
  |δ log p| <= δ1 = (D + V)·eps·(1 + max|z|) per token, moving each token's
  term by max|A|·max r·δ1; the gradient's elements by that times their scale."""
  batch, student, heads, z, logp = rl_batch
  cfg = loss_lib.OPDLossConfig(form="advantage", adv_beta=0.0, adv_alpha=1.0,
                               aggregation=aggregation)
  (loss, m), g = _opd_grad(student, batch, heads, cfg)
  grpo = GRPOConfig(kl_coef=0.0, temperature=TAU, loss_aggregation=aggregation)
  plain = {k: batch[k] for k in ("tokens", "targets", "mask", "loss_mask", "old_logprobs",
                                 "advantages")}
  (want_loss, _), want_g = jax.value_and_grad(make_grpo_loss(SMALL, grpo), has_aux=True)(
      student, plain, None)
  keep = batch["loss_mask"] > 0
  r = np.exp(logp - batch["old_logprobs"])[keep]
  assert (r < 1 - grpo.clip_eps_low).any() and (r > 1 + grpo.clip_eps_high).any()
  delta = (SMALL.d_model + SMALL.vocab_size) * EPS32 * (1 + np.abs(z).max())
  tol = float(np.abs(batch["advantages"]).max() * r.max() * delta)
  assert abs(float(want_loss)) > 100 * tol
  assert float(loss) == pytest.approx(float(want_loss), abs=tol)
  assert float(m["clip_frac_low"]) > 0 and float(m["clip_frac_high"]) > 0
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want_g))
  for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=scale * delta * 4 + 4 * EPS32 * float(jnp.max(jnp.abs(got))))


def test_importance_weights_change_nothing_on_policy_and_truncate_stale_tokens(rl_batch):
  """Behaviour = current policy (old log-probs = the current ones): r = 1 up
  to 2·δ1, below any cap, so the truncated-IS gradient −min(r, c)·Â·∇log p
  equals the clipped surrogate's −r·Â·∇log p. Each token's cotangent c_t
  differs by a few roundings (4 eps relative), and the two compiled backward
  passes may reorder their reductions (relative ρ <= (2L + 2)·n·eps, n =
  max(D, F, V, T)), so an element moves by at most (4·eps + ρ)·max_t|c_t|·
  Σ_t|J_t,i| (J the per-token jacobian, computed here).
  Stale samples: the loss is Σ_t coef_t·(−min(r_t, c)·Â_t) (numpy), its
  gradient Σ_t coef_t·(−min(r_t, c)·Â_t)·J_t (a truncated token keeps the
  weight c, it is not dropped), the truncated share is the count of r_t > c,
  and the gradient differs from the clipped surrogate's."""
  batch, student, heads, z, logp = rl_batch
  on = {**batch, "old_logprobs": logp.astype(np.float32)}
  base = dict(form="advantage", adv_alpha=0.5, adv_gamma=0.5)
  clip_cfg = loss_lib.OPDLossConfig(**base)
  is_cfg = loss_lib.OPDLossConfig(**base, is_cap=1.2)
  (l0, m0), g0 = _opd_grad(student, on, heads, clip_cfg)
  (l1, m1), g1 = _opd_grad(student, on, heads, is_cfg)
  assert float(m1["is_truncated_frac"]) == 0.0
  keep = batch["loss_mask"] > 0

  def logp_fn(p):
    zz = forward(SMALL, p, batch["tokens"], None, batch["mask"]).logits / TAU
    return _take(jax.nn.log_softmax(zz, -1), batch["targets"])

  jac = jax.jacrev(logp_fn)(student)
  # |c_t| <= coef·|Â|·r: Â bounded by α·max|A| + Σ_t |log-ratio| (γ <= 1).
  a_max = 0.5 * np.abs(batch["advantages"]).max() + float(m0["adv/opd_abs_mean"]) * keep.sum()
  c_max = a_max * 1.01 / keep.sum()
  rho = (2 * SMALL.n_layers + 2) * max(SMALL.d_model, SMALL.d_ff, SMALL.vocab_size, T) * EPS32
  for got, want, j in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), jax.tree.leaves(jac)):
    kept = np.asarray(j) * keep[(...,) + (None,) * (j.ndim - 2)]
    bound = (4 * EPS32 + rho) * c_max * np.abs(kept).sum((0, 1))
    np.testing.assert_array_less(np.abs(np.asarray(got) - np.asarray(want)), bound + 1e-30)
  # The values: Σ_t coef_t·r_t·Â_t both, r from two programs' log p (|δr| <= 2·δ1·r).
  d1 = (SMALL_WIDE.d_model + SMALL.vocab_size) * EPS32 * (1 + np.abs(z).max())
  assert float(l1) == pytest.approx(float(l0), abs=a_max * 1.01 * (2 * d1 + 8 * EPS32))

  # Stale samples: numpy value of the truncated-IS loss.
  (l2, m2), g2 = _opd_grad(student, batch, heads, is_cfg)
  (l3, m3), g3 = _opd_grad(student, batch, heads, clip_cfg)
  r = np.exp(logp - batch["old_logprobs"])
  assert float(m2["is_truncated_frac"]) == pytest.approx((r[keep] > 1.2).mean(), abs=1e-6)
  assert 0 < float(m2["is_truncated_frac"]) < 1
  lq = np.asarray(_teacher_logprob_np(batch, heads))
  a = np.where(keep, lq - logp, 0.0)
  adv_opd = np.asarray(adv_lib.discounted_future_sum(jnp.asarray(a), jnp.asarray(keep), 0.5))
  adv = np.where(keep, adv_opd + 0.5 * batch["advantages"][:, None], 0.0)
  want = float((-np.minimum(r, 1.2) * adv)[keep].mean())
  # δ1 per log-prob (d1, the wider teacher's D); per token min(r, c)·Â moves by
  # <= max|Â|·r·δ1 (r <= e^0.5 < 2) + c·|δÂ|, |δÂ| <= 2·T·δ1 (two log-probs
  # per term, at most T terms).
  assert float(l2) == pytest.approx(want, abs=(2 * np.abs(adv).max() + 1.2 * 2 * T) * d1)
  # Its gradient: Σ_t c_t J_t with c_t = coef_t·(−min(r_t, c)·Â_t) (the weight
  # held fixed, also where it truncates). Per element: the cotangents' error
  # |δc_t| <= coef·(c·2·T·d1 + |Â_t|·r_t·2·d1) plus ρ·|c_t| from the backward.
  coef = keep / keep.sum()
  c_t = coef * -np.minimum(r, 1.2) * adv
  dc_t = coef * (1.2 * 2 * T * d1 + np.abs(adv) * r * 2 * d1) + rho * np.abs(c_t)
  for got, j in zip(jax.tree.leaves(g2), jax.tree.leaves(jac)):
    j = np.asarray(j, np.float64)
    ex = (...,) + (None,) * (j.ndim - 2)
    want_g = (c_t[ex] * j).sum((0, 1))
    np.testing.assert_array_less(np.abs(np.asarray(got) - want_g),
                                 (dc_t[ex] * np.abs(j)).sum((0, 1)) + 1e-30)
  assert _diff(g2, g3) > 0.01 * _tree_norm(g3)


def _teacher_logprob_np(batch, heads):
  """log q(y_t) at T in float64 from the cached hidden states (one teacher)."""
  h = np.asarray(batch["teacher_hidden"][0], np.float64)
  lq = _log_softmax64(h @ np.asarray(heads[0], np.float64) / TAU)
  return np.take_along_axis(lq, batch["targets"][..., None], -1)[..., 0]


def test_teacher_token_logprobs_from_the_cache_match_numpy(enum):
  """Σ_k ŵ_k log q_k(y_t) from hidden states and heads (gathered logit + the
  logsumexp pass) against a float64 log_softmax: both log-probs are float32
  dot products of D terms and a V-term logsumexp, |δ| <= (D + V)·eps·(1 + max|x|)."""
  e = enum
  n = e["tokens"].size
  w = np.tile(W_POS, (len(e["prob"]), 1))
  got = adv_lib.teacher_token_logprobs([h.reshape(n, -1) for h in e["hidden"]], e["heads"],
                                       jnp.asarray(w), jnp.asarray(e["targets"].reshape(n)),
                                       temperature=TAU)
  x_max = max(float(np.abs(np.asarray(h.reshape(n, -1)) @ np.asarray(hd)).max()) / TAU
              for h, hd in zip(e["hidden"], e["heads"]))
  tol = (ENUM_T.d_model + VE) * EPS32 * (1 + x_max)
  np.testing.assert_allclose(np.asarray(got), e["lq_y"].reshape(n), rtol=0, atol=tol)
  # A teacher with weight 0 is not asked: zeroing teacher 1's weight drops its term.
  w1 = np.concatenate([np.ones((n, 1)), np.zeros((n, 1))], 1).astype(np.float32)
  only0 = adv_lib.teacher_token_logprobs([h.reshape(n, -1) for h in e["hidden"]], e["heads"],
                                         jnp.asarray(w1), jnp.asarray(e["targets"].reshape(n)),
                                         temperature=TAU)
  lq0 = _log_softmax64(np.asarray(e["hidden"][0].reshape(n, -1), np.float64)
                       @ np.asarray(e["heads"][0], np.float64) / TAU)
  np.testing.assert_allclose(np.asarray(only0), lq0[np.arange(n), e["targets"].reshape(n)],
                             rtol=0, atol=tol)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_discounted_future_sum_matches_a_loop(gamma):
  """Right-to-left sums over the kept tokens only (a gap is not a step), by a
  python loop in float64; float32 sums of <= T terms: T·eps·Σ|x|."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(5, 9)).astype(np.float32)
  keep = rng.random((5, 9)) > 0.3
  want = np.zeros((5, 9))
  for b in range(5):
    for t in np.flatnonzero(keep[b]):
      later = [u for u in range(t, 9) if keep[b, u]]
      want[b, t] = sum(gamma ** i * float(x[b, u]) for i, u in enumerate(later))
  got = np.asarray(adv_lib.discounted_future_sum(jnp.asarray(x), jnp.asarray(keep), gamma))
  np.testing.assert_allclose(got, want, rtol=0, atol=9 * EPS32 * np.abs(x).sum(1).max())
  assert np.all(got[~keep] == 0)


@pytest.mark.parametrize("fields, match", [
    (dict(form="kl"), "form must be one of"),
    (dict(form="advantage", adv_gamma=1.5), "adv_gamma"),
    (dict(form="advantage", adv_alpha=-0.1), "adv_alpha"),
    (dict(form="advantage", is_cap=0.5), r"is_cap=0.5 must be 0"),
    (dict(form="advantage", adv_beta=0.0), "adv_beta=0 and adv_alpha=0"),
    (dict(form="advantage", grpo_coef=0.2), "grpo_coef=0.2 belongs to the exact form"),
    (dict(form="advantage", estimator="token"), "estimator='token' belongs to the exact"),
    (dict(adv_gamma=1.0), r"\{'adv_gamma': 1.0\} only apply with form='advantage'"),
    (dict(is_cap=2.0), r"\{'is_cap': 2.0\} only apply"),
])
def test_bad_fields_are_refused_by_name(fields, match):
  with pytest.raises(ValueError, match=match):
    OPDConfig(loss=loss_lib.OPDLossConfig(**fields))


def test_the_advantage_form_asks_for_its_batch_keys(rl_batch):
  """The behaviour log-probs always; the outcome advantages only with α > 0."""
  batch, student, heads, _, _ = rl_batch
  cfg = loss_lib.OPDLossConfig(form="advantage", adv_alpha=1.0)
  fn = loss_lib.make_opd_loss(SMALL, heads, cfg)
  with pytest.raises(ValueError, match=r"missing \['advantages'\]"):
    fn(student, {k: v for k, v in batch.items() if k != "advantages"}, None)
  pure = loss_lib.make_opd_loss(SMALL, heads, loss_lib.OPDLossConfig(form="advantage"))
  with pytest.raises(ValueError, match=r"missing \['old_logprobs'\]"):
    pure(student, {k: v for k, v in batch.items() if k != "old_logprobs"}, None)
  loss, _ = pure(student, {k: v for k, v in batch.items() if k != "advantages"}, None)
  assert np.isfinite(float(loss))
  assert OPDConfig(loss=loss_lib.OPDLossConfig(form="advantage", adv_alpha=0.5)).verifies
  assert not OPDConfig(loss=loss_lib.OPDLossConfig(form="advantage")).verifies


# --- through the source, the teacher pool and the one loop ------------------------------------


def test_the_source_feeds_the_advantage_form_its_behaviour_logprobs(mesh, student, teachers):
  """α = 0: no verification, no outcome advantages; the sampler's log-probs
  are in the batch (the behaviour policy of the ratio)."""
  cfg = OPD.replace(weighting=dict(schedule="uniform"), loss=dict(form="advantage"))
  batch, metrics, loss, aux, _ = _one_batch(student, teachers, mesh, cfg)
  assert "advantages" not in batch and "reward/mean" not in metrics
  assert np.abs(np.asarray(batch["old_logprobs"])).sum() > 0 and np.isfinite(loss)
  # Sampled at the same params: the ratio is 1 up to float32 rounding.
  assert abs(float(aux["ratio_mean"]) - 1) < 1e-3 and float(aux["adv/kl_estimate"]) != 0


def test_train_opd_runs_the_advantage_form_with_an_outcome_reward(mesh, student, teachers,
                                                                 monkeypatch):
  """Routing (math prompts to the math teacher), the fault layer, the cache
  and the loop as for the exact form: two rollout batches of two updates
  each (the second update reuses the samples, so the importance weights
  act), a reward that varies within each group (so Â_ORM is not 0), every
  metric finite and the student moved."""
  real_rollout = rollout_lib.rollout

  def rewarded(*args, **kwargs):
    eps = real_rollout(*args, **{**kwargs, "verify": False})
    for i, ep in enumerate(eps):
      ep.reward = Reward(0.5 * (i % 2), 1.0)
    return eps

  monkeypatch.setattr(rollout_lib.episodes, "rollout", rewarded)  # what the sources call
  pool = [Teacher("ta", teachers[0].cfg, teachers[0].params, "math"),
          Teacher("tb", teachers[1].cfg, teachers[1].params, "instruct")]
  cfg = OPD.replace(loss=dict(form="advantage", adv_alpha=0.5, adv_gamma=1.0, is_cap=2.0),
                    updates_per_batch=2)
  run = train_opd(T_STUDENT, student, pool, _math_prompts(8), cfg, OPTIM,
                  LoopConfig(2, progress=False), RunIO(),
                  runtime=Runtime(mesh, seed=0, tokenizer=TOK))
  assert int(run.state.step) == 4
  for m in run.history:
    assert m["reward/mean"] > 0 and m["advantage/abs_mean"] > 0 and m["skips/steps"] == 0
    assert m["weight/ta"] == 1.0 and m["weight/tb"] == 0.0  # routed
    for key in ("train/loss", "train/adv/kl_estimate", "train/adv/abs_mean",
                "train/is_truncated_frac", "train/ratio_mean"):
      assert np.isfinite(m[key]), (key, m[key])
    assert 0 <= m["train/is_truncated_frac"] <= 1
  assert _diff(run.state.params, student) > 0
