"""DeepSeek-V4's KV compressors and the lightning indexer of compressed sparse
attention, stateless (training / scoring) path (docs/DESIGN.md §2,
"DeepSeek-V4 components").

**Compressor.** Every m tokens (``compress_rate``) become one compressed entry
of width C. From ``c_t = x_t W_kv`` and gate ``z_t = x_t W_z`` (with a learnt
per-slot ``position_bias [m, ·]`` added to z), entry w is, channel by
channel, a softmax-weighted sum over its slots:

* HCA (``overlap=False``, m' = 128 in V4): the m tokens of window w,
  ``e_w = Σ_{j∈w} softmax_j(z_j + B_j) ⊙ c_j`` (W_kv, W_z: ``[D, C]``);
* CSA (``overlap=True``, m = 4): W_kv, W_z are ``[D, 2C]``, each token holding
  two series (a, b); entry w mixes the a-halves of window w - 1 with the
  b-halves of window w over 2m slots (window -1 has none), so entries
  overlap by m tokens.

Then ``e_w ← RoPE(RMSNorm(e_w))`` at position ``w·m`` (interleaved RoPE on the
last Dr dims, base ``compress_rope_theta``). Only complete windows are
emitted: ``T // m`` entries. Query t may see entry w iff ``w < (t + 1) // m``
(the whole window is in its past).

**Lightning indexer** (CSA only). It runs its own overlapping compressor at
width c^I (``index_head_dim``), queries ``q_{t,h} = RoPE_t(q_res_t W_q^I)``
(``q_res`` is the attention's normalised low-rank query, n_h^I heads) and
scores ``I_{t,s} = Σ_h w_{t,h} ReLU(q_{t,h} · k_s) / sqrt(c^I)`` with
``w_t = x_t W_w / sqrt(n_h^I)``. Per query it keeps the top
``k = min(index_topk, T // m)`` entries among the visible ones (best first;
ties to the lower index); a slot left without a visible entry holds -1.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.config.fields import check_fields
from opd.models.layers import RMSNorm, param
from opd.models.v4.rope import rope_tail

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class CompressorConfig:
  """One compressor (transformers' ``DeepseekV4Config`` field in brackets).

  Attributes:
    d_model: D (``hidden_size``).
    width: C, an entry's width (``head_dim``; ``index_head_dim`` for the indexer's).
    compress_rate: m (``compress_rates[layer_type]``).
    overlap: True for CSA's overlapping windows, False for HCA's.
    rope_dim: Dr (``qk_rope_head_dim``); <= width.
    rope_theta: ``compress_rope_theta`` (YaRN scaling is not built yet).
    norm_eps: ``rms_norm_eps``.
  """
  d_model: int
  width: int
  compress_rate: int
  overlap: bool
  rope_dim: int
  rope_theta: float = 160000.0
  norm_eps: float = 1e-6

  def __post_init__(self):
    check_fields(self, "CompressorConfig",
                 ints={"d_model": 1, "width": 1, "compress_rate": 1, "rope_dim": 0},
                 positive=("rope_theta", "norm_eps"), bools=("overlap",))
    if self.rope_dim % 2 or self.rope_dim > self.width:
      raise ValueError(f"CompressorConfig.rope_dim={self.rope_dim} must be even and "
                       f"<= width={self.width}")


class Compressor(nn.Module):
  """``x [B, T, D] -> entries [B, T // m, C]``; see the module docstring.

  Params: ``kv, gate [D, C·(2 if overlap else 1)]``, ``position_bias [m, same]``,
  ``kv_norm/scale [C]``.
  """
  cfg: CompressorConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.cfg
    D, C, m = cfg.d_model, cfg.width, cfg.compress_rate
    if x.ndim != 3 or x.shape[-1] != D:
      raise ValueError(f"Compressor: x must be [B, T, d_model={D}], got {x.shape=}")
    Cw = 2 * C if cfg.overlap else C
    f32 = jnp.float32
    wkv = param(self, "kv", (D, Cw), ("embed", None), f32)
    wz = param(self, "gate", (D, Cw), ("embed", None), f32)
    pos_bias = param(self, "position_bias", (m, Cw), (None, None), f32)
    B, T, _ = x.shape
    n = T // m
    xs = x[:, :n * m].astype(f32)
    c = (xs @ wkv).reshape(B, n, m, Cw)
    z = (xs @ wz).reshape(B, n, m, Cw) + pos_bias
    if cfg.overlap:  # slots: a-halves of window w - 1, then b-halves of window w
      shift = lambda a, fill: jnp.concatenate(
          [jnp.full_like(a[:, :1, :, :C], fill), a[:, :-1, :, :C]], axis=1)
      c = jnp.concatenate([shift(c, 0.0), c[..., C:]], axis=2)  # [B, n, 2m, C]
      z = jnp.concatenate([shift(z, -jnp.inf), z[..., C:]], axis=2)
    e = jnp.sum(c * jax.nn.softmax(z, axis=2), axis=2)  # [B, n, C]
    e = RMSNorm(cfg.norm_eps, f32, f32, name="kv_norm")(e)
    positions = jnp.broadcast_to(jnp.arange(n) * m, (B, n))
    e = rope_tail(e[:, :, None], positions, cfg.rope_dim, cfg.rope_theta)[:, :, 0]
    return e.astype(x.dtype)


def visible_entries(positions: Array, n: int, m: int) -> Array:
  """``[B, T, n]`` bool: entry w is visible to the query at position p iff ``w < (p + 1) // m``."""
  return jnp.arange(n) < ((positions + 1) // m)[..., None]


def indexer_topk(scores: Array, positions: Array, m: int, k: int) -> Array:
  """Top-k visible entries per query: ``scores [B, T, n]`` -> ``[B, T, min(k, n)]`` int32.

  Best first, ties to the lower index (``lax.top_k``); a slot whose pick is
  not visible (fewer than k visible entries) holds -1.
  """
  n = scores.shape[-1]
  vis = visible_entries(positions, n, m)
  top = jax.lax.top_k(jnp.where(vis, scores, -jnp.inf), min(k, n))[1]
  return jnp.where(jnp.take_along_axis(vis, top, axis=-1), top, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  """The lightning indexer (transformers' ``DeepseekV4Config`` field in brackets).

  Attributes:
    compressor: its own overlapping compressor, ``width`` = c^I (``index_head_dim``).
    q_lora_rank: Cq, width of the attention's low-rank query it reads (``q_lora_rank``).
    n_heads: n_h^I (``index_n_heads``).
    topk: entries kept per query (``index_topk``).
  """
  compressor: CompressorConfig
  q_lora_rank: int
  n_heads: int
  topk: int

  def __post_init__(self):
    check_fields(self, "IndexerConfig", ints={"q_lora_rank": 1, "n_heads": 1, "topk": 1})
    if not self.compressor.overlap:
      raise ValueError("IndexerConfig.compressor.overlap must be True (CSA's windows)")


class LightningIndexer(nn.Module):
  """``(x [B, T, D], q_res [B, T, Cq], positions [B, T]) -> (indices [B, T, k], scores [B, T, n])``.

  Params: ``compressor/...`` (``Compressor``), ``q [Cq, n_h^I, c^I]``, ``weights [D, n_h^I]``.
  """
  cfg: IndexerConfig

  @nn.compact
  def __call__(self, x: Array, q_res: Array, positions: Array):
    cfg, cc = self.cfg, self.cfg.compressor
    if q_res.shape != (*x.shape[:2], cfg.q_lora_rank):
      raise ValueError(f"LightningIndexer: {q_res.shape=} must be "
                       f"{(*x.shape[:2], cfg.q_lora_rank)} (q_lora_rank)")
    f32 = jnp.float32
    keys = Compressor(cc, name="compressor")(x).astype(f32)  # [B, n, cI]
    wq = param(self, "q", (cfg.q_lora_rank, cfg.n_heads, cc.width), ("latent", None, None), f32)
    ww = param(self, "weights", (cc.d_model, cfg.n_heads), ("embed", None), f32)
    q = jnp.einsum("BTC,CHI->BTHI", q_res.astype(f32), wq)
    q = rope_tail(q, positions, cc.rope_dim, cc.rope_theta)
    w = (x.astype(f32) @ ww) * cfg.n_heads ** -0.5  # [B, T, nI]
    dots = jax.nn.relu(jnp.einsum("BTHI,BSI->BTHS", q, keys)) * cc.width ** -0.5
    scores = jnp.einsum("BTHS,BTH->BTS", dots, w)
    return indexer_topk(scores, positions, cc.compress_rate, cfg.topk), scores
