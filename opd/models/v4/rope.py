"""DeepSeek-V4's interleaved partial RoPE, with YaRN on the compressed branches
(docs/DESIGN.md §2, "DeepSeek-V4")."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opd.models.config import YaRNConfig
from opd.models.mla import yarn_frequencies
from opd.models.v4.config import V4YaRN

Array = jax.Array


def inv_frequencies(dr: int, theta: float, yarn: V4YaRN | None = None) -> Array:
  """``[dr/2]`` fp32 RoPE frequencies: ``theta^(-2i/dr)``, or YaRN's blend of them with
  ``theta^(-2i/dr) / factor`` (``opd.models.mla.yarn_frequencies``, transformers' ramp)."""
  if yarn is None:
    return 1.0 / (theta ** (jnp.arange(0, dr, 2, dtype=jnp.float32) / dr))
  ramp = YaRNConfig(factor=yarn.factor, original_max_position=yarn.original_max_position,
                    beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)
  return jnp.asarray(yarn_frequencies(dr, theta, ramp)[0])


def rope_tail(x: Array, positions: Array, dr: int, theta: float, inverse: bool = False,
              yarn: V4YaRN | None = None) -> Array:
  """Interleaved RoPE on the last ``dr`` dims of ``x [B, T, N, Dh]`` at ``positions [B, T]``.

  Pair i = (x_{2i}, x_{2i+1}) of the tail turns by ``pos · f_i`` with
  ``f = inv_frequencies(dr, theta, yarn)`` (by minus that angle when
  ``inverse``); with ``yarn`` the turned tail is also multiplied by
  ``yarn.attention_factor`` (transformers scales cos and sin by it, the
  inverse rotation included); the first ``Dh - dr`` dims pass through.
  Computed in fp32, returned in ``x``'s dtype.
  """
  if dr == 0:
    return x
  inv_freq = inv_frequencies(dr, theta, yarn)  # [dr/2]
  ang = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, dr/2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  if yarn is not None:
    cos, sin = cos * yarn.attention_factor, sin * yarn.attention_factor
  if inverse:
    sin = -sin
  tail = x[..., -dr:].astype(jnp.float32)
  a, b = tail[..., 0::2], tail[..., 1::2]
  turned = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(tail.shape)
  return jnp.concatenate([x[..., :-dr], turned.astype(x.dtype)], axis=-1)
