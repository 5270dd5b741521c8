"""Checksums of pytrees of arrays, for checkpoint integrity (docs/DESIGN.md, "Failure model").

``tree_checksums(tree)`` gives every array a 64-bit checksum computed on
device from its global values: the same on any mesh or process count, and
changed by any single flipped bit. ``opd.training.checkpoints`` stores them
with each step and checks them on restore.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def path_key(entry) -> str:
  """The name of one pytree path entry (dict key, attribute or index)."""
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


_GOLDEN = 0x9E3779B9


def leaf_checksum(x: jax.Array) -> jax.Array:
  """Two uint32 words of the bits of ``x`` and their positions. Sums of uint32
  wrap, exactly and in any order, so the value does not depend on the
  sharding; word 0 weights element i by the odd number 2i+1, so flipping any
  one bit changes it (by an odd multiple of a power of two below 2**32), and
  word 1 mixes each element nonlinearly (murmur3's finaliser) against swaps."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if unsigned is None:
      raise ValueError(f"cannot checksum an array of dtype {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  # The row-major position of each element (mod 2**32), built without a
  # reshape so that a sharded array is never gathered.
  idx, stride = jnp.zeros(bits.shape, jnp.uint32), 1
  for dim in reversed(range(bits.ndim)):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * jnp.uint32(
        stride % 2 ** 32)
    stride *= bits.shape[dim]
  word0 = jnp.sum(bits * (2 * idx + 1), dtype=jnp.uint32)
  h = bits ^ (idx * jnp.uint32(_GOLDEN))
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  h = h ^ (h >> 16)
  return jnp.stack([word0, jnp.sum(h, dtype=jnp.uint32)])


_tree_checksum = jax.jit(lambda tree: jax.tree.map(leaf_checksum, tree))


def tree_checksums(tree: PyTree) -> dict[str, str]:
  """``{"dotted.leaf.path": 16 hex digits}`` for every array of ``tree`` (see
  ``leaf_checksum``); the same for the same values on any mesh."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  names = [".".join(path_key(k) for k in path) for path, _ in leaves]
  arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in leaves]
  sums = _tree_checksum(arrays)
  out = {}
  for name, words in zip(names, sums):
    w = np.asarray(words.addressable_data(0))  # replicated: every process holds it
    out[name] = f"{int(w[0]):08x}{int(w[1]):08x}"
  return out
