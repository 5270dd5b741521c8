"""Pallas gradient-in-forward reverse KL (interpret mode), single-device and vocab-sharded.

``fused_reverse_kl_train(impl="pallas")`` returns ``Σ_t c_t Σ_k ŵ_tk KL_tk``
with gradients computed in the forward pass (pallas_kernels/pallas_train.py).
Values, per-token KL / entropy and ``jax.grad`` are compared with the float64
oracle of kl_problems.py: the objective with cotangents ``(c, 0, 0)`` is
exactly this loss, so ``np_objective_grads`` is its gradient.

The factor grid is test_kl_pallas.py's (T, V, K, τ, mask, dtype, layout),
covered by its pairwise ``DESIGN``. Blocks are small so that T=300 spans five
token chunks of 64 with a remainder (C does not divide T), V=1000 has a
remainder tile, and the looped layout pads the teacher widths (40, 24) to
``block_d=16`` and V to a multiple of 3·128 for its three ``dh`` splits.
Rows 1-3 of every problem have zero / one-hot / partial teacher weights
(kl_problems.make_problem).
"""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import kl_problems as kp
from pallas_kernels import fused_reverse_kl_train
from pallas_kernels.pallas_train import TrainBlockSizes, train_grads_pallas
from pallas_kernels.sharded_train import fused_reverse_kl_train_sharded
from test_kl_pallas import DESIGN, LEVELS

BLOCKS = {
    "tiled": TrainBlockSizes(block_c=64, block_t=32, block_v=256),
    "looped": TrainBlockSizes(block_c=64, block_t=32, block_v=128, layout="looped", block_d=16,
                              v_splits=3),
}


def _coef(p: kp.Problem, seed: int) -> np.ndarray:
  """Random c_t > 0 on the masked tokens, 0 elsewhere (A1's entry treats c = 0
  as outside the loss, as the oracle's mask does)."""
  c = np.random.default_rng(seed).uniform(0.5, 1.5, size=p.h_s.shape[0]) / p.h_s.shape[0]
  return c if p.mask is None else c * np.asarray(p.mask)


def _run(fn, p: kp.Problem, coef):
  """jit(value_and_grad) of ``fn(h_s, w_s, h_k, w_k, weights, coef) -> (loss, aux)``."""
  def obj(h_s, w_s, h_k, w_k, weights, coef):
    return fn(h_s, w_s, h_k, w_k, weights, coef)
  run = jax.jit(jax.value_and_grad(obj, argnums=(0, 1), has_aux=True),
                compiler_options=kp.FAST_COMPILE)
  return run(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, jnp.asarray(coef, jnp.float32))


def _check_oracle(p: kp.Problem, coef, out, tau, dtype):
  """Loss, aux and gradients against the float64 oracle, kl_problems tolerances."""
  (loss, aux), (dh, dw) = out
  oracle = kp.Problem(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, p.mask,
                      (coef, np.zeros(kp.f64(p.weights).shape), np.zeros(coef.shape)))
  loss_t, kl_o, ent_o = kp.np_reverse_kl(oracle, tau)
  atol, grad_rtol = kp.tolerances(p, tau, dtype)
  assert loss.shape == () and loss.dtype == jnp.float32
  # Σ_t c_t loss_t: each loss_t within atol, weighted by |c_t|.
  np.testing.assert_allclose(float(loss), float(coef @ loss_t), atol=atol * np.abs(coef).sum(),
                             rtol=0)
  np.testing.assert_allclose(kp.f64(aux["kl"]), kl_o, atol=atol, rtol=0)
  np.testing.assert_allclose(kp.f64(aux["entropy"]), ent_o, atol=atol, rtol=0)
  for g, g_o, x in zip((dh, dw), kp.np_objective_grads(oracle, tau), (p.h_s, p.w_s)):
    assert g.dtype == x.dtype and g.shape == x.shape
    assert kp.rel_err(g, g_o) < grad_rtol, (kp.rel_err(g, g_o), grad_rtol)


def _pallas_entry(tau, sizes, **kw):
  return lambda *args: fused_reverse_kl_train(*args, temperature=tau, impl="pallas",
                                              block_sizes=sizes, return_aux=True, **kw)


def _case(row):
  return tuple(levels[i] for levels, i in zip(LEVELS, row))


def _id(row):
  t, v, k, tau, mask, dtype, layout = _case(row)
  return f"{t=}_{v=}_{k=}_{tau=}_{mask=}_{jnp.dtype(dtype).name}_{layout}"


@pytest.mark.parametrize("row", DESIGN, ids=[_id(r) for r in DESIGN])
def test_train_pallas_matches_oracle(row):
  t, v, k, tau, with_mask, dtype, layout = _case(row)
  p = kp.make_problem(t, v, k, dtype=dtype, with_mask=with_mask, seed=sum(row))
  coef = _coef(p, sum(row))
  _check_oracle(p, coef, _run(_pallas_entry(tau, BLOCKS[layout]), p, coef), tau, dtype)


