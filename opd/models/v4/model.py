"""The DeepSeek-V4 decoder stack as one linen module (docs/DESIGN.md §2,
"DeepSeek-V4 components"); not yet wired into ``ModelConfig`` / ``opd.models.forward``.

  h_0 = [E[tokens]] * N                       (the embedding copied to N streams)
  h_i = V4DecoderLayer_i(h_{i-1})             (layer i's attention / MLP type)
  x   = RMSNorm(HyperHead(h_L));  logits = x W_head

Params: ``embedding [V, D]``, ``layers_{i}/...`` (``V4DecoderLayer``),
``hc_head/...``, ``final_norm/scale [D]``, ``lm_head [D, V]``; hash-routed
layers' tables in the ``"tables"`` collection (``layers_{i}/mlp/tid2eid``).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.models.layers import RMSNorm, param
from opd.models.v4.hyper import HyperHead
from opd.models.v4.layer import V4DecoderLayer, V4LayerConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class V4ModelConfig:
  """The stack (transformers' ``DeepseekV4Config`` field in brackets).

  Attributes:
    vocab_size: V (``vocab_size``).
    layers: one ``V4LayerConfig`` per layer (``num_hidden_layers``, ``layer_types``,
      ``mlp_layer_types``); all share one ``HyperConfig``.
    norm_eps: the final RMSNorm's epsilon (``rms_norm_eps``).
  """
  vocab_size: int
  layers: tuple[V4LayerConfig, ...]
  norm_eps: float = 1e-6

  def __post_init__(self):
    if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
      raise ValueError(f"V4ModelConfig.vocab_size must be an int >= 1, got {self.vocab_size!r}")
    if not self.layers:
      raise ValueError("V4ModelConfig.layers must name at least one layer, got ()")
    hypers = {layer.hyper for layer in self.layers}
    if len(hypers) != 1:
      raise ValueError(f"V4ModelConfig.layers must share one HyperConfig, got {hypers}")
    for i, layer in enumerate(self.layers):
      if layer.moe.mlp_type == "hash_moe" and layer.moe.vocab_size != self.vocab_size:
        raise ValueError(f"V4ModelConfig.layers[{i}].moe.vocab_size={layer.moe.vocab_size} "
                         f"must equal vocab_size={self.vocab_size}")

  @property
  def hyper(self):
    return self.layers[0].hyper


class V4Model(nn.Module):
  """``(tokens [B, T], positions [B, T] | None, mask [B, T] | None) -> (logits, x)``.

  logits ``[B, T, V]``, x ``[B, T, D]`` the final-norm output (``x @ lm_head ==
  logits``). ``positions`` default to ``0..T-1``.
  """
  cfg: V4ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, positions: Array | None = None, mask: Array | None = None):
    cfg, hc = self.cfg, self.cfg.hyper
    D, N, V = hc.d_model, hc.n_streams, cfg.vocab_size
    if tokens.ndim != 2:
      raise ValueError(f"V4Model: tokens must be [B, T], got {tokens.shape=}")
    B, T = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    emb = param(self, "embedding", (V, D), ("vocab", "embed"), jnp.float32)
    h = jnp.broadcast_to(jnp.take(emb, tokens, axis=0)[:, :, None], (B, T, N, D))
    for i, layer in enumerate(cfg.layers):
      h, _ = V4DecoderLayer(layer, name=f"layers_{i}")(h, positions, tokens, mask)
    x = RMSNorm(cfg.norm_eps, h.dtype, jnp.float32, name="final_norm")(
        HyperHead(hc, name="hc_head")(h))
    head = param(self, "lm_head", (D, V), ("embed", "vocab"), jnp.float32)
    return x @ head.astype(x.dtype), x
