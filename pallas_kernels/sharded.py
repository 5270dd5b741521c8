"""Vocabulary-sharded (tensor-parallel) statistics and reverse KL.

The student and teacher heads are sharded over the vocabulary on one mesh
axis (``tensor`` by default); hidden states are replicated over it. Each
shard runs the fused statistics (chunked or Pallas) on its own columns and
the partials ``(lse, ent, E_p[z − x_k], lse_k)`` are merged with all-reduces
of a max and sums (docs/DESIGN.md §4, :func:`tile_math.merge_stats_collective`). The
result equals the unsharded statistics exactly up to float rounding.

Gradients: each shard's backward produces its slice of ``dW_s`` (so
``dW_s`` comes back sharded like ``W_s``) and a partial ``dh_s``, which the
transpose of the replication sums over the axis.
"""
from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels import api, inputs as inputs_lib
from pallas_kernels import tile_math
from pallas_kernels.tile_math import Stats


def vocab_stats_sharded(h_s, w_s, h_k: Sequence, w_k: Sequence, temperature: float, *,
                        mesh: Mesh, stats_fn, axis: str = "tensor",
                        token_axes: str | tuple[str, ...] | None = None,
                        check_vma: bool = True) -> Stats:
  """Statistics with heads sharded over ``axis`` (vocabulary dimension).

  Args:
    h_s: [T, Ds]; w_s: [Ds, V]; h_k / w_k: K arrays [T, Dt_k] / [Dt_k, V].
    temperature: τ > 0.
    mesh: a mesh with an axis named ``axis``.
    stats_fn: ``stats_fn(h_s, w_s, h_k, w_k, temperature) -> Stats`` run per
      shard (e.g. :func:`pallas_kernels.chunked.vocab_stats_chunked`).
    axis: mesh axis sharding the vocabulary; V must be divisible by its size.
    token_axes: mesh axes sharding T (optional).
    check_vma: passed to ``jax.shard_map``; the replicated hidden states'
      cotangent is summed over ``axis`` either way.

  Returns:
    Stats over the full vocabulary, sharded over ``token_axes`` along T.
  """
  if axis not in mesh.axis_names:
    raise ValueError(f"axis={axis!r} is not a mesh axis; {mesh.axis_names=}")
  n = mesh.shape[axis]
  if w_s.shape[1] % n:
    raise ValueError(f"{w_s.shape=}: V={w_s.shape[1]} is not divisible by the {n} shards "
                     f"of mesh axis {axis!r}")
  k = len(h_k)
  h_spec, w_spec, t_spec = P(token_axes, None), P(None, axis), P(token_axes)

  t_axes = () if token_axes is None else (
      (token_axes,) if isinstance(token_axes, str) else tuple(token_axes))

  def local(h_s, w_s, h_k, w_k):
    # h_s is replicated over `axis` and W_s over the token axes, but each
    # shard's gradient w.r.t. them is a partial sum; marking them varying
    # makes the transpose psum those partials.
    h_s = jax.lax.pcast(h_s, axis, to="varying")
    if t_axes:
      w_s = jax.lax.pcast(w_s, t_axes, to="varying")
    part = stats_fn(h_s, w_s, h_k, w_k, temperature)
    return tile_math.merge_stats_collective(part, axis)

  out_specs = Stats(t_spec, t_spec, P(token_axes, None), P(token_axes, None))
  fn = jax.shard_map(local, mesh=mesh,
                     in_specs=(h_spec, w_spec, (h_spec,) * k, (w_spec,) * k),
                     out_specs=out_specs, check_vma=check_vma)
  return fn(h_s, w_s, tuple(h_k), tuple(w_k))


def fused_reverse_kl_sharded(student_hidden, student_head, teacher_hidden, teacher_heads,
                             teacher_weights, mask=None, temperature=1.0, *, mesh: Mesh,
                             impl: str = "chunked", axis: str = "tensor",
                             token_axes=None, block_sizes=None, return_aux: bool = False):
  """:func:`pallas_kernels.fused_reverse_kl` with vocabulary-sharded heads.

  Same arguments and results as the unsharded call, plus ``mesh``, ``axis``
  and ``token_axes`` (see :func:`vocab_stats_sharded`); ``impl`` is
  ``"chunked"`` or ``"pallas"`` (``"auto"`` picks by backend).
  """
  inp = inputs_lib.check_inputs(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, mask, temperature)
  impl = api.resolve_impl(impl)
  if impl == "reference":
    raise ValueError("impl='reference' has no sharded variant; use 'chunked' or 'pallas'")
  # needed as of jax 0.10.2: Pallas interpret mode (CPU) is not typed for
  # varying manual axes, so shard_map's vma check must be off there.
  interpreted = impl == "pallas" and jax.default_backend() == "cpu"
  stats = vocab_stats_sharded(inp.h_s, inp.w_s, [jax.lax.stop_gradient(h) for h in inp.h_k],
                              [jax.lax.stop_gradient(w) for w in inp.w_k], inp.temperature,
                              mesh=mesh, stats_fn=api.stats_function(impl, block_sizes),
                              axis=axis, token_axes=token_axes, check_vma=not interpreted)
  w_hat = inputs_lib.normalized_weights(jax.lax.stop_gradient(inp.weights), inp.mask)
  return api.loss_from_stats(stats, w_hat, inp.mask, return_aux)