def test_train_pallas_matches_oracle_on_peaked_logits():
  """Logits spanning > 88 units (kl_problems.PEAK): the per-tile and merged
  statistics overflow unless every tile is shifted by its own max."""
  p = kp.make_problem(7, 1000, 3, seed=11, peak=kp.PEAK)
  coef = _coef(p, 11)
  _check_oracle(p, coef, _run(_pallas_entry(0.7, BLOCKS["tiled"]), p, coef), 0.7, jnp.float32)


@pytest.mark.parametrize("layout", ["tiled", "looped"])
def test_shared_head_matches_oracle(layout):
  """K=3 teachers with one head: the kernel reads it once (one operand) and
  pairs it with each teacher's own hidden states."""
  p = kp.make_problem(40, 300, 3, seed=5)
  rng = np.random.default_rng(5)
  p.h_k = [jnp.asarray(rng.normal(size=(40, kp.DT[0])), jnp.float32) for _ in range(3)]
  p.w_k = [p.w_k[0]] * 3
  coef = _coef(p, 5)
  out = _run(_pallas_entry(0.7, BLOCKS[layout], shared_head=True), p, coef)
  _check_oracle(p, coef, out, 0.7, jnp.float32)


def test_pallas_equals_reference_and_chunked():
  """The three grads functions agree (each is within the oracle tolerance)."""
  p = kp.make_problem(50, 1000, 3, seed=7)
  coef = _coef(p, 7)
  outs = [_run(_pallas_entry(0.7, BLOCKS["tiled"]), p, coef)] + [
      _run(lambda *a, impl=impl: fused_reverse_kl_train(*a, temperature=0.7, impl=impl,
                                                        return_aux=True), p, coef)
      for impl in ("reference", "chunked")]
  atol, grad_rtol = kp.tolerances(p, 0.7, jnp.float32)
  (loss, aux), (dh, dw) = outs[0]
  for (loss_o, aux_o), (dh_o, dw_o) in outs[1:]:
    np.testing.assert_allclose(loss, loss_o, atol=2 * atol * coef.sum(), rtol=0)
    np.testing.assert_allclose(aux["kl"], aux_o["kl"], atol=2 * atol, rtol=0)
    assert kp.rel_err(dh, dh_o) < 2 * grad_rtol and kp.rel_err(dw, dw_o) < 2 * grad_rtol


def _dots(jaxpr) -> tuple[int, int]:
  """(dot_generals inside pallas_call kernels, dot_generals elsewhere)."""
  inside = outside = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      inside += sum(_dots(eqn.params["jaxpr"]))
      continue
    outside += eqn.primitive.name == "dot_general"
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      i, o = _dots(sub)
      inside, outside = inside + i, outside + o
  return inside, outside


@pytest.mark.parametrize("k,want", [(1, 4), (3, 6)])
def test_head_matmul_count(k, want):
  """3 + K head matmuls per step (1 + K logits, dh, dW), all inside kernels;
  the custom_vjp path needs 2(1 + K) + 2."""
  p = kp.make_problem(20, 300, k, with_mask=False)
  w_hat, coef = jnp.full((20, k), 1.0 / k), jnp.ones(20)
  jaxpr = jax.make_jaxpr(lambda *a: train_grads_pallas(
      *a, temperature=1.0, sizes=BLOCKS["tiled"]))(p.h_s, p.w_s, p.h_k, p.w_k, w_hat, coef)
  assert _dots(jaxpr.jaxpr) == (want, 0)


# --- Lowering for TPU (Mosaic) and GPU (Triton), checked on this CPU machine ---

@pytest.mark.parametrize("platform,layout,count", [
    ("tpu", "tiled", ("tpu_custom_call", 2)), ("cuda", "looped", ("xla.gpu.triton", 3))])
def test_train_kernels_lower(platform, layout, count):
  sizes = {"tiled": TrainBlockSizes(block_c=256, block_t=128, block_v=512),
           "looped": TrainBlockSizes(block_c=128, block_t=64, block_v=128, layout="looped",
                                     block_d=16, v_splits=4)}[layout]
  # V = 1100: a padded vocabulary that is not a power of two, T = 300: C ∤ T.
  p = kp.make_problem(300, 1100, 2, dtype=jnp.bfloat16, with_mask=False)
  fn = lambda *a: train_grads_pallas(*a, temperature=0.7, sizes=sizes, interpret=False)
  disabled = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(
      p.h_s, p.w_s, tuple(p.h_k), tuple(p.w_k), jnp.full((300, 2), 0.5), jnp.ones(300))
  assert exported.mlir_module().count(count[0]) == count[1]


# --- Vocabulary-sharded on 8 fake CPU devices ---------------------------------

T, V, K, TAU = 16, 1024, 2, 0.7
SHARD_BLOCKS = TrainBlockSizes(block_c=8, block_t=8, block_v=128)


def _mesh(shape, names):
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


