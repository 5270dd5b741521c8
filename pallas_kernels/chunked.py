"""Chunked-XLA vocabulary statistics: ``lax.scan`` over vocabulary tiles.

Runs on any backend. The forward pass folds one ``[T, block_v]`` tile at a
time into the online accumulators of docs/DESIGN.md §4 (:mod:`pallas_kernels.tile_math`);
the backward pass (``custom_vjp``) recomputes each tile's logits from the
saved per-token statistics and accumulates ``dh_s`` and the tile's columns of
``dW_s``. Peak transient memory is a few ``[T, block_v]`` float32 tiles plus
the gradients themselves, never ``[T, V]``.

A vocabulary that is not a multiple of ``block_v`` is handled by one extra
static-size remainder tile, so no head is ever padded or copied.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tile_math
from pallas_kernels.tile_math import Stats


@dataclasses.dataclass(frozen=True)
class ChunkSizes:
  """Tile sizes of the chunked path.

  Attributes:
    block_v: vocabulary columns per scan step. Transient memory is about
      ``(4 + 2K) * T * block_v * 4`` bytes.
  """
  block_v: int = 2048

  def __post_init__(self):
    if not (isinstance(self.block_v, int) and self.block_v > 0):
      raise ValueError(f"ChunkSizes.block_v={self.block_v!r} must be a positive int")


def logit_tile(h, w, start, size, inv_tau):
  """Logits of columns ``[start, start + size)``: ([T, size] f32, the head slice)."""
  w_t = lax.dynamic_slice_in_dim(w, start, size, axis=1)
  return jnp.dot(h, w_t, preferred_element_type=jnp.float32) * inv_tau, w_t


def fold_tiles(step, carry, vocab: int, block_v: int):
  """``carry = step(carry, start, size)`` over the vocabulary in tiles.

  Full tiles go through one ``lax.scan`` (``start`` traced, ``size`` static);
  a remainder ``V % block_v`` gets one more static-size call, so no array is
  ever padded.
  """
  bv = min(block_v, vocab)
  n_full, rem = vocab // bv, vocab % bv
  carry, _ = lax.scan(lambda c, j: (step(c, j * bv, bv), None), carry, jnp.arange(n_full))
  if rem:
    carry = step(carry, n_full * bv, rem)
  return carry


def teacher_tiles(h_k, w_k, start, size, inv_tau):
  return [logit_tile(h, w, start, size, inv_tau)[0] for h, w in zip(h_k, w_k)]


def _forward(h_s, w_s, h_k, w_k, *, inv_tau, block_v) -> Stats:
  def step(acc, start, size):
    z, _ = logit_tile(h_s, w_s, start, size, inv_tau)
    return tile_math.acc_update(acc, z, teacher_tiles(h_k, w_k, start, size, inv_tau), None)

  acc = tile_math.match_vma(tile_math.acc_init(h_s.shape[0], len(h_k)), h_s, w_s)
  acc = fold_tiles(step, acc, w_s.shape[1], block_v)
  return tile_math.stats_from_columns(*tile_math.acc_finalize(acc), len(h_k))


def backward_tiles(h_s, w_s, dz_fn, *, inv_tau, block_v):
  """(dh_s [T, Ds], dW_s [Ds, V]) given ``dz_fn(z, start, size) -> dL/dz`` per tile.

  ``dz_fn`` returns the gradient w.r.t. the (τ-divided) student logits of
  the tile; the chain rule's 1/τ is applied here.
  """
  mm_dtype = jnp.promote_types(h_s.dtype, w_s.dtype)

  def step(carry, start, size):
    dh, dw = carry
    z, w_t = logit_tile(h_s, w_s, start, size, inv_tau)
    dz = (dz_fn(z, start, size) * inv_tau).astype(mm_dtype)
    dh = dh + jnp.einsum("TV,DV->TD", dz, w_t, preferred_element_type=jnp.float32)
    dw_t = jnp.einsum("TD,TV->DV", h_s, dz, preferred_element_type=jnp.float32)
    # In-place column update of the carried gradient: no [n, Ds, bv] stack
    # and no second copy of dW_s.
    return dh, lax.dynamic_update_slice_in_dim(dw, dw_t.astype(w_s.dtype), start, axis=1)

  init = tile_math.match_vma((jnp.zeros(h_s.shape, jnp.float32), jnp.zeros(w_s.shape, w_s.dtype)),
                             h_s, w_s)
  dh, dw = fold_tiles(step, init, w_s.shape[1], block_v)
  return dh.astype(h_s.dtype), dw


def _backward(h_s, w_s, h_k, w_k, coef, *, inv_tau, block_v):
  """(dh_s, dW_s) for the per-token :class:`tile_math.Coef`."""
  def dz_fn(z, start, size):
    return tile_math.dz_tile(z, teacher_tiles(h_k, w_k, start, size, inv_tau), None, coef)
  return backward_tiles(h_s, w_s, dz_fn, inv_tau=inv_tau, block_v=block_v)


@functools.lru_cache(maxsize=None)
def _stats_fn(temperature: float, block_v: int):
  """The custom_vjp statistics function for one static configuration."""
  static = dict(inv_tau=1.0 / temperature, block_v=block_v)

  return tile_math.stats_with_vjp(functools.partial(_forward, **static),
                                  functools.partial(_backward, **static))


def vocab_stats_chunked(h_s: jax.Array, w_s: jax.Array, h_k: Sequence[jax.Array],
                        w_k: Sequence[jax.Array], temperature: float,
                        sizes: ChunkSizes | None = None) -> Stats:
  """Per-token :class:`~pallas_kernels.tile_math.Stats` by a scan over vocab tiles.

  Args:
    h_s: [T, Ds] student hidden states.
    w_s: [Ds, V] student head.
    h_k: K arrays [T, Dt_k] teacher hidden states (K may be 0).
    w_k: K arrays [Dt_k, V] teacher heads.
    temperature: τ > 0 (static).
    sizes: tile sizes (default :class:`ChunkSizes`).

  Returns:
    Stats with fields [T] / [T, K] float32. Differentiable w.r.t. ``h_s`` and
    ``w_s`` only.
  """
  sizes = sizes or ChunkSizes()
  return _stats_fn(float(temperature), sizes.block_v)(h_s, w_s, tuple(h_k), tuple(w_k))
