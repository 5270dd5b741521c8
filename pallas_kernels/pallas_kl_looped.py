"""Looped Pallas kernels (the GPU / Triton layout) for the vocab statistics.

Triton runs every grid point in parallel, so no grid axis may carry an
accumulator; the reductions are ``fori_loop``s inside the kernel instead, and
each ``dot`` works on ``[bt, bd] x [bd, bv]`` chunks (Triton keeps tiles in
registers / shared memory, so the hidden width is looped over too):

* forward  grid ``(T/bt, S)``: program ``(i, s)`` folds the vocabulary tiles
  of split ``s`` into the online accumulators (docs/DESIGN.md §4) and writes partial
  statistics ``[S, T, 1]``; the wrapper merges the S splits exactly
  (:func:`tile_math.merge_stats`). Splits give the GPU enough programs when
  ``T/bt`` alone would leave SMs idle.
* ``dh_s`` grid ``(T/bt,)``: loops over vocabulary tiles, recomputes the
  logits and ``dz`` and adds ``dz W_sᵀ`` into its ``[bt, Ds]`` f32 output
  block chunk by chunk.
* ``dW_s`` grid ``(V/bv,)``: loops over token tiles and adds ``h_sᵀ dz`` into
  its ``[Ds, bv]`` f32 output block.

The wrapper pads T, V and D to multiples of the blocks with zeros (padded
rows get all-zero backward coefficients, padded columns are masked out of the
softmax), so every load is in bounds and unmasked. Block sizes must be powers
of two (a Triton requirement).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tile_math

_F32 = jnp.float32
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _logits(h_ref, rows, w_ref, col0, *, bv, bd, inv_tau):
  """[bt, bv] f32 logits of ``h_ref[rows] @ w_ref[:, col0:col0+bv]``, D chunked."""
  n_chunks = h_ref.shape[1] // bd

  def body(c, acc):
    d0 = pl.multiple_of(c * bd, bd)
    h = h_ref[rows, pl.ds(d0, bd)]
    w = w_ref[pl.ds(d0, bd), pl.ds(col0, bv)]
    return acc + lax.dot_general(h, w, _NN, preferred_element_type=_F32)

  bt = h_ref.shape[0] if rows == slice(None) else rows.size
  return lax.fori_loop(0, n_chunks, body, jnp.zeros((bt, bv), _F32)) * inv_tau


def _all_logits(t_refs, rows, ws_ref, hs_ref, col0, k, **kw):
  z = _logits(hs_ref, rows, ws_ref, col0, **kw)
  xs = [_logits(t_refs[2 * i], rows, t_refs[2 * i + 1], col0, **kw) for i in range(k)]
  return z, xs


def _col_valid(col0, bv, vocab, padded_vocab):
  if vocab == padded_vocab:
    return None
  return (col0 + jnp.arange(bv))[None, :] < vocab


def fwd_kernel(*refs, k, vocab, padded_vocab, tiles_per_split, bv, bd, inv_tau):
  """refs = hs [bt, Ds], ws [Ds, Vp], (h_k [bt, Dt], w_k [Dt, Vp])*K | 2+2K partial columns."""
  hs_ref, ws_ref = refs[:2]
  t_refs = refs[2:2 + 2 * k]
  out_refs = refs[2 + 2 * k:]
  s = pl.program_id(1)

  def body(jj, acc):
    col0 = pl.multiple_of((s * tiles_per_split + jj) * bv, bv)
    z, xs = _all_logits(t_refs, slice(None), ws_ref, hs_ref, col0, k, bv=bv, bd=bd,
                        inv_tau=inv_tau)
    return tile_math.acc_update(acc, z, xs, _col_valid(col0, bv, vocab, padded_vocab))

  acc = lax.fori_loop(0, tiles_per_split, body, tile_math.acc_init(hs_ref.shape[0], k))
  lse, ent, e_k, lse_k = tile_math.acc_finalize(acc)
  for ref, val in zip(out_refs, [lse, ent, *e_k, *lse_k]):
    ref[...] = val


def _coef(coef_refs, rows, k):
  vals = [ref[rows, :] for ref in coef_refs]
  return tile_math.Coef(*vals[:4], tuple(vals[4:4 + k]), tuple(vals[4 + k:4 + 2 * k]))


def dh_kernel(*refs, k, vocab, padded_vocab, bv, bd, inv_tau):
  """refs = hs [bt, Ds], ws, (h_k [bt, Dt], w_k)*K, coef [bt, 1]*(4+2K) | dh [bt, Ds] f32."""
  hs_ref, ws_ref = refs[:2]
  t_refs = refs[2:2 + 2 * k]
  coef_refs = refs[2 + 2 * k:6 + 4 * k]
  dh_ref = refs[6 + 4 * k]
  n_chunks = hs_ref.shape[1] // bd
  coef = _coef(coef_refs, slice(None), k)

  @pl.loop(0, n_chunks)
  def _zero(c):
    dh_ref[:, pl.ds(pl.multiple_of(c * bd, bd), bd)] = jnp.zeros((hs_ref.shape[0], bd), _F32)

  @pl.loop(0, padded_vocab // bv)
  def _tile(j):
    col0 = pl.multiple_of(j * bv, bv)
    z, xs = _all_logits(t_refs, slice(None), ws_ref, hs_ref, col0, k, bv=bv, bd=bd,
                        inv_tau=inv_tau)
    dz = tile_math.dz_tile(z, xs, _col_valid(col0, bv, vocab, padded_vocab), coef) * inv_tau
    dz = dz.astype(ws_ref.dtype)

    @pl.loop(0, n_chunks)
    def _acc(c):
      d0 = pl.multiple_of(c * bd, bd)
      w = ws_ref[pl.ds(d0, bd), pl.ds(col0, bv)]
      dh_ref[:, pl.ds(d0, bd)] += lax.dot_general(dz, w, _NT, preferred_element_type=_F32)


def dw_kernel(*refs, k, vocab, padded_vocab, bt, bv, bd, inv_tau):
  """refs = hs [Tp, Ds], ws, (h_k [Tp, Dt], w_k)*K, coef [Tp, 1]*(4+2K) | dW [Ds, bv] f32."""
  hs_ref, ws_ref = refs[:2]
  t_refs = refs[2:2 + 2 * k]
  coef_refs = refs[2 + 2 * k:6 + 4 * k]
  dw_ref = refs[6 + 4 * k]
  n_chunks = hs_ref.shape[1] // bd
  col0 = pl.multiple_of(pl.program_id(0) * bv, bv)
  valid = _col_valid(col0, bv, vocab, padded_vocab)

  @pl.loop(0, n_chunks)
  def _zero(c):
    dw_ref[pl.ds(pl.multiple_of(c * bd, bd), bd), :] = jnp.zeros((bd, bv), _F32)

  @pl.loop(0, hs_ref.shape[0] // bt)
  def _tile(i):
    rows = pl.ds(pl.multiple_of(i * bt, bt), bt)
    z, xs = _all_logits(t_refs, rows, ws_ref, hs_ref, col0, k, bv=bv, bd=bd, inv_tau=inv_tau)
    dz = tile_math.dz_tile(z, xs, valid, _coef(coef_refs, rows, k)) * inv_tau
    dz = dz.astype(hs_ref.dtype)

    @pl.loop(0, n_chunks)
    def _acc(c):
      d0 = pl.multiple_of(c * bd, bd)
      h = hs_ref[rows, pl.ds(d0, bd)]
      dw_ref[pl.ds(d0, bd), :] += lax.dot_general(h, dz, _TN, preferred_element_type=_F32)



def _pad_to(a, shape):
  pads = [(0, s - d) for s, d in zip(shape, a.shape)]
  return a if all(p == (0, 0) for p in pads) else jnp.pad(a, pads)


def _pad_inputs(h_s, w_s, h_k, w_k, bt, bd, vp):
  tp = tile_math.round_up(h_s.shape[0], bt)
  mats = []
  for h, w in [(h_s, w_s), *zip(h_k, w_k)]:
    dp = tile_math.round_up(h.shape[1], bd)
    mats += [_pad_to(h, (tp, dp)), _pad_to(w, (dp, vp))]
  return mats


def _params(num_warps, num_stages):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def forward(h_s, w_s, h_k, w_k, *, inv_tau, bt, bv, bd, splits, num_warps, num_stages,
            interpret):
  """Returns partial statistics ``2 + 2K`` arrays [S, T, 1] (merge over S)."""
  t, v, k = h_s.shape[0], w_s.shape[1], len(h_k)
  per_split = pl.cdiv(pl.cdiv(v, bv), splits)
  vp = per_split * splits * bv
  mats = _pad_inputs(h_s, w_s, h_k, w_k, bt, bd, vp)
  tp = mats[0].shape[0]
  h_spec = lambda d: pl.BlockSpec((bt, d), lambda i, s: (i, 0))
  w_spec = lambda a: pl.BlockSpec(a.shape, lambda i, s: (0, 0))
  in_specs = [spec for h, w in zip(mats[::2], mats[1::2]) for spec in (h_spec(h.shape[1]), w_spec(w))]
  outs = pl.pallas_call(
      functools.partial(fwd_kernel, k=k, vocab=v, padded_vocab=vp, tiles_per_split=per_split,
                        bv=bv, bd=bd, inv_tau=inv_tau),
      out_shape=[tile_math.out_struct((splits, tp, 1), _F32, *mats)] * (2 + 2 * k),
      grid=(tp // bt, splits),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bt, 1), lambda i, s: (s, i, 0))] * (2 + 2 * k),
      compiler_params=_params(num_warps, num_stages),
      interpret=interpret, name="reverse_kl_stats_fwd_looped")(*mats)
  return [o[:, :t] for o in outs]


def backward(h_s, w_s, h_k, w_k, coef_cols, *, inv_tau, bt, bv, bd, splits, num_warps,
             num_stages, interpret):
  """(dh_s [T, Ds], dW_s [Ds, V]) in the input dtypes."""
  t, v, k = h_s.shape[0], w_s.shape[1], len(h_k)
  ds = h_s.shape[1]
  vp = pl.cdiv(pl.cdiv(v, bv), splits) * splits * bv
  mats = _pad_inputs(h_s, w_s, h_k, w_k, bt, bd, vp)
  tp, dsp = mats[0].shape
  # Zero coefficients on padded rows make their dz exactly 0.
  coefs = [_pad_to(c, (tp, 1)) for c in coef_cols]
  full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  row_block = lambda a: pl.BlockSpec((bt, a.shape[1]), lambda i: (i, 0))
  params = _params(num_warps, num_stages)

  dh = pl.pallas_call(
      functools.partial(dh_kernel, k=k, vocab=v, padded_vocab=vp, bv=bv, bd=bd, inv_tau=inv_tau),
      out_shape=tile_math.out_struct((tp, dsp), _F32, *mats),
      grid=(tp // bt,),
      in_specs=[row_block(a) if n % 2 == 0 else full(a) for n, a in enumerate(mats)]
      + [row_block(c) for c in coefs],
      out_specs=pl.BlockSpec((bt, dsp), lambda i: (i, 0)),
      compiler_params=params, interpret=interpret, name="reverse_kl_dh_looped")(*mats, *coefs)

  dw = pl.pallas_call(
      functools.partial(dw_kernel, k=k, vocab=v, padded_vocab=vp, bt=bt, bv=bv, bd=bd,
                        inv_tau=inv_tau),
      out_shape=tile_math.out_struct((dsp, vp), _F32, *mats),
      grid=(vp // bv,),
      in_specs=[full(a) for a in mats] + [full(c) for c in coefs],
      out_specs=pl.BlockSpec((dsp, bv), lambda j: (0, j)),
      compiler_params=params, interpret=interpret, name="reverse_kl_dw_looped")(*mats, *coefs)
  return dh[:t, :ds].astype(h_s.dtype), dw[:ds, :v].astype(w_s.dtype)
