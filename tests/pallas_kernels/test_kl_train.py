"""Gradient-in-forward training loss (pallas_kernels.train_loss) against the
float64 oracle and against ``jax.grad`` of the per-token path.

The training loss is ``Σ_t c_t Σ_k ŵ_tk KL_tk``; its oracle is
``kl_problems.np_reverse_kl`` / ``np_objective_grads`` with the cotangent of
the per-token loss set to ``c`` (and 0 for kl / entropy). Cases cover T = 1,
a chunk size C that does not divide T, a remainder vocabulary tile, K = 1
and K = 3 (teacher widths 40, 16, 24 ≠ Ds = 32), τ ≠ 1, bfloat16, zero
coefficients (tokens outside the loss), an all-zero weight row, a one-hot
row, an absent teacher (``make_problem``), negative coefficients and peaked
logits. Each case compiles the reference, the chunked training path and the
per-token chunked path under ``jax.grad`` as one XLA program.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kl_problems as kp
from pallas_kernels import ChunkSizes, TrainChunkSizes, fused_reverse_kl, fused_reverse_kl_train
from pallas_kernels import train_loss


def _coef(p: kp.Problem, seed: int) -> np.ndarray:
  """``mask / n`` scaled by a per-token factor in [0.5, 1.5], one negative entry."""
  rng = np.random.default_rng(seed)
  m = np.ones(p.h_s.shape[0]) if p.mask is None else np.asarray(p.mask, np.float64)
  c = m * rng.uniform(0.5, 1.5, size=m.shape) / max(m.sum(), 1.0)
  if c.size > 4:
    c[4] = -abs(c[4]) - 0.1 / m.size  # any real coefficient, and never 0
  return c


def _oracle(p: kp.Problem, c: np.ndarray, tau: float):
  """(loss, kl [T,K], entropy [T], dh_s, dW_s) in float64."""
  keep = c != 0
  q = dataclasses.replace(p, mask=jnp.asarray(keep),
                          cot=(c, np.zeros((c.size, len(p.h_k))), np.zeros(c.size)))
  loss_t, kl, ent = kp.np_reverse_kl(q, tau)
  dh, dw = kp.np_objective_grads(q, tau)
  return float((c * loss_t).sum()), kl, ent, dh, dw


def _value_and_grads(fns, p: kp.Problem, c):
  """jit(value_and_grad) of each ``fn(h_s, w_s, h_k, w_k, weights, coef) -> (loss, aux)``,
  all compiled as one program; every array is a jit argument (no constant folding)."""
  def one(fn, h_s, w_s, h_k, w_k, weights, coef):
    return jax.value_and_grad(lambda a, b: fn(a, b, h_k, w_k, weights, coef), argnums=(0, 1),
                              has_aux=True)(h_s, w_s)
  run = jax.jit(lambda *args: tuple(one(f, *args) for f in fns), compiler_options=kp.FAST_COMPILE)
  return run(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, jnp.asarray(c, jnp.float32))


def _train(impl, tau, sizes=None, shared_head=None):
  def fn(h_s, w_s, h_k, w_k, weights, coef):
    return fused_reverse_kl_train(h_s, w_s, h_k, w_k, weights, coef, tau, impl=impl,
                                  block_sizes=sizes, shared_head=shared_head, return_aux=True)
  return fn


def _per_token(tau, block_v):
  def fn(h_s, w_s, h_k, w_k, weights, coef):
    loss, aux = fused_reverse_kl(h_s, w_s, h_k, w_k, weights, coef != 0, tau, impl="chunked",
                                 block_sizes=ChunkSizes(block_v), return_aux=True)
    return jnp.sum(coef * loss), aux
  return fn


# (T, V, K, τ, block_t, block_v, dtype, peak)
CASES = [
    (1, 128, 1, 1.0, 8, 64, jnp.float32, 0.0),          # T = 1 < C; two full tiles
    (7, 1000, 3, 0.7, 4, 256, jnp.float32, 0.0),        # 7 = 4 + 3; 1000 = 3·256 + 232
    (128, 1000, 1, 0.7, 48, 512, jnp.float32, 0.0),     # 128 = 2·48 + 32
    (300, 4096, 3, 1.0, 64, 512, jnp.float32, 0.0),     # 300 = 4·64 + 44, 8 tiles
    (37, 384, 3, 1.0, 16, 128, jnp.bfloat16, 0.0),      # bf16 inputs
    (7, 1000, 3, 0.7, 3, 256, jnp.float32, kp.PEAK),    # peaked logits: running max
]


def _id(case):
  t, v, k, tau, bt, bv, dtype, peak = case
  return f"{t=}_{v=}_{k=}_{tau=}_{bt=}_{bv=}_{jnp.dtype(dtype).name}_{peak=}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_train_matches_oracle_and_per_token_path(case):
  t, v, k, tau, bt, bv, dtype, peak = case
  p = kp.make_problem(t, v, k, dtype=dtype, with_mask=True, seed=t + v + k, peak=peak)
  c = _coef(p, seed=t)
  outs = _value_and_grads((_train("reference", tau), _train("chunked", tau, TrainChunkSizes(bt, bv)),
                           _per_token(tau, bv)), p, c)
  loss_o, kl_o, ent_o, dh_o, dw_o = _oracle(p, c, tau)
  atol, grad_rtol = kp.tolerances(p, tau, dtype)
  # The scalar loss sums T per-token losses, each within atol, with weights c.
  loss_atol = atol * np.abs(c).sum()
  for (loss, aux), grads in outs:
    assert loss.shape == () and loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), loss_o, atol=loss_atol, rtol=0)
    np.testing.assert_allclose(kp.f64(aux["kl"]), kl_o, atol=atol, rtol=0)
    np.testing.assert_allclose(kp.f64(aux["entropy"]), ent_o, atol=atol, rtol=0)
    for g, g_o, x in zip(grads, (dh_o, dw_o), (p.h_s, p.w_s)):
      assert g.dtype == x.dtype and g.shape == x.shape
      assert kp.rel_err(g, g_o) < grad_rtol, (kp.rel_err(g, g_o), grad_rtol)
  # Training path vs jax.grad of the per-token path: both are within the
  # oracle's bounds, so they agree within twice them.
  (loss_c, _), grads_c = outs[1]
  (loss_p, _), grads_p = outs[2]
  np.testing.assert_allclose(float(loss_c), float(loss_p), atol=2 * loss_atol, rtol=0)
  for g, g_p in zip(grads_c, grads_p):
    assert kp.rel_err(g, g_p) < 2 * grad_rtol
  # Tokens outside the loss (c = 0) and the all-zero weight row (token 1) get
  # exactly zero gradient and aux values.
  (_, aux_c), (dh_c, _) = outs[1]
  absent = (c == 0) | (np.asarray(p.weights).sum(1) == 0)
  assert np.all(kp.f64(dh_c)[absent] == 0)
  assert np.all(kp.f64(aux_c["kl"])[c == 0] == 0) and np.all(kp.f64(aux_c["entropy"])[c == 0] == 0)


def _shared_problem(t=20, v=700, k=3, seed=5):
  """K teachers of one width whose heads are K references to one array."""
  rng = np.random.default_rng(seed)
  dt = 24
  p = kp.make_problem(t, v, k, seed=seed)
  head = jnp.asarray(rng.normal(size=(dt, v)) * 2 / np.sqrt(dt), jnp.float32)
  h_k = [jnp.asarray(rng.normal(size=(t, dt)), jnp.float32) for _ in range(k)]
  return dataclasses.replace(p, h_k=h_k, w_k=[head] * k)


def test_shared_head_equals_separate_heads():
  """The shared-head product ([K·C, Dt] × [Dt, tile]) gives each teacher its
  own logits: equal to K separate copies of the head, and to the oracle."""
  p = _shared_problem()
  assert train_loss._shared(p.w_k, None)                       # detected by identity
  assert not train_loss._shared([p.w_k[0], p.w_k[0] + 0], None)
  c = _coef(p, seed=2)
  sizes = TrainChunkSizes(block_t=8, block_v=256)  # 20 = 2·8 + 4, 700 = 2·256 + 188
  outs = _value_and_grads((_train("chunked", 1.0, sizes, shared_head=True),
                           _train("chunked", 1.0, sizes, shared_head=False)), p, c)
  loss_o, kl_o, _, dh_o, dw_o = _oracle(p, c, 1.0)
  atol, grad_rtol = kp.tolerances(p, 1.0, jnp.float32)
  for (loss, aux), grads in outs:
    np.testing.assert_allclose(float(loss), loss_o, atol=atol * np.abs(c).sum(), rtol=0)
    np.testing.assert_allclose(kp.f64(aux["kl"]), kl_o, atol=atol, rtol=0)
    for g, g_o in zip(grads, (dh_o, dw_o)):
      assert kp.rel_err(g, g_o) < grad_rtol
  (_, aux_s), grads_s = outs[0]
  (_, aux_n), grads_n = outs[1]
  np.testing.assert_allclose(kp.f64(aux_s["kl"]), kp.f64(aux_n["kl"]), atol=2 * atol, rtol=0)
  for a, b in zip(grads_s, grads_n):
    assert kp.rel_err(a, b) < 2 * grad_rtol
  # Outside jit the identity is visible: the default (None) takes the fast
  # path and agrees with the flag.
  eager = fused_reverse_kl_train(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, c, impl="chunked",
                                 block_sizes=sizes)
  np.testing.assert_allclose(float(eager), loss_o, atol=atol * np.abs(c).sum(), rtol=0)


def test_cotangent_scales_saved_gradients_and_aux_is_stop_gradient():
  p = kp.make_problem(9, 300, 3, seed=7)
  c = jnp.asarray(_coef(p, seed=1), jnp.float32)
  sizes = TrainChunkSizes(block_t=4, block_v=128)
  f = lambda h, w: fused_reverse_kl_train(h, w, p.h_k, p.w_k, p.weights, c, 0.7, impl="chunked",
                                          block_sizes=sizes)
  g1 = jax.jit(jax.grad(f, argnums=(0, 1)))(p.h_s, p.w_s)
  g3 = jax.jit(jax.grad(lambda h, w: 3.0 * f(h, w), argnums=(0, 1)))(p.h_s, p.w_s)
  for a, b in zip(g1, g3):
    # The backward is one float32 multiply by 3 of the same saved gradient.
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a * 3.0))
    assert np.abs(np.asarray(a)).max() > 0

  def aux_only(h, w):
    _, aux = fused_reverse_kl_train(h, w, p.h_k, p.w_k, p.weights, c, 0.7, impl="chunked",
                                    block_sizes=sizes, return_aux=True)
    return jnp.sum(aux["kl"]) + jnp.sum(aux["entropy"])
  for g in jax.grad(aux_only, argnums=(0, 1))(p.h_s, p.w_s):
    assert not np.any(np.asarray(g))


def test_bad_weights_under_jit_give_nan_loss():
  p = kp.make_problem(6, 128, 2, seed=3)
  c = jnp.full((6,), 1 / 6)
  bad = p.weights.at[0, 1].set(-1.0)
  loss = jax.jit(lambda w: fused_reverse_kl_train(p.h_s, p.w_s, p.h_k, p.w_k, w, c,
                                                  impl="chunked"))(bad)
  assert np.isnan(float(loss))


def test_auto_is_chunked_on_cpu():
  assert train_loss.grads_function("auto") is train_loss.train_grads_chunked
  assert train_loss.grads_function("reference") is train_loss.train_grads_reference


@pytest.mark.parametrize("kwargs,match", [
    (dict(coef=np.ones(5)), r"coef.shape=\(5,\)"),
    (dict(coef=np.array([1.0, np.nan, 0, 0, 0, 0])), r"coef\[1\]=nan"),
    (dict(coef=np.array([1.0, 0, np.inf, 0, 0, 0])), r"coef\[2\]=inf"),
    (dict(impl="fast"), r"impl='fast'"),
    (dict(impl="chunked", block_sizes=ChunkSizes()), r"TrainChunkSizes"),
    (dict(impl="reference", block_sizes=TrainChunkSizes()), r"no block sizes"),
    (dict(shared_head=True), r"shared_head=True but teacher_heads have shapes"),
    (dict(shared_head="yes"), r"shared_head='yes'"),
    (dict(temperature=0.0), r"temperature=0.0"),
])
def test_bad_input_raises(kwargs, match):
  p = kp.make_problem(6, 128, 2, seed=3)  # teacher widths 40 and 16 differ
  args = dict(coef=np.full(6, 1 / 6))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    fused_reverse_kl_train(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, **args)


@pytest.mark.parametrize("field", ["block_t", "block_v"])
def test_train_chunk_sizes_validate(field):
  with pytest.raises(ValueError, match=f"TrainChunkSizes.{field}=0"):
    TrainChunkSizes(**{field: 0})


@pytest.mark.parametrize("k", [1, 3])
def test_default_chunk_buffers_fit_the_per_token_paths_tiles(k):
  """At the benchmark sizes (T = 2048, V = 131072, block_v = 2048) the default
  chunk's two [C, V] float32 buffers are no larger than the per-token chunked
  path's (4 + 2K)·T·block_v·4 bytes of tiles (docs/DESIGN.md §4), and C is as
  large as that allows (a multiple of 8): fewer read-modify-writes of dW_s."""
  t, v, block_v = 2048, 131072, 2048
  c = train_loss.default_block_t(k, v)
  budget = (4 + 2 * k) * t * block_v * 4
  assert c % 8 == 0 and 2 * c * v * 4 <= budget < 2 * (c + 8) * v * 4
  assert TrainChunkSizes().block_t is None  # the default resolves per K and V


@pytest.mark.parametrize("t,block_t,expected", [
    (2048, 96, 96),  # 22 chunks: ceil(2048 / 22) = 94 -> 96 (multiple of 8), 64 zero rows
    (2048, 160, 160),  # 13 chunks: ceil(2048 / 13) = 158 -> 160
    (300, 64, 64),  # 5 chunks: ceil(300 / 5) = 60 -> 64
    (20, 8, 8),  # 3 chunks: ceil(20 / 3) = 7 -> 8
    (7, 4, 4),  # block_t not a multiple of 8: 2 chunks of ceil(7 / 2) = 4
    (7, 3, 3),  # 3 chunks of ceil(7 / 3) = 3
    (100, 48, 40),  # 3 chunks: ceil(100 / 3) = 34 -> 40, not 48 (20 zero rows, not 44)
    (5, 8, 5),  # one chunk holds T
])
def test_balanced_block_t(t, block_t, expected):
  """Equal chunks in as few as block_t allows, never larger than block_t."""
  c = train_loss.balanced_block_t(t, block_t)
  assert c == expected
  assert c <= block_t and -(-t // c) == -(-t // block_t)  # same chunk count, none larger