@pytest.fixture(scope="module")
def single_device():
  p = kp.make_problem(T, V, K, seed=11)
  coef = _coef(p, 11)
  return p, coef, _run(_pallas_entry(TAU, SHARD_BLOCKS), p, coef)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (8,), (2, 4)],
                         ids=["tensor2", "tensor4", "tensor8", "data2_tensor4"])
def test_sharded_equals_single_device(single_device, mesh_shape):
  p, coef, ((loss_u, aux_u), (dh_u, dw_u)) = single_device
  names = ("tensor",) if len(mesh_shape) == 1 else ("data", "tensor")
  mesh = _mesh(mesh_shape, names)
  out = _run(lambda *a: fused_reverse_kl_train_sharded(
      *a, temperature=TAU, mesh=mesh, token_axes="data" if "data" in names else None,
      block_sizes=SHARD_BLOCKS, return_aux=True), p, coef)
  (loss, aux), (dh, dw) = out
  # Both sides float32, each within kl_problems.tolerances of the truth.
  atol, grad_rtol = kp.tolerances(p, TAU, jnp.float32)
  np.testing.assert_allclose(loss, loss_u, atol=2 * atol * coef.sum(), rtol=0)
  for key in ("kl", "entropy"):
    np.testing.assert_allclose(aux[key], aux_u[key], atol=2 * atol, rtol=0)
  assert kp.rel_err(dh, dh_u) < 2 * grad_rtol and kp.rel_err(dw, dw_u) < 2 * grad_rtol
  assert dw.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tensor")), 2)
  _check_oracle(p, coef, out, TAU, jnp.float32)


@pytest.mark.parametrize("platform,layout,count", [
    ("tpu", "tiled", ("tpu_custom_call", 2)), ("cuda", "looped", ("xla.gpu.triton", 3))])
def test_sharded_train_lowers(platform, layout, count):
  """Off CPU the sharded path runs shard_map with its vma check on (every
  pallas_call output typed as varying over the mesh axes): lowering checks it."""
  sizes = {"tiled": TrainBlockSizes(block_c=128, block_t=64, block_v=128),
           "looped": TrainBlockSizes(block_c=64, block_t=32, block_v=64, layout="looped",
                                     block_d=16, v_splits=2)}[layout]
  mesh = _mesh((2, 4), ("data", "tensor"))
  p = kp.make_problem(256, 2048, 2, dtype=jnp.bfloat16, with_mask=False)

  def value_and_grads(h_s, w_s, h_k, w_k, weights, coef):
    return jax.value_and_grad(lambda h, w: fused_reverse_kl_train_sharded(
        h, w, h_k, w_k, weights, coef, 0.7, mesh=mesh, token_axes="data", block_sizes=sizes,
        interpret=False), argnums=(0, 1))(h_s, w_s)

  disabled = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  exported = export.export(jax.jit(value_and_grads), platforms=[platform],
                           disabled_checks=disabled)(
      p.h_s, p.w_s, tuple(p.h_k), tuple(p.w_k), p.weights, jnp.ones(256))
  assert exported.mlir_module().count(count[0]) == count[1]


# --- Validation -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(block_c=48, block_t=32, block_v=128), "block_c=48"),
    (dict(block_c=None, block_t=32, block_v=128), "block_c=None"),
    (dict(block_c=64, block_t=12, block_v=128), "block_t"),
    (dict(block_c=64, block_t=32, block_v=100), "block_v"),
    (dict(block_c=64, block_t=32, block_v=128, layout="mosaic"), "layout"),
    (dict(block_c=64, block_t=48, block_v=128, layout="looped"), "block_t=48"),
    (dict(block_c=0, block_t=32, block_v=128), "block_c=0"),
    (dict(block_c=64, block_t=32, block_v=128, layout="looped", v_splits=0), "v_splits=0"),
])
def test_block_sizes_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    TrainBlockSizes(**kwargs)


def test_bad_inputs_raise():
  p = kp.make_problem(T, V, 1, with_mask=False)
  w_hat, coef = jnp.ones((T, 1)), jnp.ones(T)
  with pytest.raises(ValueError, match="need K >= 1"):
    train_grads_pallas(p.h_s, p.w_s, [], [], w_hat[:, :0], coef, temperature=1.0)
  with pytest.raises(ValueError, match="coef.shape"):
    train_grads_pallas(p.h_s, p.w_s, p.h_k, p.w_k, w_hat, coef[:3], temperature=1.0)
  with pytest.raises(ValueError, match="TrainBlockSizes"):
    fused_reverse_kl_train(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, coef, impl="pallas",
                           block_sizes=kp.__name__)
  mesh = _mesh((8,), ("tensor",))
  with pytest.raises(ValueError, match="not divisible"):
    fused_reverse_kl_train_sharded(p.h_s, p.w_s[:, :1004], p.h_k, [w[:, :1004] for w in p.w_k],
                                   p.weights, coef, mesh=mesh)
  with pytest.raises(ValueError, match="not a mesh axis"):
    fused_reverse_kl_train_sharded(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, coef, mesh=mesh,
                                   axis="model")
