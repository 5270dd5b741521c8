"""Vocabulary-sharded gradient-in-forward reverse KL (docs/DESIGN.md §4).

The training loss of :func:`pallas_kernels.fused_reverse_kl_train` with the
student and teacher heads sharded over the vocabulary on one mesh axis
(``tensor`` by default), hidden states replicated over it. Per token chunk,
each shard runs phase 1 of :mod:`pallas_kernels.pallas_train` on its columns;
the per-token statistics ``(lse, ent, E_p[z − x_k], lse_k)`` are merged
across the axis by all-reduces of a max and sums
(:func:`tile_math.merge_stats_collective`), so every shard knows the full
normaliser before its phase 2 turns its buffered tiles into its own columns
of ``dW_s`` and a partial ``dh_s``, summed over the axis (``psum``). Tokens
may also be sharded (``token_axes``): the loss and ``dW_s`` are then summed
over those axes too.

The collectives carry ``O(T·K)`` floats per chunk; the ``[C, V/n]`` buffers
and every head matmul stay local.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels import inputs as inputs_lib, pallas_train, tile_math
from pallas_kernels.train_grads import weighted_loss
from pallas_kernels.train_loss import check_coef, saved_gradient_vjp


def _axes(token_axes) -> tuple:
  if token_axes is None:
    return ()
  return (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)


@functools.lru_cache(maxsize=None)
def _sharded_fn(mesh: Mesh, axis: str, token_axes: tuple, k: int, inv_tau: float,
                bs: pallas_train.TrainBlockSizes, interpret: bool, shared_head: bool):
  """Jitted ``f(h_s, w_s, (h_k, w_k, w_hat, coef)) -> (loss, kl, ent)`` whose
  VJP w.r.t. ``(h_s, w_s)`` is the saved gradient times the loss cotangent."""
  tok = token_axes or None
  h_spec, w_spec = P(tok, None), P(None, axis)

  def local(h_s, w_s, h_k, w_k, w_hat, coef):
    st, dh, dw = pallas_train.train_grads_core(
        h_s, w_s, h_k, w_k, w_hat, coef, inv_tau=inv_tau, bs=bs, interpret=interpret, axis=axis)
    kl = tile_math.kl_from_stats(st)  # merged over `axis`: the same on every shard
    loss, dh = weighted_loss(coef, w_hat, kl), jax.lax.psum(dh, axis)
    if token_axes:
      loss, dw = jax.lax.psum(loss, token_axes), jax.lax.psum(dw, token_axes)
    return loss, kl, st.ent, dh, dw

  n_heads = 1 if shared_head else k
  # needed as of jax 0.10.2: Pallas interpret mode (CPU) is not typed for
  # varying manual axes, so shard_map's vma check must be off there.
  run = jax.shard_map(local, mesh=mesh,
                      in_specs=(h_spec, w_spec, (h_spec,) * k, (w_spec,) * n_heads,
                                h_spec, P(tok)),
                      out_specs=(P(), P(tok, None), P(tok), h_spec, w_spec),
                      check_vma=not interpret)

  def with_grads(h_s, w_s, rest):
    loss, kl, ent, dh, dw = run(h_s, w_s, *rest)
    return (loss, kl, ent), (dh.astype(h_s.dtype), dw.astype(w_s.dtype))

  return jax.jit(saved_gradient_vjp(with_grads))


def fused_reverse_kl_train_sharded(student_hidden, student_head, teacher_hidden, teacher_heads,
                                   teacher_weights, coef, temperature=1.0, *, mesh: Mesh,
                                   axis: str = "tensor", token_axes=None, block_sizes=None,
                                   shared_head: bool = False, return_aux: bool = False,
                                   interpret: bool | None = None):
  """:func:`pallas_kernels.fused_reverse_kl_train` with vocabulary-sharded heads.

  Same arguments and results as the unsharded entry (its Pallas
  implementation runs on every shard), plus:

  Args:
    mesh: a mesh with an axis named ``axis``.
    axis: mesh axis sharding V; V must be divisible by its size.
    token_axes: mesh axis name(s) sharding T (optional); T must be divisible
      by their total size.
    block_sizes: :class:`pallas_train.TrainBlockSizes` of each shard's kernels.
    shared_head: True if all K teachers use one head (``teacher_heads[0]``
      is then the only head read); no detection here, pass the flag.
    interpret: Pallas interpret mode (default: on CPU).

  Returns:
    ``loss`` [] f32, or ``(loss, {"kl": [T, K], "entropy": [T]})`` (0 where
    ``coef`` is 0). ``dW_s`` comes back sharded like ``W_s``.

  Raises:
    ValueError: as the unsharded entry, plus an unknown ``axis`` or a V / T
      not divisible by the shards.
  """
  inp = inputs_lib.check_inputs(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, None, temperature)
  if axis not in mesh.axis_names:
    raise ValueError(f"axis={axis!r} is not a mesh axis; {mesh.axis_names=}")
  t_axes = _axes(token_axes)
  n, n_tok = mesh.shape[axis], math.prod(mesh.shape[a] for a in t_axes)
  t, v, k = inp.h_s.shape[0], inp.w_s.shape[1], len(inp.h_k)
  if v % n:
    raise ValueError(f"student_head.shape={inp.w_s.shape}: V={v} is not divisible by the {n} "
                     f"shards of mesh axis {axis!r}")
  if t % n_tok:
    raise ValueError(f"student_hidden.shape={inp.h_s.shape}: T={t} is not divisible by the "
                     f"{n_tok} shards of token_axes={token_axes!r}")
  if shared_head and any(w.shape != inp.w_k[0].shape for w in inp.w_k):
    raise ValueError(f"shared_head=True but teacher_heads have shapes "
                     f"{[tuple(w.shape) for w in inp.w_k]}")
  c = jax.lax.stop_gradient(check_coef(coef, t))
  keep = c != 0
  w_hat = inputs_lib.normalized_weights(jax.lax.stop_gradient(inp.weights), keep)
  c_eff = jnp.where(jnp.any(w_hat != 0, axis=1), c, 0.0)  # the grads-function contract
  bs = pallas_train.check_block_sizes(block_sizes, t // n_tok, v // n, inp.h_s.dtype)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  fn = _sharded_fn(mesh, axis, t_axes, k, 1.0 / inp.temperature, bs, bool(interpret),
                   bool(shared_head))
  stop = lambda xs: tuple(jax.lax.stop_gradient(x) for x in xs)
  loss, kl, ent = fn(inp.h_s, inp.w_s, (stop(inp.h_k), stop(inp.w_k[:1] if shared_head else inp.w_k),
                                         w_hat, c_eff))
  if not return_aux:
    return loss
  return loss, {"kl": jnp.where(keep[:, None], kl, 0.0), "entropy": jnp.where(keep, ent, 0.0)}
