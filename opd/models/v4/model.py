"""The DeepSeek-V4 decoder of the model family: what ``opd.models.forward`` runs
when ``ModelConfig.v4`` is set (docs/DESIGN.md §2, "DeepSeek-V4").

  h_0 = [E[tokens]] * N                       (the embedding copied to N streams)
  h_i = V4DecoderLayer_i(h_{i-1})             (layer i's attention / MLP type)
  x   = RMSNorm(HyperHead(h_L));  logits = x W_head

Params: ``embedding [V, D]``, ``layers_{i}/...`` (``V4DecoderLayer``; a hash-routed
layer's table is ``layers_{i}/mlp/tid2eid``), ``hc_head/...``,
``final_norm/scale [D]``, ``lm_head [D, V]`` (absent when tied), ``value_head
[D, 1]``, ``value_bias [1]`` (``scalar_head``).
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.models.layers import RMSNorm, param
from opd.models.moe import router_stats
from opd.models.moe_balance import stack_stats
from opd.models.v4.attention import V4Attention, V4AttentionConfig
from opd.models.v4.cache import V4Cache
from opd.models.v4.compressor import CompressorConfig, IndexerConfig
from opd.models.v4.hyper import HyperConfig, HyperHead
from opd.models.v4.layer import V4DecoderLayer, V4LayerConfig
from opd.models.v4.moe import V4MoEConfig

Array = jax.Array


@functools.lru_cache(maxsize=None)
def layer_configs(cfg: Any) -> tuple[V4LayerConfig, ...]:
  """Each layer's sub-configs from a ``ModelConfig`` with ``v4`` set (cached per config)."""
  v4, D, Dh = cfg.v4, cfg.d_model, cfg.resolved_head_dim
  hyper = HyperConfig(d_model=D, n_streams=v4.n_streams, sinkhorn_iters=v4.sinkhorn_iters,
                      eps=v4.hc_eps, norm_eps=cfg.norm_eps)
  out = []
  for layer_type, mlp_type in zip(v4.layer_types, v4.mlp_layer_types):
    compressor = indexer = yarn = None
    theta = cfg.rope_theta
    if layer_type != "sliding_attention":
      csa = layer_type == "compressed_sparse_attention"
      theta, yarn = v4.compress_rope_theta, v4.compress_yarn
      cc = lambda width, overlap: CompressorConfig(
          d_model=D, width=width, compress_rate=v4.csa_compress_rate if csa else
          v4.hca_compress_rate, overlap=overlap, rope_dim=v4.rope_dim, rope_theta=theta,
          norm_eps=cfg.norm_eps, yarn=yarn)
      compressor = cc(Dh, csa)
      if csa:
        indexer = IndexerConfig(compressor=cc(v4.index_head_dim, True),
                                q_lora_rank=v4.q_lora_rank, n_heads=v4.index_n_heads,
                                topk=v4.index_topk)
    attention = V4AttentionConfig(
        d_model=D, n_heads=cfg.n_heads, head_dim=Dh, q_lora_rank=v4.q_lora_rank,
        rope_dim=v4.rope_dim, rope_theta=theta, sliding_window=v4.sliding_window,
        o_groups=v4.o_groups, o_lora_rank=v4.o_lora_rank, norm_eps=cfg.norm_eps,
        compressor=compressor, indexer=indexer, yarn=yarn)
    moe = V4MoEConfig(d_model=D, moe=cfg.moe, mlp_type=mlp_type, vocab_size=cfg.vocab_size,
                      swiglu_limit=v4.swiglu_limit)
    out.append(V4LayerConfig(hyper=hyper, attention=attention, moe=moe, norm_eps=cfg.norm_eps))
  return tuple(out)


def init_v4_cache(cfg: Any, batch: int, max_length: int, dtype) -> V4Cache:
  """An empty ``V4Cache`` for ``batch`` rows of up to ``max_length`` positions."""
  return V4Cache(tuple(V4Attention.empty_cache(lc.attention, batch, max_length, dtype)
                       for lc in layer_configs(cfg)))


