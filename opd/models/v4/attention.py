"""DeepSeek-V4 attention: sliding-window attention with attention sinks and the grouped
low-rank output projection, plus the compressed entries of CSA / HCA layers
(docs/DESIGN.md §2, "DeepSeek-V4").

Shared-KV multi-query attention: per token ``x [D]``, with H heads of width
Dh, RoPE on the last Dr dims of each head (interleaved pairs), Cq =
``q_lora_rank``, G output groups of rank R:

  q_h = RoPE(UnitRMSNorm_h(RMSNorm(x W_qa) W_qb))        [H, Dh]
  kv  = RoPE(RMSNorm(x W_kv))                            [Dh]  (one head, key = value)
  p_hts = softmax over {s in window(t)} ∪ {sink} of (q_ht · kv_s / sqrt(Dh), sink_h)
  o_ht = RoPE⁻¹_t(Σ_s p_hts kv_s)                        (the sink's share is dropped)
  y_t  = Σ_g (o_{t, heads of g} W_oa_g) W_ob_g            (g = 1..G: [H/G · Dh] -> [R] -> [D])

``window(t)`` is the keys at positions ``p_t - W < p_s <= p_t`` (W =
``sliding_window``) that the padding mask keeps. The sink is one learnt logit per head that absorbs
probability mass, so a query may attend to nothing. Because the values carry
the keys' rotation, the output's rope dims are rotated back by the query's
angle (RoPE⁻¹, the rotation by ``-pos``), leaving a function of ``t - s``.

Compressed layers (``opd.models.v4.compressor``) append the compressed
entries ``e_w`` to the window's keys (= values): HCA
(``heavily_compressed_attention``) lets query t see every entry
``w < (t + 1) // m``, CSA (``compressed_sparse_attention``) only the ones its
lightning indexer selects. Their RoPE base is ``compress_rope_theta``. The
compression windows are addressed by position, so rows may be left- or
right-padded. Decoding keeps a ``V4LayerCache`` (``opd.models.v4.cache``).

Params: ``q_a [D, Cq]``, ``q_a_norm/scale [Cq]``, ``q_b [Cq, H, Dh]``,
``kv [D, Dh]``, ``kv_norm/scale [Dh]``, ``sink_bias [H]`` (zeros at init,
HF ``sinks``), ``o_a [G, H/G · Dh, R]``, ``o_b [G, R, D]``; compressed
layers add ``compressor/...`` and CSA ``indexer/...``.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.config.fields import check_fields
from opd.models.layers import RMSNorm, param
from opd.models.v4.cache import V4LayerCache, empty_ring, ring_write
from opd.models.v4.compressor import Compressor, CompressorConfig, IndexerConfig, LightningIndexer
from opd.models.v4.config import V4YaRN
from opd.models.v4.hyper import unit_rms_norm
from opd.models.v4.rope import rope_tail

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class V4AttentionConfig:
  """Sliding-window attention (transformers' ``DeepseekV4Config`` field in brackets).

  Attributes:
    d_model: D (``hidden_size``).
    n_heads: H (``num_attention_heads``; one shared key/value head).
    head_dim: Dh (``head_dim``).
    q_lora_rank: Cq, the query's low-rank width (``q_lora_rank``).
    rope_dim: Dr, the trailing dims of a head that get RoPE
      (``qk_rope_head_dim = head_dim · partial_rotary_factor``).
    rope_theta: RoPE base of sliding-window layers (``rope_parameters["main"]``).
    sliding_window: W, keys per query including itself (``sliding_window``).
    o_groups: G, head groups of the output projection (``o_groups``).
    o_lora_rank: R, each group's intermediate width (``o_lora_rank``).
    norm_eps: every RMSNorm's epsilon (``rms_norm_eps``).
    compressor: None for ``sliding_attention``; the layer's compressor
      (width = head_dim) for CSA / HCA (``layer_types[i]``, ``compress_rates``).
    indexer: CSA's lightning indexer (None for sliding and HCA layers).
    yarn: YaRN of a compressed layer's RoPE (``rope_parameters["compress"]``; the
      same as its compressors'), None = plain RoPE.
  """
  d_model: int
  n_heads: int
  head_dim: int
  q_lora_rank: int
  rope_dim: int
  rope_theta: float = 10000.0
  sliding_window: int = 128
  o_groups: int = 8
  o_lora_rank: int = 1024
  norm_eps: float = 1e-6
  compressor: CompressorConfig | None = None
  indexer: IndexerConfig | None = None
  yarn: V4YaRN | None = None

  def __post_init__(self):
    check_fields(self, "V4AttentionConfig",
                 ints={"d_model": 1, "n_heads": 1, "head_dim": 1, "q_lora_rank": 1,
                       "rope_dim": 0, "sliding_window": 1, "o_groups": 1, "o_lora_rank": 1},
                 positive=("rope_theta", "norm_eps"))
    if self.rope_dim % 2 or self.rope_dim > self.head_dim:
      raise ValueError(f"V4AttentionConfig.rope_dim={self.rope_dim} must be even and "
                       f"<= head_dim={self.head_dim}")
    if self.n_heads % self.o_groups:
      raise ValueError(f"V4AttentionConfig.n_heads={self.n_heads} is not divisible by "
                       f"o_groups={self.o_groups}")
    c, ix = self.compressor, self.indexer
    if c is not None and (c.width, c.d_model) != (self.head_dim, self.d_model):
      raise ValueError(f"V4AttentionConfig.compressor width={c.width}, d_model={c.d_model} "
                       f"must equal head_dim={self.head_dim}, d_model={self.d_model}")
    if ix is not None and (c is None or not c.overlap):
      raise ValueError("V4AttentionConfig.indexer needs an overlapping (CSA) compressor, got "
                       f"compressor={c}")
    for name, sub in (("compressor", c), ("indexer.compressor", ix and ix.compressor)):
      if sub is not None and sub.yarn != self.yarn:
        raise ValueError(f"V4AttentionConfig.{name}.yarn={sub.yarn} must equal the layer's "
                         f"yarn={self.yarn} (one compress RoPE per layer)")
    if c is None and self.yarn is not None:
      raise ValueError("V4AttentionConfig.yarn is for compressed layers (rope_parameters"
                       f"['compress']); a sliding layer got {self.yarn}")
    if c is not None and c.overlap and ix is None:
      raise ValueError("V4AttentionConfig: an overlapping (CSA) compressor needs an indexer")
    if ix is not None and (ix.q_lora_rank, ix.compressor.compress_rate) != (
        self.q_lora_rank, c.compress_rate):
      raise ValueError(f"V4AttentionConfig.indexer q_lora_rank={ix.q_lora_rank}, "
                       f"compress_rate={ix.compressor.compress_rate} must equal the layer's "
                       f"{self.q_lora_rank}, {c.compress_rate}")

  @property
  def layer_type(self) -> str:
    """transformers' ``layer_types`` entry this config describes."""
    if self.compressor is None:
      return "sliding_attention"
    return "compressed_sparse_attention" if self.indexer else "heavily_compressed_attention"


def window_keep(q_pos: Array, k_pos: Array, k_valid: Array, window: int) -> Array:
  """``[B, T, S]`` bool: key s is visible to query t iff valid and ``p_t - W < p_s <= p_t``.

  Args:
    q_pos: ``[B, T]`` query positions; k_pos, k_valid: ``[B, S]`` key positions and validity.
  """
  qp, kp = q_pos[:, :, None], k_pos[:, None, :]
  return k_valid[:, None, :] & (kp <= qp) & (kp > qp - window)


def sink_attention(q: Array, kv: Array, keep: Array, sinks: Array, scale: float) -> Array:
  """Softmax attention with one extra per-head sink logit whose share is dropped.

  Args:
    q: ``[B, T, H, Dh]``; kv: ``[B, S, Dh]`` the shared key = value head.
    keep: ``[B or 1, T, S]`` bool visibility; sinks: ``[H]`` logits.

  Returns:
    ``[B, T, H, Dh]`` = Σ_s p_hts kv_s with p over the visible keys and the sink.
  """
  logits = jnp.einsum("BTHD,BSD->BHTS", q, kv, preferred_element_type=jnp.float32) * scale
  logits = jnp.where(keep[:, None], logits, -jnp.inf)
  sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (*logits.shape[:3], 1))
  probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("BHTS,BSD->BTHD", probs.astype(kv.dtype), kv)


