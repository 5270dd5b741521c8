"""Shared test problems and the float64 numpy oracle for the fused KL losses.

The oracle is written from the definitions (log-softmax, Σ p log(p/q)) in
numpy float64, independently of both the jnp reference and the online
statistics of ``pallas_kernels.tile_math``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fused_reverse_kl

DS = 32                     # student width
DT = (40, 16, 24)           # teacher widths (≠ DS, not all multiples of 16)
# Peaked logits (``make_problem(peak=PEAK)``): N_PEAK entries sit PEAK/τ above
# the rest, so the logits of a row span > 88 = ln(float32 max) units and
# exp(z − shift) overflows unless the shift is the running max (a mean of a
# tile, or a stale max, fails). The softmax still spreads over the N_PEAK
# entries, in student and teachers alike, so KL and the gradients stay O(1)
# and well conditioned. One such case runs on every path (test_kl_chunked.py,
# test_kl_pallas.py).
PEAK, N_PEAK = 100.0, 8


@dataclasses.dataclass
class Problem:
  h_s: jax.Array
  w_s: jax.Array
  h_k: list
  w_k: list
  weights: jax.Array
  mask: jax.Array | None
  cot: tuple                # random cotangents for (loss [T], kl [T,K], entropy [T])


def make_problem(t: int, v: int, k: int, *, dtype=jnp.float32, with_mask=True, seed=0,
                 scale=2.0, peak=0.0) -> Problem:
  """Random problem: logits ~ N(0, scale²); weights with an all-zero row, a
  one-hot row and an exact-zero entry; a mask with ~70% of tokens on.

  ``peak > 0`` makes the logits peaked (see ``PEAK``): hidden feature 0 of the
  student and of every teacher becomes the constant ``peak``, and its head row
  is 1 on the same ``N_PEAK`` vocabulary entries (spread over the tiles) and 0
  elsewhere. (A head row of ``peak`` would make ``dh_s[:, 0] = Σ_i dz_i·peak``
  a float32 cancellation of ``peak``-sized terms; a row of ones keeps it O(dz).)
  """
  rng = np.random.default_rng(seed)
  h_s = rng.normal(size=(t, DS))
  w_s = rng.normal(size=(DS, v)) * scale / np.sqrt(DS)
  h_k = [rng.normal(size=(t, DT[i])) for i in range(k)]
  # Teachers near the student (so KL is O(0.1-1)) but not equal to it.
  w_k = [rng.normal(size=(DT[i], v)) * scale / np.sqrt(DT[i]) for i in range(k)]
  weights = rng.uniform(0.1, 1.0, size=(t, k))
  if t > 1:
    weights[1] = 0.0              # all-zero weights: loss 0
  if t > 2 and k > 1:
    weights[2] = 0.0
    weights[2, k - 1] = 3.0       # one-hot (unnormalised)
  if t > 3 and k > 1:
    weights[3, 0] = 0.0           # one teacher absent
  mask = None
  if with_mask:
    mask = rng.uniform(size=t) < 0.7
    mask[0] = True
  if peak:
    top = np.linspace(0, v - 1, min(N_PEAK, v)).astype(int)
    for h, w in zip([h_s] + h_k, [w_s] + w_k):
      h[:, 0] = peak
      w[0] = 0.0
      w[0, top] = 1.0
  cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
  cot = (rng.normal(size=t), rng.normal(size=(t, k)), rng.normal(size=t))
  return Problem(cast(h_s), cast(w_s), [cast(h) for h in h_k], [cast(w) for w in w_k],
                 jnp.asarray(weights, jnp.float32), None if mask is None else jnp.asarray(mask),
                 tuple(jnp.asarray(c, jnp.float32) for c in cot))


def f64(a) -> np.ndarray:
  """float64 numpy copy; jax arrays (incl. bf16) go through float32 exactly."""
  if isinstance(a, np.ndarray):
    return a.astype(np.float64)
  return np.asarray(jnp.asarray(a, jnp.float32), dtype=np.float64)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
  m = x.max(axis=-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def np_logits(h, w, tau):
  return f64(h) @ f64(w) / tau


def np_weights(weights, mask):
  w = f64(weights)
  tot = w.sum(axis=1, keepdims=True)
  present = tot > 0
  if mask is not None:
    present &= np.asarray(mask)[:, None]
  return np.where(present, w / np.where(tot > 0, tot, 1.0), 0.0)


def np_reverse_kl(p: Problem, tau: float, h_s=None, w_s=None):
  """(loss [T], kl [T, K], entropy [T]) in float64; kl/entropy 0 off-mask."""
  lp = np_log_softmax(np_logits(p.h_s if h_s is None else h_s, p.w_s if w_s is None else w_s, tau))
  pr = np.exp(lp)
  kl = np.stack([(pr * (lp - np_log_softmax(np_logits(h, w, tau)))).sum(-1)
                 for h, w in zip(p.h_k, p.w_k)], axis=1)
  ent = -(pr * lp).sum(-1)
  loss = (np_weights(p.weights, p.mask) * kl).sum(1)
  if p.mask is not None:
    m = np.asarray(p.mask)
    kl, ent = kl * m[:, None], ent * m
  return loss, kl, ent


def np_objective_grads(p: Problem, tau: float):
  """Analytic float64 gradient of :func:`np_objective` w.r.t. (h_s, W_s).

  Softmax calculus, with p = softmax(z), lp = log p, lq_k = log q_k:
  ``∂KL_k/∂z = p((lp − lq_k) − KL_k)``, ``∂H/∂z = −p(lp + H)``; the objective
  weights KL_k by ``c ŵ_k + c_kl,k m`` and H by ``c_ent m`` (m the mask), and
  ``z = h_s W_s / τ``. Checked against central differences of
  :func:`np_objective` in test_kl_properties.py.
  """
  h, w = f64(p.h_s), f64(p.w_s)
  lp = np_log_softmax(h @ w / tau)
  pr = np.exp(lp)
  m = np.ones(lp.shape[0]) if p.mask is None else np.asarray(p.mask, np.float64)
  c, ck, ce = (f64(x) for x in p.cot)
  a = c[:, None] * np_weights(p.weights, p.mask) + ck * m[:, None]   # [T, K]
  dz = np.zeros_like(lp)
  for k, (hk, wk) in enumerate(zip(p.h_k, p.w_k)):
    d = lp - np_log_softmax(np_logits(hk, wk, tau))
    kl = (pr * d).sum(-1, keepdims=True)
    dz += a[:, k:k + 1] * pr * (d - kl)
  ent = -(pr * lp).sum(-1, keepdims=True)
  dz -= (ce * m)[:, None] * pr * (lp + ent)
  return dz @ w.T / tau, h.T @ dz / tau


def np_objective(p: Problem, tau: float, h_s=None, w_s=None) -> float:
  """Σ c·loss + Σ c_kl·kl + Σ c_ent·entropy with the problem's cotangents."""
  loss, kl, ent = np_reverse_kl(p, tau, h_s, w_s)
  c, ck, ce = (f64(x) for x in p.cot)
  return float((c * loss).sum() + (ck * kl).sum() + (ce * ent).sum())


