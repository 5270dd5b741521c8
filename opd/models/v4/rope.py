"""DeepSeek-V4's interleaved partial RoPE (docs/DESIGN.md §2, "DeepSeek-V4")."""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def rope_tail(x: Array, positions: Array, dr: int, theta: float, inverse: bool = False) -> Array:
  """Interleaved RoPE on the last ``dr`` dims of ``x [B, T, N, Dh]`` at ``positions [B, T]``.

  Pair i = (x_{2i}, x_{2i+1}) of the tail turns by ``pos · theta^(-2i/dr)``
  (by minus that angle when ``inverse``); the first ``Dh - dr`` dims pass
  through. Computed in fp32, returned in ``x``'s dtype.
  """
  if dr == 0:
    return x
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dr, 2, dtype=jnp.float32) / dr))  # [dr/2]
  ang = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, dr/2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  if inverse:
    sin = -sin
  tail = x[..., -dr:].astype(jnp.float32)
  a, b = tail[..., 0::2], tail[..., 1::2]
  turned = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(tail.shape)
  return jnp.concatenate([x[..., :-dr], turned.astype(x.dtype)], axis=-1)