class V4Attention(nn.Module):
  """``(x [B, T, D], positions [B, T], mask [B, T] | None, cache | None) -> (y [B, T, D], cache)``.

  One class for the three layer types (``cfg.layer_type``); see the module
  docstring. ``mask`` (True = real token) hides padded keys; a query with no
  visible key puts all its mass on the sink and returns zeros. Windows and
  compressed entries follow the positions, so a row may be padded on either
  side. With a ``V4LayerCache`` the keys are its ring (the last W positions)
  and the chunk's, the compressed entries those of its compressor state, and
  the returned cache holds the chunk too; without one the returned cache is None.
  """
  cfg: V4AttentionConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array | None = None,
               cache: V4LayerCache | None = None):
    cfg = self.cfg
    D, H, Dh, Cq = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    G, R = cfg.o_groups, cfg.o_lora_rank
    if x.ndim != 3 or x.shape[-1] != D:
      raise ValueError(f"V4Attention: x must be [B, T, d_model={D}], got {x.shape=}")
    if positions.shape != x.shape[:2]:
      raise ValueError(f"V4Attention: {positions.shape=} must be {x.shape[:2]}")
    B, T, _ = x.shape
    dt, f32 = x.dtype, jnp.float32
    valid = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    norm = lambda name: RMSNorm(cfg.norm_eps, dt, f32, name=name)
    wqa = param(self, "q_a", (D, Cq), ("embed", "latent"), f32)
    wqb = param(self, "q_b", (Cq, H, Dh), ("latent", "q_heads", "head_dim"), f32)
    wkv = param(self, "kv", (D, Dh), ("embed", "head_dim"), f32)
    sinks = param(self, "sink_bias", (H,), ("q_heads",), f32)
    woa = param(self, "o_a", (G, H // G * Dh, R), (None, "q_heads", None), f32)
    wob = param(self, "o_b", (G, R, D), (None, None, "embed"), f32)

    q_res = norm("q_a_norm")(x @ wqa.astype(dt))  # [B, T, Cq]
    q = jnp.einsum("BTC,CHD->BTHD", q_res, wqb.astype(dt))
    q = unit_rms_norm(q, cfg.norm_eps).astype(dt)
    q = rope_tail(q, positions, cfg.rope_dim, cfg.rope_theta, yarn=cfg.yarn)
    kv = norm("kv_norm")(x @ wkv.astype(dt))  # [B, T, Dh]
    kv = rope_tail(kv[:, :, None], positions, cfg.rope_dim, cfg.rope_theta,
                   yarn=cfg.yarn)[:, :, 0]
    keys, key_pos, key_valid = kv, positions, valid
    new = None
    if cache is not None:  # the ring's last W positions before the chunk's own keys
      keys = jnp.concatenate([cache.kv.astype(dt), kv], axis=1)
      key_pos = jnp.concatenate([cache.kv_pos, positions], axis=1)
      key_valid = jnp.concatenate([cache.kv_pos >= 0, valid], axis=1)
      ring, ring_pos = ring_write(cache.kv, cache.kv_pos, kv, positions, valid)
      new = V4LayerCache(kv=ring, kv_pos=ring_pos)
    keep = window_keep(positions, key_pos, key_valid, cfg.sliding_window)
    if cfg.compressor is not None:
      state = lambda name: None if cache is None else getattr(cache, name)
      entries, c_state = Compressor(cfg.compressor, name="compressor")(
          x, positions, mask, state("compressor"))  # keys [B, n, Dh]
      m, n = cfg.compressor.compress_rate, entries.keys.shape[1]
      if cfg.indexer is None:  # HCA: every complete past window
        seen = entries.visible(positions, m)
        i_state = None
      else:  # CSA: the indexer's picks (-1 = none) among the same rows
        picks, _, i_state = LightningIndexer(cfg.indexer, name="indexer")(
            x, q_res, positions, mask, state("indexer"))
        seen = jnp.any(picks[..., None] == jnp.arange(n), axis=-2)  # [B, T, n]
      keys = jnp.concatenate([keys, entries.keys.astype(dt)], axis=1)
      keep = jnp.concatenate([keep, seen], axis=-1)
      if new is not None:
        new = new._replace(compressor=c_state, indexer=i_state)
    o = sink_attention(q, keys, keep, sinks, Dh ** -0.5)  # [B, T, H, Dh]
    o = rope_tail(o, positions, cfg.rope_dim, cfg.rope_theta, inverse=True, yarn=cfg.yarn)
    o = o.reshape(B, T, G, H // G * Dh)
    z = jnp.einsum("BTGI,GIR->BTGR", o, woa.astype(dt))
    return jnp.einsum("BTGR,GRD->BTD", z, wob.astype(dt)), new

  @staticmethod
  def empty_cache(cfg: V4AttentionConfig, batch: int, max_length: int, dtype) -> V4LayerCache:
    """The layer's cache before any token (``max_length``: the longest sequence it will hold)."""
    kv, kv_pos = empty_ring(batch, cfg.sliding_window, cfg.head_dim, dtype)
    empty = lambda c: None if c is None else Compressor.empty_state(c, batch, max_length, dtype)
    return V4LayerCache(kv=kv, kv_pos=kv_pos, compressor=empty(cfg.compressor),
                        indexer=empty(None if cfg.indexer is None else cfg.indexer.compressor))
