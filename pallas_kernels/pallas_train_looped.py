"""Looped (GPU / Triton) phase 2 of the gradient-in-forward reverse KL.

Triton runs every grid point in parallel, so no grid axis may carry an
accumulator (see :mod:`pallas_kernels.pallas_train` for the math and the
tiled TPU layout). Given one token chunk's buffered ``(z, b)`` tiles and the
per-token ``lse(z)``, ``E_p[b]`` and ``c/τ``, ``g = c/τ · p (b − E_p[b])``:

* ``dh`` kernel, grid ``(C/bt, S)``: program ``(i, s)`` loops over the
  vocabulary tiles of split ``s`` and adds ``g W_sᵀ`` into its partial
  ``[bt, Ds]`` block, ``block_d`` columns per ``dot``; XLA sums the S splits;
* ``dW`` kernel, grid ``(V/bv,)``: starts from the carried ``dW`` tile (aliased
  in place) and loops over token tiles adding ``h_sᵀ g``.

All arrays arrive padded to the blocks (widths to ``block_d``), so every
load is in bounds.
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


def compiler_params(num_warps, num_stages):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot_refs(h_ref, w_ref, bd, rows=slice(None), cols=slice(None)):
  """f32 ``h_ref[rows] @ w_ref[:, cols]``; with ``bd`` the width is chunked."""
  if bd is None or bd >= h_ref.shape[1]:
    return lax.dot_general(h_ref[rows, :], w_ref[:, cols], _NN, preferred_element_type=_F32)

  def body(c, acc):
    d = pl.ds(pl.multiple_of(c * bd, bd), bd)
    return acc + lax.dot_general(h_ref[rows, d], w_ref[d, cols], _NN, preferred_element_type=_F32)

  h0 = h_ref[rows, pl.ds(0, bd)]
  w0 = w_ref[pl.ds(0, bd), cols]
  init = lax.dot_general(h0, w0, _NN, preferred_element_type=_F32)
  return lax.fori_loop(1, h_ref.shape[1] // bd, body, init)


def _g(z_ref, b_ref, lse_ref, eb_ref, c_ref, rows, cols):
  """``g = c/τ · p (b − E_p[b])`` of one tile."""
  return (c_ref[rows, :] * jnp.exp(z_ref[rows, cols] - lse_ref[rows, :])
          * (b_ref[rows, cols] - eb_ref[rows, :]))


def _dh_kernel(z_ref, b_ref, lse_ref, eb_ref, c_ref, ws_ref, dh_ref, *, bv, bd):
  """Grid (token tiles, splits): partial dh [bt, Ds] = Σ_j g_j W_s[:, j]ᵀ over the split."""
  n_chunks = ws_ref.shape[0] // bd

  @pl.loop(0, n_chunks)
  def _zero(c):
    dh_ref[:, pl.ds(pl.multiple_of(c * bd, bd), bd)] = jnp.zeros((dh_ref.shape[0], bd), _F32)

  @pl.loop(0, z_ref.shape[1] // bv)
  def _tile(j):
    cols = pl.ds(pl.multiple_of(j * bv, bv), bv)
    g = _g(z_ref, b_ref, lse_ref, eb_ref, c_ref, slice(None), cols).astype(ws_ref.dtype)

    @pl.loop(0, n_chunks)
    def _acc(c):
      d = pl.ds(pl.multiple_of(c * bd, bd), bd)
      dh_ref[:, d] += lax.dot_general(g, ws_ref[d, cols], _NT, preferred_element_type=_F32)


def _dw_kernel(z_ref, b_ref, lse_ref, eb_ref, c_ref, hs_ref, dw_in_ref, dw_ref, *, bt, bd):
  """Grid (vocabulary tiles,): dW tile [Ds, bv] = carried + Σ_i h_s[i]ᵀ g_i."""
  n_chunks = hs_ref.shape[1] // bd

  @pl.loop(0, n_chunks)
  def _carry(c):
    d = pl.ds(pl.multiple_of(c * bd, bd), bd)
    dw_ref[d, :] = dw_in_ref[d, :]

  @pl.loop(0, hs_ref.shape[0] // bt)
  def _tile(i):
    rows = pl.ds(pl.multiple_of(i * bt, bt), bt)
    g = _g(z_ref, b_ref, lse_ref, eb_ref, c_ref, rows, slice(None)).astype(hs_ref.dtype)

    @pl.loop(0, n_chunks)
    def _acc(c):
      d = pl.ds(pl.multiple_of(c * bd, bd), bd)
      dw_ref[d, :] += lax.dot_general(hs_ref[rows, d], g, _TN, preferred_element_type=_F32)


def phase2(z, b, cols, h_s, w_s, dw, *, bs, interpret):
  """(dh [C, Ds] f32, updated dW [Ds, Vp] f32) of one token chunk.

  Args:
    z, b: [C, Vp] f32 buffers (Vp a multiple of ``block_v · v_splits``);
    cols: ``lse, E_p[b], c/τ`` columns [C, 1];
    h_s: [C, Ds]; w_s: [Ds, Vp]; dw: [Ds, Vp] f32 carried gradient.
  """
  c, vp = z.shape
  ds = h_s.shape[1]
  bt, bv, bd = bs.block_t, bs.block_v, bs.block_d
  params = compiler_params(bs.num_warps, bs.num_stages)
  full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  splits = bs.v_splits
  zb_split = pl.BlockSpec((bt, vp // splits), lambda i, s: (i, s))
  dh = pl.pallas_call(
      functools.partial(_dh_kernel, bv=bv, bd=bd),
      out_shape=tile_math.out_struct((splits, c, ds), _F32, z, w_s),
      grid=(c // bt, splits),
      in_specs=[zb_split, zb_split] + [pl.BlockSpec((bt, 1), lambda i, s: (i, 0))] * 3
      + [pl.BlockSpec((w_s.shape[0], vp // splits), lambda i, s: (0, s))],
      out_specs=pl.BlockSpec((None, bt, ds), lambda i, s: (s, i, 0)),
      compiler_params=params, interpret=interpret,
      name="reverse_kl_train_dh_looped")(z, b, *cols, w_s)
  v_tile = lambda rows: pl.BlockSpec((rows, bv), lambda j: (0, j))
  dw = pl.pallas_call(
      functools.partial(_dw_kernel, bt=bt, bd=bd),
      out_shape=tile_math.out_struct(dw.shape, _F32, z, dw),
      grid=(vp // bv,),
      in_specs=[v_tile(c), v_tile(c)] + [full(x) for x in cols] + [full(h_s), v_tile(ds)],
      out_specs=v_tile(ds),
      input_output_aliases={6: 0},
      compiler_params=params, interpret=interpret,
      name="reverse_kl_train_dw_looped")(z, b, *cols, h_s, dw)
  return jnp.sum(dh, axis=0), dw
