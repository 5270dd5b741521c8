"""Pallas gradient-in-forward reverse KL for training (docs/DESIGN.md §4).

For the scalar loss ``L = Σ_t c_t Σ_k ŵ_tk KL(p_t‖q_tk)`` the gradient is
known during the forward pass. With ``z = h_s W_s / τ``, ``x_k = h_k W_k / τ``,
``p = softmax(z)`` and ``b = z − Σ_k ŵ_k x_k`` (so ``E_p[b] = Σ_k ŵ_k E_p[z − x_k]``
wherever ``Σ_k ŵ_k = 1``, i.e. wherever ``c ≠ 0``: the grads-function contract)::

    g = dL/dz = c p (b − E_p[b]),   dh_s = τ⁻¹ g W_sᵀ,   dW_s = τ⁻¹ h_sᵀ g.

``g`` needs ``lse(z)`` and ``E_p[b]``, which are known only after the whole
vocabulary, so an XLA ``lax.scan`` walks the tokens in chunks of ``block_c``
and runs two phases per chunk:

* phase 1 (:func:`_phase1_kernel`, grid ``(C/bt, V/bv)``, every program
  independent): the ``1 + K`` logit matmuls of one tile, written to a
  ``[C, V]`` float32 buffer pair ``(z, b)``, plus the per-tile statistics
  ``(lse, ent, E_p[z − x_k], lse_k)`` of :mod:`pallas_kernels.tile_math`,
  which XLA merges exactly (:func:`tile_math.merge_stats`; across vocabulary
  shards :func:`tile_math.merge_stats_collective`). They also give the
  per-token KL and entropy the training entry returns;
* phase 2: ``g`` from the buffered tiles, ``dh`` and ``dW`` with two matmuls.

Head matmuls: ``3 + K`` per step (4 at K = 1, 6 at K = 3), against
``2 (1 + K) + 2`` for the per-token custom_vjp path, which recomputes every
logit tile in its backward. The buffer costs ``8 C V`` bytes (C=256,
V=131072: 256 MiB); ``block_c`` trades it against the scan length.

Why a token-chunk scan in XLA rather than one kernel: keeping phase 1 free of
grid-carried state makes it the same program on TPU (Mosaic) and GPU
(Triton), and the chunk bounds both the buffer and phase 2's resident ``dh``
block. Phase 2 has two layouts, as :mod:`pallas_kernels.pallas_kl` does:

* ``"tiled"`` (TPU; CPU interpret): one kernel, grid ``(V/bv, C/bt)``; the
  ``[Ds, bv]`` ``dW`` tile stays resident over the inner token axis (it is
  aliased with the carried ``dW``, so chunks accumulate in place) and the
  whole ``[C, Ds]`` ``dh`` block stays resident over the grid;
* ``"looped"`` (GPU): Triton runs grid points in parallel, so the reductions
  are in-kernel loops (:mod:`pallas_kernels.pallas_train_looped`): a ``dh``
  kernel over token tiles and a ``dW`` kernel over vocabulary tiles, with the
  hidden width chunked by ``block_d``. ``g`` is recomputed (elementwise, no
  matmul) in each.

T, V (and, looped, the widths) are zero-padded to the blocks. Padded tokens
get ``c = ŵ = 0``, so ``g = 0``; padded columns are masked out of the
statistics, and their (non-zero) ``g`` meets the zero columns of the padded
``W_s`` in ``dh`` and is sliced off ``dW``. Phase 2 is sequential over its
grid (``"arbitrary"``: ``dh`` is resident throughout), so a two-core TPU
chip runs it on one core.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import pallas_train_looped as looped, tile_math
from pallas_kernels.pallas_kl import BlockSizes
from pallas_kernels.tile_math import Stats, round_up
from pallas_kernels.train_grads import TrainOut, weighted_loss

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class TrainBlockSizes(BlockSizes):
  """Block sizes of the gradient-in-forward kernels: :class:`pallas_kl.BlockSizes`
  (same tile rules and validation per layout) plus the token chunk.

  Attributes:
    block_c: tokens per scan step (the ``[C, V]`` buffers); a multiple of
      ``block_t``.
    v_splits: looped only: vocabulary splits of the ``dh`` kernel, run as
      parallel programs (``C/bt`` alone would leave most SMs idle) whose
      partial sums ``[S, C, Ds]`` XLA adds.
    (other fields: see :class:`pallas_kl.BlockSizes`.)
  """
  block_c: int = 256

  def __post_init__(self):
    super().__post_init__()
    if not (isinstance(self.block_c, int) and self.block_c > 0
            and self.block_c % self.block_t == 0):
      raise ValueError(f"TrainBlockSizes.block_c={self.block_c!r} must be a positive multiple "
                       f"of block_t={self.block_t}")

  @classmethod
  def get_default(cls, backend: str | None = None) -> "TrainBlockSizes":
    """:meth:`pallas_kl.BlockSizes.get_default` tiles, ``block_c=256`` and, on
    GPU, 32 ``dh`` splits (untuned: no TPU or GPU was available)."""
    bs = super().get_default(backend)
    return dataclasses.replace(bs, v_splits=32) if bs.layout == "looped" else bs


def _fit(bs: TrainBlockSizes, t: int, v: int, dtype) -> TrainBlockSizes:
  """Shrinks blocks larger than the (rounded-up) arrays."""
  if bs.layout == "tiled":
    bt = min(bs.block_t, round_up(t, 8 * max(1, 4 // jnp.dtype(dtype).itemsize)))
    bv = min(bs.block_v, round_up(v, 128))
  else:
    p2 = lambda n: max(16, 1 << (n - 1).bit_length())
    bt, bv = min(bs.block_t, p2(t)), min(bs.block_v, p2(v))
  bc = min(round_up(bs.block_c, bt), round_up(t, bt))
  return dataclasses.replace(bs, block_c=bc, block_t=bt, block_v=bv,
                             v_splits=min(bs.v_splits, -(-v // bv)))


def _phase1_kernel(*refs, k, n_heads, vocab, bv, bd, inv_tau):
  """refs = hs [bt, Ds], ws [Ds, bv], h_k [bt, Dt]*K, w_k [Dt, bv]*n_heads, ŵ_k [bt, 1]*K |
  z, b [bt, bv], per-tile lse, ent, e_k*K, lse_k*K [bt, 1]."""
  hs_ref, ws_ref = refs[:2]
  hk_refs, wk_refs = refs[2:2 + k], refs[2 + k:2 + k + n_heads]
  w_hat = [r[...] for r in refs[2 + k + n_heads:2 + 2 * k + n_heads]]
  z_ref, b_ref, *stat_refs = refs[2 + 2 * k + n_heads:]
  z = looped.dot_refs(hs_ref, ws_ref, bd) * inv_tau
  # A shared head (n_heads = 1) is one input: its tile is loaded once for all K.
  xs = [looped.dot_refs(hk_refs[i], wk_refs[min(i, n_heads - 1)], bd) * inv_tau
        for i in range(k)]
  valid = None
  if vocab is not None:  # padded columns (W = 0 there) must not enter the statistics
    valid = pl.program_id(1) * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1) < vocab
  acc = tile_math.acc_update(tile_math.acc_init(z.shape[0], k), z, xs, valid)
  lse, ent, e_k, lse_k = tile_math.acc_finalize(acc)
  z_ref[...], b_ref[...] = z, z - sum(w * x for w, x in zip(w_hat, xs))
  for ref, val in zip(stat_refs, [lse, ent, *e_k, *lse_k]):
    ref[...] = val


def phase1(h_s, w_s, h_k, w_k, w_hat_cols, *, inv_tau, bs, interpret, vocab) -> tuple:
  """Logit buffers and per-tile statistics of one token chunk.

  Args:
    h_s: [C, Ds]; w_s: [Ds, Vp]; h_k: K arrays [C, Dt_k]; w_k: K heads
      [Dt_k, Vp], or one head shared by every teacher (all padded to the
      blocks); w_hat_cols: K columns [C, 1] of ŵ.
    vocab: the unpadded V. A tile of padding alone gets ``lse = NEG``, which
      :func:`tile_math.merge_stats` weights by exactly 0.

  Returns:
    ``(z, b, stats)``: [C, Vp] f32 buffers and :class:`tile_math.Stats` with
    a leading tile axis (``[V/bv, C]``, ``[V/bv, C, K]``).
  """
  c, vp, k = h_s.shape[0], w_s.shape[1], len(h_k)
  bt, bv = bs.block_t, bs.block_v
  nv = vp // bv
  bd = bs.block_d if bs.layout == "looped" else None
  rows = lambda a: pl.BlockSpec((bt, a.shape[1]), lambda i, j: (i, 0))
  cols = lambda a: pl.BlockSpec((a.shape[0], bv), lambda i, j: (0, j))
  tile = pl.BlockSpec((bt, bv), lambda i, j: (i, j))
  stat = pl.BlockSpec((None, bt, 1), lambda i, j: (j, i, 0))
  outs = pl.pallas_call(
      functools.partial(_phase1_kernel, k=k, n_heads=len(w_k),
                        vocab=vocab if vocab < vp else None, bv=bv, bd=bd, inv_tau=inv_tau),
      out_shape=[tile_math.out_struct((c, vp), _F32, h_s, w_s)] * 2
      + [tile_math.out_struct((nv, c, 1), _F32, h_s, w_s)] * (2 + 2 * k),
      grid=(c // bt, nv),
      in_specs=[rows(h_s), cols(w_s)] + [rows(h) for h in h_k] + [cols(w) for w in w_k]
      + [pl.BlockSpec((bt, 1), lambda i, j: (i, 0))] * k,
      out_specs=[tile] * 2 + [stat] * (2 + 2 * k),
      compiler_params=_params(bs, ("parallel", "parallel")),
      interpret=interpret, name="reverse_kl_train_phase1")(
          h_s, w_s, *h_k, *w_k, *w_hat_cols)
  st = [o[..., 0] for o in outs[2:]]
  stack = lambda a: jnp.stack(a, axis=2)
  return outs[0], outs[1], Stats(st[0], st[1], stack(st[2:2 + k]), stack(st[2 + k:]))


def _phase2_tiled_kernel(z_ref, b_ref, lse_ref, eb_ref, c_ref, hs_ref, ws_ref, dw_in_ref,
                         dh_ref, dw_ref, *, bt):
  """Grid (V tiles, token tiles): ``g`` of one tile; dh rows += g W_sᵀ, dW tile += h_sᵀ g."""
  j, i = pl.program_id(0), pl.program_id(1)
  g = c_ref[...] * jnp.exp(z_ref[...] - lse_ref[...]) * (b_ref[...] - eb_ref[...])
  hs, ws = hs_ref[...], ws_ref[...]
  rows = pl.ds(pl.multiple_of(i * bt, bt), bt)
  dh = lax.dot_general(g.astype(ws.dtype), ws, _NT, preferred_element_type=_F32)

  @pl.when(j == 0)
  def _first_tile():
    dh_ref[rows, :] = dh

  @pl.when(j > 0)
  def _next_tile():
    dh_ref[rows, :] += dh

  @pl.when(i == 0)
  def _carry_dw():
    dw_ref[...] = dw_in_ref[...]

  dw_ref[...] += lax.dot_general(hs, g.astype(hs.dtype), _TN, preferred_element_type=_F32)


def _phase2_tiled(z, b, cols, h_s, w_s, dw, *, bs, interpret):
  c, vp = z.shape
  ds = h_s.shape[1]
  bt, bv = bs.block_t, bs.block_v
  col = pl.BlockSpec((bt, 1), lambda j, i: (i, 0))
  tile = pl.BlockSpec((bt, bv), lambda j, i: (i, j))
  w_tile = pl.BlockSpec((ds, bv), lambda j, i: (0, j))
  return pl.pallas_call(
      functools.partial(_phase2_tiled_kernel, bt=bt),
      out_shape=[tile_math.out_struct((c, ds), _F32, z, w_s),
                 tile_math.out_struct(dw.shape, _F32, z, dw)],
      grid=(vp // bv, c // bt),
      in_specs=[tile, tile, col, col, col, pl.BlockSpec((bt, ds), lambda j, i: (i, 0)), w_tile,
                w_tile],
      out_specs=[pl.BlockSpec((c, ds), lambda j, i: (0, 0)), w_tile],
      input_output_aliases={7: 1},
      compiler_params=_params(bs, ("arbitrary", "arbitrary")),
      interpret=interpret, name="reverse_kl_train_phase2")(z, b, *cols, h_s, w_s, dw)


def _params(bs: TrainBlockSizes, semantics):
  if bs.layout == "looped":
    return looped.compiler_params(bs.num_warps, bs.num_stages)
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=bs.vmem_limit_bytes)


def train_grads_core(h_s, w_s, h_k, w_k, w_hat, coef, *, inv_tau, bs, interpret, axis=None):
  """The token-chunk scan (module docstring) on padded copies of the inputs.

  Args:
    h_s, w_s, h_k, w_k, w_hat, coef: as :func:`train_grads_pallas`; ``w_k``
      may hold one head shared by all K teachers.
    axis: inside ``shard_map``, the mesh axis splitting V: the per-token
      statistics are merged across it (:func:`tile_math.merge_stats_collective`).

  Returns:
    ``(Stats [T] / [T, K], dh_s [T, Ds] f32, dW_s [Ds, V] f32)``; with ``axis``
    ``dh_s`` is this shard's partial sum and ``dW_s`` its columns.
  """
  t, v, k = h_s.shape[0], w_s.shape[1], len(h_k)
  looped_layout, bc = bs.layout == "looped", bs.block_c
  bd = bs.block_d if looped_layout else 1  # widths padded to the looped layout's chunks
  tp, vp = round_up(t, bc), round_up(v, bs.block_v * (bs.v_splits if looped_layout else 1))
  pad = lambda a, shape: (a if a.shape == shape
                          else jnp.pad(a, [(0, n - d) for n, d in zip(shape, a.shape)]))
  mats = [pad(m, (tp, round_up(m.shape[1], bd))) for m in (h_s, *h_k)]
  heads = [pad(w, (round_up(w.shape[0], bd), vp)) for w in (w_s, *w_k)]
  chunks = lambda a: a.reshape(tp // bc, bc, *a.shape[1:])
  xs = ([chunks(m) for m in mats], chunks(pad(w_hat.astype(_F32), (tp, k))),
        chunks(pad(coef.astype(_F32), (tp,))))

  def step(dw, x):
    (hc, *hkc), w_hat_c, coef_c = x
    z, b, tiles = phase1(hc, heads[0], hkc, heads[1:], [w_hat_c[:, i:i + 1] for i in range(k)],
                         inv_tau=inv_tau, bs=bs, interpret=interpret, vocab=v)
    st = tile_math.merge_stats(tiles, axis=0)
    if axis is not None:
      st = tile_math.merge_stats_collective(st, axis)
    # E_p[b] = Σ_k ŵ_k E_p[z − x_k]; the chain rule through z = h W / τ gives c/τ.
    cols = [st.lse[:, None], jnp.sum(w_hat_c * st.e_k, axis=1, keepdims=True),
            (coef_c * inv_tau)[:, None]]
    if looped_layout:
      dh, dw = looped.phase2(z, b, cols, hc, heads[0], dw, bs=bs, interpret=interpret)
    else:
      dh, dw = _phase2_tiled(z, b, cols, hc, heads[0], dw, bs=bs, interpret=interpret)
    return dw, (dh, st)

  dw0 = tile_math.match_vma(jnp.zeros(heads[0].shape, _F32), h_s, w_s)
  dw, (dh, st) = lax.scan(step, dw0, xs)
  unchunk = lambda a: a.reshape(tp, *a.shape[2:])[:t]
  return (jax.tree.map(unchunk, st), unchunk(dh)[:, :h_s.shape[1]], dw[:w_s.shape[0], :v])


def check_block_sizes(sizes, t: int, v: int, dtype) -> TrainBlockSizes:
  """The validated, fitted block sizes (default: ``TrainBlockSizes.get_default()``)."""
  if sizes is not None and not isinstance(sizes, TrainBlockSizes):
    raise ValueError(f"block_sizes={sizes!r}: impl='pallas' takes a TrainBlockSizes")
  return _fit(sizes or TrainBlockSizes.get_default(), t, v, dtype)


@functools.lru_cache(maxsize=None)
def _grads_fn(inv_tau: float, bs: TrainBlockSizes, interpret: bool, shared_head: bool):
  def fn(h_s, w_s, h_k, w_k, w_hat, coef):
    st, dh, dw = train_grads_core(h_s, w_s, h_k, w_k[:1] if shared_head else w_k, w_hat, coef,
                                  inv_tau=inv_tau, bs=bs, interpret=interpret)
    kl = tile_math.kl_from_stats(st)
    return TrainOut(weighted_loss(coef, w_hat, kl), kl, st.ent, dh.astype(h_s.dtype),
                    dw.astype(w_s.dtype))
  return jax.jit(fn)


def train_grads_pallas(h_s: jax.Array, w_s: jax.Array, h_k: Sequence[jax.Array],
                       w_k: Sequence[jax.Array], w_hat: jax.Array, coef: jax.Array, *,
                       temperature: float, sizes: TrainBlockSizes | None = None,
                       shared_head: bool = False, interpret: bool | None = None) -> TrainOut:
  """The Pallas grads function of :mod:`pallas_kernels.train_loss` (its
  module docstring has the contract): loss, per-token KL / entropy and the
  gradients of ``Σ_t c_t Σ_k ŵ_tk KL(p_t‖q_tk)`` in one pass.

  Args:
    h_s: [T, Ds] student hidden states; w_s: [Ds, V] student head.
    h_k: K >= 1 arrays [T, Dt_k]; w_k: K heads [Dt_k, V].
    w_hat: [T, K] f32 renormalised weights; coef: [T] f32 ``c_t`` (0 where
      the ``w_hat`` row is 0).
    temperature: τ > 0 (static).
    sizes: :class:`TrainBlockSizes` (default: ``get_default()``).
    shared_head: every ``w_k[i]`` is one head: only ``w_k[0]`` is read, each
      of its tiles once for all K teachers.
    interpret: Pallas interpret mode (default: on CPU).

  Returns:
    :class:`~pallas_kernels.train_grads.TrainOut`: ``loss`` [], ``kl`` [T, K],
    ``ent`` [T] (f32), ``dh_s`` [T, Ds] / ``dw_s`` [Ds, V] in the input dtypes.

  Raises:
    ValueError: mismatched shapes, no teachers, or bad block sizes.
  """
  if h_s.ndim != 2 or w_s.ndim != 2 or h_s.shape[1] != w_s.shape[0]:
    raise ValueError(f"{h_s.shape=} and {w_s.shape=}: expected [T, Ds] and [Ds, V]")
  t, k = h_s.shape[0], len(h_k)
  if k == 0 or len(w_k) != k:
    raise ValueError(f"{len(h_k)=} teacher hiddens and {len(w_k)=} heads: need K >= 1 of each")
  for i, (h, w) in enumerate(zip(h_k, w_k)):
    if h.shape[0] != t or h.shape[1] != w.shape[0] or w.shape[1] != w_s.shape[1]:
      raise ValueError(f"teacher {i}: {h.shape=} {w.shape=} do not match {h_s.shape=} {w_s.shape=}")
  if w_hat.shape != (t, k) or coef.shape != (t,):
    raise ValueError(f"{w_hat.shape=} and {coef.shape=}: expected [T, K]=({t}, {k}) and [T]")
  bs = check_block_sizes(sizes, t, w_s.shape[1], h_s.dtype)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  fn = _grads_fn(1.0 / float(temperature), bs, bool(interpret), bool(shared_head))
  return fn(h_s, w_s, tuple(h_k), tuple(w_k), w_hat, coef)
