"""Grid-tiled Pallas kernels (the TPU / Mosaic layout) for the vocab statistics.

The grid walks ``(token tile, vocabulary tile)``; Pallas double-buffers the
blocks HBM→VMEM and the reduction axis carries VMEM scratch accumulators
across steps (``dimension_semantics = (parallel, arbitrary)``):

* forward  grid ``(T/bt, V/bv)``: online ``m, l, s, a_k, m_k, l_k`` (docs/DESIGN.md §4),
  finalised into ``lse, ent, e_k, lse_k`` at the last vocabulary tile;
* ``dh_s`` grid ``(T/bt, V/bv)``: recomputes the logits, ``dz`` from the saved
  per-token coefficients, accumulates ``dz W_sᵀ`` in a ``[bt, Ds]`` scratch;
* ``dW_s`` grid ``(V/bv, T/bt)``: the same ``dz``, accumulates ``h_sᵀ dz`` in a
  ``[Ds, bv]`` scratch.

Each block holds the full hidden width (``[bt, D]`` and ``[D, bv]``), so VMEM
use grows with D; :func:`vmem_estimate` sizes the limit. ``T`` and ``V`` need
not be multiples of the blocks: the last blocks overhang the arrays, and the
overhanging rows / columns (whose contents are unspecified) are removed with
``where`` before they can reach a sum or a matmul.

Per-token inputs and outputs are ``[T, 1]`` float32 columns, one array per
statistic, so that no kernel has to slice lanes.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tile_math

_F32 = jnp.float32
# dot_general dimension numbers: [t,d]x[d,v], [t,v]x[d,v]ᵀ, [t,d]ᵀx[t,v].
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _logit_tiles(hs, ws, teacher_vals, inv_tau):
  z = lax.dot_general(hs, ws, _NN, preferred_element_type=_F32) * inv_tau
  xs = [lax.dot_general(h, w, _NN, preferred_element_type=_F32) * inv_tau for h, w in teacher_vals]
  return z, xs


def _col_valid(j, block_v, vocab):
  """[1, bv] mask of in-range vocabulary columns, or None if V % bv == 0."""
  if vocab % block_v == 0:
    return None
  return j * block_v + lax.broadcasted_iota(jnp.int32, (1, block_v), 1) < vocab


def _row_valid(i, block_t, tokens):
  if tokens % block_t == 0:
    return None
  return i * block_t + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0) < tokens


def _split_refs(refs, sizes):
  out, pos = [], 0
  for n in sizes:
    out.append(refs[pos:pos + n])
    pos += n
  return out


def _load_coef(refs, k):
  lse, c, ez, r = (ref[...] for ref in refs[:4])
  return tile_math.Coef(lse, c, ez, r, tuple(ref[...] for ref in refs[4:4 + k]),
                        tuple(ref[...] for ref in refs[4 + k:4 + 2 * k]))


def fwd_kernel(*refs, k, vocab, block_v, inv_tau):
  """Forward body: refs = hs, ws, (h_k, w_k)*K | lse, ent, e_k*K, lse_k*K | scratch."""
  (hs_ref, ws_ref), t_refs, out_refs, acc_refs = _split_refs(refs, (2, 2 * k, 2 + 2 * k, 3 + 3 * k))
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    for ref, val in zip(acc_refs, _flatten_acc(tile_math.acc_init(hs_ref.shape[0], k))):
      ref[...] = val

  z, xs = _logit_tiles(hs_ref[...], ws_ref[...],
                       [(t_refs[2 * i][...], t_refs[2 * i + 1][...]) for i in range(k)], inv_tau)
  acc = tile_math.acc_update(_unflatten_acc([r[...] for r in acc_refs], k), z, xs,
                             _col_valid(j, block_v, vocab))
  for ref, val in zip(acc_refs, _flatten_acc(acc)):
    ref[...] = val

  @pl.when(j == pl.num_programs(1) - 1)
  def _finalize():
    lse, ent, e_k, lse_k = tile_math.acc_finalize(acc)
    for ref, val in zip(out_refs, [lse, ent, *e_k, *lse_k]):
      ref[...] = val


def _flatten_acc(acc):
  return [acc.m, acc.l, acc.s, *acc.a_k, *acc.m_k, *acc.l_k]


def _unflatten_acc(vals, k):
  return tile_math.Acc(vals[0], vals[1], vals[2], tuple(vals[3:3 + k]),
                       tuple(vals[3 + k:3 + 2 * k]), tuple(vals[3 + 2 * k:3 + 3 * k]))


def _dz(hs, ws_ref, t_refs, coef_refs, k, valid, inv_tau):
  z, xs = _logit_tiles(hs, ws_ref[...], [(t_refs[2 * i][...], t_refs[2 * i + 1][...])
                                         for i in range(k)], inv_tau)
  return tile_math.dz_tile(z, xs, valid, _load_coef(coef_refs, k)) * inv_tau


def dh_kernel(*refs, k, vocab, block_v, inv_tau):
  """dh_s body: refs = hs, ws, (h_k, w_k)*K, coef (4+2K) | dh | acc [bt, Ds]."""
  (hs_ref, ws_ref), t_refs, coef_refs, (dh_ref, acc_ref) = _split_refs(
      refs, (2, 2 * k, 4 + 2 * k, 2))
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

  valid = _col_valid(j, block_v, vocab)
  dz = _dz(hs_ref[...], ws_ref, t_refs, coef_refs, k, valid, inv_tau)
  ws = ws_ref[...]
  if valid is not None:  # overhanging head columns may hold NaN; 0·NaN = NaN
    ws = jnp.where(valid, ws, jnp.zeros_like(ws))
  acc_ref[...] += lax.dot_general(dz.astype(ws.dtype), ws, _NT, preferred_element_type=_F32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finalize():
    dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)


def dw_kernel(*refs, k, vocab, tokens, block_v, block_t, inv_tau):
  """dW_s body (grid (V tiles, T tiles)): same refs as :func:`dh_kernel`."""
  (hs_ref, ws_ref), t_refs, coef_refs, (dw_ref, acc_ref) = _split_refs(
      refs, (2, 2 * k, 4 + 2 * k, 2))
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

  hs = hs_ref[...]
  dz = _dz(hs, ws_ref, t_refs, coef_refs, k, _col_valid(j, block_v, vocab), inv_tau)
  rows = _row_valid(i, block_t, tokens)
  if rows is not None:  # overhanging token rows: garbage in h and in the coefficients
    dz = jnp.where(rows, dz, 0.0)
    hs = jnp.where(rows, hs, jnp.zeros_like(hs))
  acc_ref[...] += lax.dot_general(hs, dz.astype(hs.dtype), _TN, preferred_element_type=_F32)

  @pl.when(i == pl.num_programs(1) - 1)
  def _finalize():
    dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def vmem_estimate(bt, bv, widths, itemsize, k, kind):
  """Rough VMEM bytes: double-buffered blocks + scratch + f32 tile temporaries."""
  blocks = sum(2 * (bt * d + d * bv) * itemsize for d in widths)
  temps = (4 + 2 * k) * bt * bv * 4
  scratch = {"fwd": (3 + 3 * k) * bt * 128 * 4,
             "dh": bt * widths[0] * 4 + 2 * bt * widths[0] * itemsize,
             "dw": widths[0] * bv * 4 + 2 * widths[0] * bv * itemsize}[kind]
  return blocks + temps + scratch + (4 + 2 * k) * 2 * bt * 128 * 4


def _compiler_params(semantics, limit):
  return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


def _vmem_limit(est, cap):
  return int(min(max(2 * est, 32 * 2**20), cap))


def _in_specs(h_s, h_k, bt, bv, tok_axis, voc_axis):
  h_map = lambda *g: (g[tok_axis], 0)
  w_map = lambda *g: (0, g[voc_axis])
  specs = [pl.BlockSpec((bt, h_s.shape[1]), h_map), pl.BlockSpec((h_s.shape[1], bv), w_map)]
  for h in h_k:
    specs += [pl.BlockSpec((bt, h.shape[1]), h_map), pl.BlockSpec((h.shape[1], bv), w_map)]
  return specs


def forward(h_s, w_s, h_k, w_k, *, inv_tau, bt, bv, vmem_cap, interpret):
  """Runs the forward kernel; returns ``2 + 2K`` columns [T, 1] (lse, ent, e_k.., lse_k..)."""
  t, v, k = h_s.shape[0], w_s.shape[1], len(h_k)
  grid = (pl.cdiv(t, bt), pl.cdiv(v, bv))
  col = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
  widths = [h_s.shape[1]] + [h.shape[1] for h in h_k]
  est = vmem_estimate(bt, bv, widths, h_s.dtype.itemsize, k, "fwd")
  call = pl.pallas_call(
      functools.partial(fwd_kernel, k=k, vocab=v, block_v=bv, inv_tau=inv_tau),
      out_shape=[tile_math.out_struct((t, 1), _F32, h_s, w_s)] * (2 + 2 * k),
      grid=grid,
      in_specs=_in_specs(h_s, h_k, bt, bv, 0, 1),
      out_specs=[col] * (2 + 2 * k),
      scratch_shapes=[pltpu.VMEM((bt, 1), _F32)] * (3 + 3 * k),
      compiler_params=_compiler_params(("parallel", "arbitrary"), _vmem_limit(est, vmem_cap)),
      interpret=interpret, name="reverse_kl_stats_fwd")
  return call(h_s, w_s, *[a for hw in zip(h_k, w_k) for a in hw])


def backward(h_s, w_s, h_k, w_k, coef_cols, *, inv_tau, bt, bv, vmem_cap, interpret):
  """Runs the dh_s and dW_s kernels; ``coef_cols`` are ``4 + 2K`` columns [T, 1]."""
  t, v, k = h_s.shape[0], w_s.shape[1], len(h_k)
  ds = h_s.shape[1]
  widths = [ds] + [h.shape[1] for h in h_k]
  args = (h_s, w_s, *[a for hw in zip(h_k, w_k) for a in hw], *coef_cols)
  itemsize = h_s.dtype.itemsize

  est = vmem_estimate(bt, bv, widths, itemsize, k, "dh")
  dh = pl.pallas_call(
      functools.partial(dh_kernel, k=k, vocab=v, block_v=bv, inv_tau=inv_tau),
      out_shape=tile_math.out_struct((t, ds), h_s.dtype, h_s, w_s),
      grid=(pl.cdiv(t, bt), pl.cdiv(v, bv)),
      in_specs=_in_specs(h_s, h_k, bt, bv, 0, 1)
      + [pl.BlockSpec((bt, 1), lambda i, j: (i, 0))] * (4 + 2 * k),
      out_specs=pl.BlockSpec((bt, ds), lambda i, j: (i, 0)),
      scratch_shapes=[pltpu.VMEM((bt, ds), _F32)],
      compiler_params=_compiler_params(("parallel", "arbitrary"), _vmem_limit(est, vmem_cap)),
      interpret=interpret, name="reverse_kl_dh")(*args)

  est = vmem_estimate(bt, bv, widths, itemsize, k, "dw")
  dw = pl.pallas_call(
      functools.partial(dw_kernel, k=k, vocab=v, tokens=t, block_v=bv, block_t=bt,
                        inv_tau=inv_tau),
      out_shape=tile_math.out_struct((ds, v), w_s.dtype, h_s, w_s),
      grid=(pl.cdiv(v, bv), pl.cdiv(t, bt)),
      in_specs=_in_specs(h_s, h_k, bt, bv, 1, 0)
      + [pl.BlockSpec((bt, 1), lambda j, i: (i, 0))] * (4 + 2 * k),
      out_specs=pl.BlockSpec((ds, bv), lambda j, i: (0, j)),
      scratch_shapes=[pltpu.VMEM((ds, bv), _F32)],
      compiler_params=_compiler_params(("parallel", "arbitrary"), _vmem_limit(est, vmem_cap)),
      interpret=interpret, name="reverse_kl_dw")(*args)
  return dh, dw
