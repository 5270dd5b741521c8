"""One DeepSeek-V4 decoder layer (docs/DESIGN.md §2, "DeepSeek-V4").

The residual is N streams ``h [B, T, N, D]``; each of the two blocks reads
them through its own ``HyperConnection`` and writes back with ``expand``:

  (post, comb, u) = attn_hc(h);  h = expand(post, comb, Attn(RMSNorm(u)), h)
  (post, comb, u) = mlp_hc(h);   h = expand(post, comb, MoE(RMSNorm(u), token_ids), h)

Params: ``attn_hc/...``, ``attn_norm/scale [D]``, ``attn/...`` (``V4Attention``),
``mlp_hc/...``, ``mlp_norm/scale [D]``, ``mlp/...`` (``V4MoE``).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.models.layers import RMSNorm
from opd.models.v4.attention import V4Attention, V4AttentionConfig
from opd.models.v4.cache import V4LayerCache
from opd.models.v4.hyper import HyperConfig, HyperConnection, expand
from opd.models.v4.moe import V4MoE, V4MoEConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class V4LayerConfig:
  """A layer: its mHC, attention (``layer_types[i]``) and MoE (``mlp_layer_types[i]``) configs.

  Attributes:
    hyper: both hyper-connections' config.
    attention: the attention block's config.
    moe: the MoE block's config.
    norm_eps: the two block-input RMSNorms' epsilon (``rms_norm_eps``).
  """
  hyper: HyperConfig
  attention: V4AttentionConfig
  moe: V4MoEConfig
  norm_eps: float = 1e-6

  def __post_init__(self):
    widths = {"hyper": self.hyper.d_model, "attention": self.attention.d_model,
              "moe": self.moe.d_model}
    if len(set(widths.values())) != 1:
      raise ValueError(f"V4LayerConfig: the sub-configs' d_model differ: {widths}")
    if not self.norm_eps > 0:
      raise ValueError(f"V4LayerConfig.norm_eps must be > 0, got {self.norm_eps}")


class V4DecoderLayer(nn.Module):
  """``(h [B, T, N, D], positions [B, T], token_ids [B, T] | None, mask [B, T] | None, cache)
  -> (h' [B, T, N, D], Routing, cache)``; ``token_ids`` is needed by a hash-routed layer,
  ``cache`` is the attention's ``V4LayerCache`` (None without one)."""
  cfg: V4LayerConfig

  @nn.compact
  def __call__(self, h: Array, positions: Array, token_ids: Array | None = None,
               mask: Array | None = None, cache: V4LayerCache | None = None):
    cfg = self.cfg
    dt = h.dtype
    norm = lambda name: RMSNorm(cfg.norm_eps, dt, jnp.float32, name=name)
    post, comb, u = HyperConnection(cfg.hyper, name="attn_hc")(h)
    y, cache = V4Attention(cfg.attention, name="attn")(norm("attn_norm")(u), positions, mask,
                                                      cache)
    h = expand(post, comb, y, h)
    post, comb, u = HyperConnection(cfg.hyper, name="mlp_hc")(h)
    y, routing = V4MoE(cfg.moe, name="mlp")(norm("mlp_norm")(u), token_ids)
    return expand(post, comb, y, h), routing, cache
