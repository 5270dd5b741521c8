"""DeepSeek-V4's decode cache (docs/DESIGN.md §2, "DeepSeek-V4").

What each attention type needs to go on decoding, all addressed by the
token's RoPE position p (so left-padded rows, whose positions start at their
first real token, need nothing special):

* every layer: the sliding window's keys (= values), a ring of W slots, the
  token at position p in slot ``p mod W`` (``kv [B, W, Dh]``, ``kv_pos [B, W]``,
  -1 = empty);
* CSA / HCA layers (``CompressorState``): the compressor's projections of the
  last R positions (R = 2m with CSA's overlap, m with HCA), a ring as above,
  and the emitted entries, entry w at row w (``entries [B, S // m, C]``);
* CSA layers: the same for the lightning indexer's compressor, whose entries
  are the indexer's keys.

``ring_write`` is the one update of every ring: a chunk of T tokens writes each
valid token into slot ``p mod R``, the latest position winning a slot.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class CompressorState(NamedTuple):
  """One compressor's decode state.

  Attributes:
    c: ``[B, R, Cw]`` fp32 key projections ``x W_kv`` of the last R positions.
    z: ``[B, R, Cw]`` fp32 gate logits ``x W_z`` (the position bias is added on use).
    pos: ``[B, R]`` int32, the position held by each slot (-1 = empty).
    entries: ``[B, S // m, C]`` emitted entries (after norm and RoPE), entry w at row w;
      rows of windows not yet complete hold zeros and are never visible.
  """
  c: Array
  z: Array
  pos: Array
  entries: Array


class V4LayerCache(NamedTuple):
  """One layer's decode state: the sliding window and, for compressed layers, the
  compressor's (``compressor``) and CSA's indexer's (``indexer``) states (else None)."""
  kv: Array
  kv_pos: Array
  compressor: CompressorState | None = None
  indexer: CompressorState | None = None


class V4Cache(NamedTuple):
  """The decode cache of a DeepSeek-V4 ``ModelConfig``: one ``V4LayerCache`` per layer."""
  layers: tuple[V4LayerCache, ...]


def ring_write(ring: Array, ring_pos: Array, new: Array, new_pos: Array,
               valid: Array) -> tuple[Array, Array]:
  """Writes the valid tokens of a chunk into a position-addressed ring.

  Args:
    ring: ``[B, R, ...]`` slot values; ring_pos: ``[B, R]`` int positions (-1 empty).
    new: ``[B, T, ...]``; new_pos: ``[B, T]`` int positions; valid: ``[B, T]`` bool.

  Returns:
    ``(ring, ring_pos)`` where slot r holds the valid new token of largest position
    with ``p mod R == r``, or its old content when none maps there.
  """
  R = ring_pos.shape[1]
  hit = valid[:, :, None] & (new_pos[:, :, None] % R == jnp.arange(R))  # [B, T, R]
  src = jnp.argmax(jnp.where(hit, new_pos[:, :, None], -1), axis=1)  # [B, R] latest token
  has = jnp.any(hit, axis=1)
  idx = src.reshape(src.shape + (1,) * (new.ndim - 2))
  picked = jnp.take_along_axis(new, idx, axis=1).astype(ring.dtype)
  keep = has.reshape(has.shape + (1,) * (new.ndim - 2))
  return (jnp.where(keep, picked, ring),
          jnp.where(has, jnp.take_along_axis(new_pos, src, axis=1), ring_pos).astype(jnp.int32))


def empty_ring(batch: int, slots: int, width: int, dtype) -> tuple[Array, Array]:
  """``(zeros [B, R, width], pos [B, R] = -1)``."""
  return jnp.zeros((batch, slots, width), dtype), jnp.full((batch, slots), -1, jnp.int32)