# Interpret-mode Pallas and scanned kernels spend their test time in XLA:CPU
# compilation, not execution; LLVM's optimisation level changes neither the
# program nor (beyond float reassociation) its results, and -O0 compiles ~30%
# faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def objective_and_grads(fns, p: Problem):
  """jit(value_and_grad) of the cotangent-weighted objective of each ``fn``.

  Args:
    fns: one ``fn(h_s, w_s, h_k, w_k, weights, mask) -> (loss, aux)`` or a
      tuple of them; a tuple is compiled as one XLA program (the test time
      is compilation, and one program compiles faster than several).
    p: the problem. Every array is a jit argument: closed-over teacher arrays
      would be constants that XLA constant-folds through the materialised
      reference (seconds per case).

  Returns:
    ((objective, (loss, kl, ent)), (dh_s, dW_s)) per fn (a tuple if ``fns``
    was one).
  """
  single = callable(fns)
  fns = (fns,) if single else tuple(fns)

  def one(fn, h_s, w_s, h_k, w_k, weights, mask, cot):
    def obj(h_s, w_s):
      c, ck, ce = cot
      loss, aux = fn(h_s, w_s, h_k, w_k, weights, mask)
      val = jnp.sum(c * loss) + jnp.sum(ck * aux["kl"]) + jnp.sum(ce * aux["entropy"])
      return val, (loss, aux["kl"], aux["entropy"])
    return jax.value_and_grad(obj, argnums=(0, 1), has_aux=True)(h_s, w_s)

  run = jax.jit(lambda *args: tuple(one(fn, *args) for fn in fns), compiler_options=FAST_COMPILE)
  out = run(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, p.mask, p.cot)
  return out[0] if single else out


