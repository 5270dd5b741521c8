"""Per-tile math of the online reverse-KL pass (docs/DESIGN.md §4), shared by every path.

The fused kernels never hold a full ``[T, V]`` row. They walk the vocabulary
in tiles and keep, per token, the running accumulators of docs/DESIGN.md §4:

* ``m``   running max of the student logits ``z = h_s W_s / τ``,
* ``l``   ``Σ e^{z−m}``,
* ``s``   ``Σ e^{z−m}(z−m)`` (gives the student entropy without cancellation),
* ``a_k`` ``Σ e^{z−m}(z−x_k)`` per teacher, ``x_k = h_k W_k / τ``; the design's
  ``A = Σ e^{z−m}(z−y)`` with ``y = Σ_k ŵ_k x_k`` is ``Σ_k ŵ_k a_k`` because
  the renormalised weights ``ŵ`` sum to 1,
* ``m_k``, ``l_k`` the online max / sum of each teacher, giving ``lse_k``.

At the end of the pass the per-token statistics are

* ``lse``  ``lse(z)``,
* ``ent``  student entropy ``H(p) = lse(z) − E_p[z]``,
* ``e_k``  ``E_p[z − x_k] = a_k / l``,
* ``lse_k`` ``lse(x_k)``,

and ``KL(p‖q_k) = e_k − lse + lse_k`` (:func:`kl_from_stats`). These
statistics are also what vocabulary partitions (kernel splits, tensor shards)
exchange: :func:`merge_stats` combines them exactly.

The backward pass recomputes the logits tile by tile; given cotangents of the
statistics it needs, per token, only the coefficients of :func:`dz_tile`.

All functions work on values (not refs), so the same code runs inside Pallas
kernel bodies (TPU and GPU), the chunked XLA scan and the sharded merge.
Shapes: per-token columns are ``[t, 1]`` (or ``[t]`` where noted), tiles are
``[t, v]``; K (teachers) is a small static Python count.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity": padded columns and empty partitions use it so that
# no −inf − (−inf) = NaN can arise (same choice as jax's flash attention).
NEG = -0.7 * float(np.finfo(np.float32).max)


def round_up(x: int, m: int) -> int:
  """The smallest multiple of ``m`` that is >= ``x`` (block padding)."""
  return -(-x // m) * m


def _sel(valid, a, b):
  """``where(valid, a, b)``; ``valid=None`` means every column is valid."""
  return a if valid is None else jnp.where(valid, a, b)


class Stats(NamedTuple):
  """Per-token statistics of one vocabulary pass (all float32).

  Attributes:
    lse: [T] log-sum-exp of the student logits ``z``.
    ent: [T] student entropy ``H(p) = −Σ p log p`` at temperature τ.
    e_k: [T, K] ``E_p[z − x_k]`` per teacher.
    lse_k: [T, K] log-sum-exp of each teacher's logits ``x_k``.
  """
  lse: jax.Array
  ent: jax.Array
  e_k: jax.Array
  lse_k: jax.Array


class Acc(NamedTuple):
  """Running accumulators of the online pass; every entry is ``[t, 1]`` f32."""
  m: jax.Array
  l: jax.Array
  s: jax.Array
  a_k: tuple
  m_k: tuple
  l_k: tuple


def acc_init(rows: int, num_teachers: int) -> Acc:
  neg = jnp.full((rows, 1), NEG, jnp.float32)
  zero = jnp.zeros((rows, 1), jnp.float32)
  k = num_teachers
  return Acc(neg, zero, zero, (zero,) * k, (neg,) * k, (zero,) * k)


def _varying_axes(x) -> frozenset:
  # needed as of jax 0.10.2: the varying manual axes live on ``manual_axis_type``.
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def match_vma(tree, *refs):
  """Marks freshly created arrays (scan carries) as varying over the same mesh
  axes as ``refs``, so a scan inside ``shard_map`` types its carry like its body
  output. A no-op outside ``shard_map``."""
  vma = frozenset().union(*(_varying_axes(r) for r in refs))
  if not vma:
    return tree
  return jax.tree.map(lambda a: jax.lax.pcast(a, tuple(sorted(vma)), to="varying"), tree)


def out_struct(shape, dtype, *refs) -> jax.ShapeDtypeStruct:
  """A ``pallas_call`` output type varying over the same mesh axes as ``refs``
  (``shard_map`` with ``check_vma`` requires it to be stated)."""
  mat = getattr(jax.typeof(refs[0]), "manual_axis_type", None)
  if mat is not None:
    mat = mat.update(varying=frozenset().union(*(_varying_axes(r) for r in refs)))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def acc_update(acc: Acc, z: jax.Array, xs: Sequence[jax.Array], valid) -> Acc:
  """Folds one vocabulary tile into the accumulators.

  Args:
    acc: accumulators, each ``[t, 1]``.
    z: [t, v] student logits of the tile (f32, already divided by τ).
    xs: K arrays [t, v], teacher logits of the tile.
    valid: boolean broadcastable to [t, v], or None when every column is
      valid: False on padded / out-of-range vocabulary columns. Those columns
      may hold garbage (even NaN); ``where`` removes them before any
      arithmetic touches them.

  Returns:
    The updated accumulators.
  """
  z = _sel(valid, z, 0.0)
  m_new = jnp.maximum(acc.m, jnp.max(_sel(valid, z, NEG), axis=1, keepdims=True))
  alpha = jnp.exp(acc.m - m_new)  # rescales the old sums to the new max
  e = _sel(valid, jnp.exp(z - m_new), 0.0)
  l = alpha * acc.l + jnp.sum(e, axis=1, keepdims=True)
  # s is relative to m: shifting m by δ turns Σ e(z−m) into α(s − δ·l).
  s = alpha * (acc.s - (m_new - acc.m) * acc.l) + jnp.sum(e * (z - m_new), axis=1, keepdims=True)
  a_k, m_k, l_k = [], [], []
  for k, x in enumerate(xs):
    x = _sel(valid, x, 0.0)
    a_k.append(alpha * acc.a_k[k] + jnp.sum(e * (z - x), axis=1, keepdims=True))
    mk_new = jnp.maximum(acc.m_k[k], jnp.max(_sel(valid, x, NEG), axis=1, keepdims=True))
    ek = _sel(valid, jnp.exp(x - mk_new), 0.0)
    l_k.append(jnp.exp(acc.m_k[k] - mk_new) * acc.l_k[k] + jnp.sum(ek, axis=1, keepdims=True))
    m_k.append(mk_new)
  return Acc(m_new, l, s, tuple(a_k), tuple(m_k), tuple(l_k))


def acc_finalize(acc: Acc):
  """Turns accumulators into ``(lse, ent, e_k list, lse_k list)``, each [t, 1].

  A partition that saw no valid column (l = 0) gives ``lse = NEG`` and zeros,
  so that :func:`merge_stats` weights it by exactly 0 instead of 0/0.
  """
  seen = acc.l > 0
  l = jnp.where(seen, acc.l, 1.0)
  lse = jnp.where(seen, acc.m + jnp.log(l), NEG)
  ent = jnp.where(seen, jnp.log(l) - acc.s / l, 0.0)
  e_k = [jnp.where(seen, a / l, 0.0) for a in acc.a_k]
  lse_k = []
  for mk, lk in zip(acc.m_k, acc.l_k):
    lk_seen = lk > 0
    lse_k.append(jnp.where(lk_seen, mk + jnp.log(jnp.where(lk_seen, lk, 1.0)), NEG))
  return lse, ent, e_k, lse_k


def stats_from_columns(lse, ent, e_k, lse_k, num_teachers: int) -> Stats:
  """Packs ``[T, 1]`` columns (lists for e_k / lse_k) into a :class:`Stats`."""
  def stack(cols):
    if num_teachers == 0:
      return jnp.zeros((lse.shape[0], 0), jnp.float32)
    return jnp.concatenate(list(cols), axis=1)
  return Stats(lse[:, 0], ent[:, 0], stack(e_k), stack(lse_k))


def merge_stats(parts: Stats, axis: int = 0) -> Stats:
  """Exact merge of statistics computed on disjoint vocabulary partitions.

  Args:
    parts: Stats whose fields carry a leading partition axis ``P`` at
      ``axis`` (lse/ent ``[P, T]``, e_k/lse_k ``[P, T, K]``).
    axis: the partition axis.

  Returns:
    Stats over the union of the partitions. With ``w_p = e^{lse_p − lse}``:
    ``e_k = Σ_p w_p e_k,p`` and ``ent = Σ_p w_p (ent_p + lse − lse_p)``.
  """
  lse = jax.nn.logsumexp(parts.lse, axis=axis)
  w = jnp.exp(parts.lse - jnp.expand_dims(lse, axis))  # [P, T]
  ent = jnp.sum(w * (parts.ent + jnp.expand_dims(lse, axis) - parts.lse), axis=axis)
  e_k = jnp.sum(w[..., None] * parts.e_k, axis=axis)
  lse_k = jax.nn.logsumexp(parts.lse_k, axis=axis)
  return Stats(lse, ent, e_k, lse_k)


def merge_stats_collective(local: Stats, axis_name: str) -> Stats:
  """:func:`merge_stats` across a mesh axis (inside ``shard_map``).

  All-reduces a max and sums, as docs/DESIGN.md §4 prescribes for the tensor-parallel
  variant. Differentiable (the collectives have transposes).
  """
  def lse_all(x):
    mx = jax.lax.pmax(jax.lax.stop_gradient(x), axis_name)  # pmax has no JVP; the shift is free
    return mx + jnp.log(jax.lax.psum(jnp.exp(x - mx), axis_name))
  lse = lse_all(local.lse)
  w = jnp.exp(local.lse - lse)
  ent = jax.lax.psum(w * (local.ent + lse - local.lse), axis_name)
  e_k = jax.lax.psum(w[:, None] * local.e_k, axis_name)
  lse_k = lse_all(local.lse_k)
  return Stats(lse, ent, e_k, lse_k)


class Coef(NamedTuple):
  """Per-token backward coefficients (each [T, 1] f32; u_k / e_k lists of K).

  For cotangents ``(g_lse, g_ent, g_e_k, ·)`` of :class:`Stats` the gradient
  w.r.t. the student logits is, with ``p = softmax(z)``, ``d_k = z − x_k``
  and ``E_p[z] = lse − ent``::

      ∂/∂z_v = p_v [ Σ_k u_k (d_k,v − e_k) + c (z_v − E_p[z]) + r ]
      u_k = g_e_k,  c = −g_ent,  r = g_lse + Σ_k g_e_k.

  (``∂lse/∂z = p``, ``∂e_k/∂z = p(d_k − e_k + 1)``, ``∂ent/∂z = −p(z − E_p[z])``.)
  For the weighted loss ``Σ_k ŵ_k KL_k`` this is docs/DESIGN.md §4's
  ``p((z − y) − E_p[z − y])``. Teachers get no gradient, so ``g_lse_k`` is
  unused.
  """
  lse: jax.Array
  c: jax.Array
  ez: jax.Array
  r: jax.Array
  u_k: tuple
  e_k: tuple


def stats_with_vjp(forward, backward):
  """The jitted ``custom_vjp`` statistics function shared by every path.

  ``forward(h_s, w_s, h_k, w_k) -> Stats`` computes the per-token statistics;
  ``backward(h_s, w_s, h_k, w_k, coef) -> (dh_s, dw_s)`` recomputes the tiles
  from the saved inputs and the per-token coefficients of
  ``coef_from_cotangents``. Teachers get no gradient.
  """
  @jax.custom_vjp
  def stats(h_s, w_s, h_k, w_k):
    return forward(h_s, w_s, h_k, w_k)

  def fwd(h_s, w_s, h_k, w_k):
    out = forward(h_s, w_s, h_k, w_k)
    return out, (h_s, w_s, h_k, w_k, out)

  def bwd(res, g):
    h_s, w_s, h_k, w_k, out = res
    dh, dw = backward(h_s, w_s, h_k, w_k, coef_from_cotangents(out, g))
    return dh, dw, None, None

  stats.defvjp(fwd, bwd)
  return jax.jit(stats)


def coef_from_cotangents(stats: Stats, g: Stats) -> Coef:
  """Builds the :class:`Coef` columns from stats and their cotangents ([T], [T,K])."""
  col = lambda a: a[:, None].astype(jnp.float32)
  k = stats.e_k.shape[1]
  r = g.lse + jnp.sum(g.e_k, axis=1)
  return Coef(col(stats.lse), col(-g.ent), col(stats.lse - stats.ent), col(r),
              tuple(col(g.e_k[:, i]) for i in range(k)),
              tuple(col(stats.e_k[:, i]) for i in range(k)))


def dz_tile(z: jax.Array, xs: Sequence[jax.Array], valid, coef: Coef) -> jax.Array:
  """Gradient w.r.t. the student logits of one tile (see :class:`Coef`).

  Args:
    z: [t, v] student logits (f32, divided by τ); may hold garbage where not
      ``valid``.
    xs: K teacher logit tiles [t, v].
    valid: boolean broadcastable to [t, v], or None (all valid).
    coef: per-token coefficients, each ``[t, 1]``.

  Returns:
    [t, v] f32, exactly 0 where not ``valid``. Multiply by 1/τ (chain rule
    through ``z = hW/τ``) before the matmuls.
  """
  z = _sel(valid, z, 0.0)
  p = _sel(valid, jnp.exp(z - coef.lse), 0.0)
  inner = coef.c * (z - coef.ez) + coef.r
  for x, u, e in zip(xs, coef.u_k, coef.e_k):
    inner = inner + u * ((z - _sel(valid, x, 0.0)) - e)
  return p * inner


def kl_from_stats(stats: Stats) -> jax.Array:
  """Per-teacher reverse KL ``KL(p‖q_k) = E_p[z − x_k] − lse(z) + lse(x_k)``: [T, K]."""
  return stats.e_k - stats.lse[:, None] + stats.lse_k
