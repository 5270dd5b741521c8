"""The decoder's building blocks shared by its attention variants (docs/DESIGN.md §2).

RMSNorm, rotary embedding (rotate-half convention, as Llama/Qwen) and the
parameter helper that attaches logical axis names and picks the initialiser
from the parameter's name. ``opd.models.decoder`` (grouped-query attention,
the MLP, the decoder) and ``opd.models.mla`` (multi-head latent attention)
both build on them.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
INIT_STD = 0.02  # as transformers' initializer_range default


def init_kind(name: str) -> str:
  """How a parameter is initialised, from its name alone: "ones" for norm
  scales, "zeros" for biases, "table" for DeepSeek-V4's hash table, "normal"
  (std 0.02) otherwise. ``init_params``
  relies on this one rule to draw every normal parameter in a single op."""
  if name == "scale":
    return "ones"
  if name == "tid2eid":  # DeepSeek-V4's hash routing table (opd.models.v4.moe)
    return "table"
  if name.endswith("bias"):
    return "zeros"
  return "normal"


_INITIALIZERS = {"ones": nn.initializers.ones, "zeros": nn.initializers.zeros,
                 "normal": nn.initializers.normal(INIT_STD)}


def param(module: nn.Module, name: str, shape, axes, dtype):
  """``module.param`` with logical axis names ``axes``, initialised by ``init_kind(name)``."""
  init = _INITIALIZERS[init_kind(name)]
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis, with a learnt ``scale``."""
  eps: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = param(self, "scale", (x.shape[-1],), ("norm",),
                   self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # As transformers: normalise in fp32, cast, then scale in the input dtype.
    return scale.astype(self.dtype) * x32.astype(self.dtype)


def rope(x: Array, positions: Array, theta: float, inv_freq=None) -> Array:
  """Rotary embedding, rotate-half convention. x: [B, T, N, Dh]; positions: [B, T].

  ``inv_freq`` ``[Dh/2]`` replaces the frequencies ``theta^(-2i/Dh)`` (YaRN, ``opd.models.mla``).
  """
  dh = x.shape[-1]
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))  # [Dh/2]
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
  return out.astype(x.dtype)