def rel_err(a, b) -> float:
  """max |a − b| / max |b| (b the trusted value)."""
  a, b = f64(a), f64(b)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


EPS32 = float(np.finfo(np.float32).eps)
BF16_U = 2.0 ** -8  # bf16 unit round-off (8 significant bits)


def logit_scale(p: Problem, tau: float) -> float:
  """max |logit| over the student and every teacher (float64)."""
  zs = [np_logits(p.h_s, p.w_s, tau)] + [np_logits(h, w, tau) for h, w in zip(p.h_k, p.w_k)]
  return float(max(np.abs(z).max() for z in zs))


def tolerances(p: Problem, tau: float, dtype) -> tuple[float, float]:
  """(atol of loss / kl / entropy, max-norm rtol of the gradients) vs the oracle.

  Forward: float32 accumulation for both dtypes (bf16 inputs are exact in
  float64). Each logit is a dot product of D <= max(DS, DT) terms, off by
  ~sqrt(D)·eps relative to the logit scale z_max; KL = E_p[z − x] − lse(z) +
  lse(x) combines a handful of such terms: atol = 8·sqrt(D)·eps·z_max (~7e-5
  at z_max ≈ 12, ~8e-4 with PEAK at τ = 0.7). Backward: dz multiplies softmax
  weights by logit differences, so its relative error is ~sqrt(D)·eps·z_max
  too (×2 margin); bf16 also rounds dz and the returned gradients to 8 bits,
  ≤ u each, plus u for the contraction of rounded dz: + 3u.
  """
  d = max(DS, *DT)
  z_max = logit_scale(p, tau)
  atol = 8 * np.sqrt(d) * EPS32 * z_max
  grad_rtol = 2 * np.sqrt(d) * EPS32 * z_max
  if jnp.dtype(dtype) == jnp.bfloat16:
    grad_rtol += 3 * BF16_U
  return atol, grad_rtol


def check_against_oracle(impl, block_sizes, p: Problem, tau: float, dtype):
  """Runs ``fused_reverse_kl(impl=...)`` on ``p``; compares loss, per-teacher
  KL, entropy and the objective's gradients with the float64 oracle."""
  (_, (loss, kl, ent)), grads = objective_and_grads(
      lambda *args: fused_reverse_kl(*args, temperature=tau, impl=impl,
                                     block_sizes=block_sizes, return_aux=True), p)
  loss_o, kl_o, ent_o = np_reverse_kl(p, tau)
  atol, grad_rtol = tolerances(p, tau, dtype)
  assert loss.dtype == jnp.float32 and loss.shape == p.h_s.shape[:1]
  np.testing.assert_allclose(f64(loss), loss_o, atol=atol, rtol=0)
  np.testing.assert_allclose(f64(kl), kl_o, atol=atol, rtol=0)
  np.testing.assert_allclose(f64(ent), ent_o, atol=atol, rtol=0)
  for g, g_o, x in zip(grads, np_objective_grads(p, tau), (p.h_s, p.w_s)):
    assert g.dtype == x.dtype and g.shape == x.shape
    assert np.isfinite(f64(g)).all()
    assert rel_err(g, g_o) < grad_rtol, (rel_err(g, g_o), grad_rtol)
