"""Vocabulary-sharded reverse KL equals the unsharded one on 8 fake CPU devices.

The heads are sharded over the ``tensor`` axis (V / 8 columns per shard),
each shard runs the chunked or Pallas (interpret) statistics on its columns,
and the partials are merged by all-reduces. Forward values and gradients
(``dh_s`` summed over shards, ``dW_s`` sharded like ``W_s``) are compared
with the unsharded chunked path.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import kl_problems as kp
from pallas_kernels import BlockSizes, ChunkSizes, fused_reverse_kl, fused_reverse_kl_sharded

T, V, K, TAU = 16, 1024, 2, 0.7


def _mesh(shape, names):
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def _run(fn, p):
  return kp.objective_and_grads(fn, p)


@pytest.mark.parametrize("impl,mesh_shape", [
    ("chunked", (8,)), ("pallas", (8,)), ("chunked", (2, 4))],
    ids=["chunked_tensor8", "pallas_tensor8", "chunked_data2_tensor4"])
def test_sharded_equals_unsharded(impl, mesh_shape):
  names = ("tensor",) if len(mesh_shape) == 1 else ("data", "tensor")
  mesh = _mesh(mesh_shape, names)
  token_axes = "data" if "data" in names else None
  p = kp.make_problem(T, V, K, with_mask=True, seed=11)
  block_sizes = (BlockSizes(block_t=8, block_v=128, layout="tiled") if impl == "pallas"
                 else ChunkSizes(block_v=64))

  def sharded(*args):
    return fused_reverse_kl_sharded(*args, temperature=TAU, mesh=mesh, impl=impl,
                                    token_axes=token_axes, block_sizes=block_sizes,
                                    return_aux=True)

  def unsharded(*args):
    return fused_reverse_kl(*args, temperature=TAU, impl="chunked", return_aux=True)

  (_, outs), (dh, dw) = _run(sharded, p)
  (_, outs_u), (dh_u, dw_u) = _run(unsharded, p)
  # Both sides float32, each within kl_problems.tolerances of the truth.
  atol, grad_rtol = kp.tolerances(p, TAU, jnp.float32)
  for got, want in zip(outs, outs_u):
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * atol)
  assert kp.rel_err(dh, dh_u) < 2 * grad_rtol and kp.rel_err(dw, dw_u) < 2 * grad_rtol
  assert dw.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tensor")), 2)


def test_sharded_rejects_indivisible_vocab():
  p = kp.make_problem(T, 1004, 1, with_mask=False)
  with pytest.raises(ValueError, match="not divisible"):
    fused_reverse_kl_sharded(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, mesh=_mesh((8,), ("tensor",)))