def grow_v4_cache(cfg: Any, cache: V4Cache, n: int) -> V4Cache:
  """``cache`` with room for ``n`` more positions: ``ceil(n / m)`` zero entry rows appended
  to every compressor state (the rings have a fixed size)."""
  def grow(state, c: CompressorConfig | None):
    if state is None:
      return None
    rows = -(-n // c.compress_rate)
    return state._replace(entries=jnp.pad(state.entries, ((0, 0), (0, rows), (0, 0))))
  layers = []
  for layer, lc in zip(cache.layers, layer_configs(cfg)):
    a = lc.attention
    layers.append(layer._replace(
        compressor=grow(layer.compressor, a.compressor),
        indexer=grow(layer.indexer, None if a.indexer is None else a.indexer.compressor)))
  return V4Cache(tuple(layers))


class V4Decoder(nn.Module):
  """``Decoder``'s call for a ``ModelConfig`` with ``v4`` set.

  Same arguments as ``opd.models.decoder.Decoder.__call__`` (``segment_ids`` is
  refused: a packed row would share compressed windows across documents) with
  a ``V4Cache`` as ``cache``. Returns the fields of ``DecoderOutput`` in order:
  ``(logits, hidden, values, cache, moe)``; ``moe`` stacks every layer's
  ``RouterStats`` (hash-routed layers too: their router weights are trained).
  """
  cfg: Any

  @nn.compact
  def __call__(self, tokens: Array, positions: Array | None = None, mask: Array | None = None,
               cache: V4Cache | None = None, *, segment_ids: Array | None = None,
               return_logits: bool = True, return_hidden: bool = False):
    cfg = self.cfg
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    D, N, V = cfg.d_model, cfg.v4.n_streams, cfg.vocab_size
    if tokens.ndim != 2:
      raise ValueError(f"V4Decoder: tokens must be [B, T], got {tokens.shape=}")
    if segment_ids is not None:
      raise ValueError("segment_ids (packed rows) are not supported with ModelConfig.v4: "
                       "compressed windows would mix documents")
    B, T = tokens.shape
    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    if positions is None:
      if cache is not None:
        raise ValueError("positions must be given when decoding with a cache")
      positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
    emb = param(self, "embedding", (V, D), ("vocab", "embed"), pdt)
    x = jnp.take(emb, tokens, axis=0).astype(dt)
    h = jnp.broadcast_to(x[:, :, None], (B, T, N, D))
    layer_cls = nn.remat(V4DecoderLayer) if cfg.remat else V4DecoderLayer
    stats, caches = [], []
    for i, lc in enumerate(layer_configs(cfg)):
      h, routing, layer_cache = layer_cls(lc, name=f"layers_{i}")(
          h, positions, tokens, mask, None if cache is None else cache.layers[i])
      stats.append(router_stats(cfg.moe, routing, mask, jnp.zeros((), jnp.int32)))
      caches.append(layer_cache)
    hidden = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(
        HyperHead(layer_configs(cfg)[0].hyper, name="hc_head")(h))
    logits = values = None
    if return_logits:
      head = emb.T if cfg.tie_embeddings else param(self, "lm_head", (D, V), ("embed", "vocab"),
                                                    pdt)
      logits = jnp.einsum("BTD,DV->BTV", hidden, head.astype(dt),
                          preferred_element_type=jnp.float32)
    if cfg.scalar_head:
      w = param(self, "value_head", (D, 1), ("embed", "scalar"), pdt)
      b = param(self, "value_bias", (1,), ("scalar",), pdt)
      values = (jnp.einsum("BTD,DO->BTO", hidden, w.astype(dt),
                           preferred_element_type=jnp.float32) + b.astype(jnp.float32))[..., 0]
    new_cache = None if cache is None else V4Cache(tuple(caches))
    return (logits, hidden if return_hidden else None, values, new_cache, stack_stats(stats))
