"""DeepSeek-V4's KV compressors and the lightning indexer of compressed sparse
attention, for a whole sequence or a chunk appended to the decode state
(``opd.models.v4.cache``) (docs/DESIGN.md §2, "DeepSeek-V4").

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
last Dr dims, base ``compress_rope_theta``). Windows are addressed by
position (window w holds positions ``[w·m, (w+1)·m)``); only complete windows
are visible: the query at position p may see entry w iff ``w < (p + 1) // m``
(the whole window is in its past).

**Lightning indexer** (CSA only). It runs its own overlapping compressor at
width c^I (``index_head_dim``), queries ``q_{t,h} = RoPE_t(q_res_t W_q^I)``
(``q_res`` is the attention's normalised low-rank query, n_h^I heads) and
scores ``I_{t,s} = Σ_h w_{t,h} ReLU(q_{t,h} · k_s) / sqrt(c^I)`` with
``w_t = x_t W_w / sqrt(n_h^I)``. Per query it keeps the top
``k = min(index_topk, n)`` entries (n: the key rows) among the visible ones (best first;
ties to the lower index); a slot left without a visible entry holds -1.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.config.fields import check_fields
from opd.models.layers import RMSNorm, param
from opd.models.v4.cache import CompressorState, empty_ring, ring_write
from opd.models.v4.config import V4YaRN
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
    rope_theta: ``compress_rope_theta``.
    norm_eps: ``rms_norm_eps``.
    yarn: YaRN of the compressed branches (``rope_parameters["compress"]``), None = plain.
  """
  d_model: int
  width: int
  compress_rate: int
  overlap: bool
  rope_dim: int
  rope_theta: float = 160000.0
  norm_eps: float = 1e-6
  yarn: V4YaRN | None = None

  def __post_init__(self):
    check_fields(self, "CompressorConfig",
                 ints={"d_model": 1, "width": 1, "compress_rate": 1, "rope_dim": 0},
                 positive=("rope_theta", "norm_eps"), bools=("overlap",))
    if self.rope_dim % 2 or self.rope_dim > self.width:
      raise ValueError(f"CompressorConfig.rope_dim={self.rope_dim} must be even and "
                       f"<= width={self.width}")


class CompressedKeys(NamedTuple):
  """A compressor's entries as attention keys.

  Attributes:
    keys: ``[B, n, C]``; ids: ``[B, n]`` int32 window index w of each row;
    valid: ``[B, n]`` bool, the row holds a complete window's entry.
  """
  keys: Array
  ids: Array
  valid: Array

  def visible(self, positions: Array, m: int) -> Array:
    """``[B, T, n]`` bool: entry w is visible at position p iff valid and ``w < (p + 1) // m``."""
    return self.valid[:, None, :] & (self.ids[:, None, :] < ((positions + 1) // m)[..., None])


class Compressor(nn.Module):
  """``(x [B, T, D], positions [B, T], mask [B, T] | None, state | None) -> (CompressedKeys, state)``.

  Windows are addressed by position: window w holds positions ``[w·m, (w+1)·m)``,
  so a left-padded row (positions from its first real token) compresses as
  the unpadded one; each row's real tokens must have consecutive positions.
  Without ``state`` the keys are the ``T // m + 1`` windows that end in the
  chunk (one per row of ``ids``, incomplete ones not ``valid``). With a
  ``CompressorState`` the window's slots are looked up in the chunk and in the
  state's ring, the windows completed by the chunk are written to
  ``state.entries`` and the keys are all its rows (``ids = 0..S//m-1``).

  Params: ``kv, gate [D, C·(2 if overlap else 1)]``, ``position_bias [m, same]``,
  ``kv_norm/scale [C]``.
  """
  cfg: CompressorConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array | None = None,
               state: CompressorState | None = None):
    cfg = self.cfg
    D, C, m = cfg.d_model, cfg.width, cfg.compress_rate
    if x.ndim != 3 or x.shape[-1] != D:
      raise ValueError(f"Compressor: x must be [B, T, d_model={D}], got {x.shape=}")
    if positions.shape != x.shape[:2]:
      raise ValueError(f"Compressor: {positions.shape=} must be {x.shape[:2]}")
    Cw = 2 * C if cfg.overlap else C
    f32 = jnp.float32
    wkv = param(self, "kv", (D, Cw), ("embed", None), f32)
    wz = param(self, "gate", (D, Cw), ("embed", None), f32)
    pos_bias = param(self, "position_bias", (m, Cw), (None, None), f32)
    B, T, _ = x.shape
    valid = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    xs = x.astype(f32)
    c, z = xs @ wkv.astype(f32), xs @ wz.astype(f32)  # [B, T, Cw]
    # The windows that end in this chunk: w >= ceil((p0 + 1) / m) - 1, at most T // m + 1.
    J, S = T // m + 1, (2 * m if cfg.overlap else m)
    first = jnp.argmax(valid, axis=1)  # [B] index of the first real token
    p0 = jnp.take_along_axis(positions, first[:, None], axis=1)[:, 0]
    ids = ((p0 + m) // m - 1)[:, None] + jnp.arange(J)  # [B, J]
    # Slot s of window w holds position w·m + s (CSA: (w-1)·m + s, the a-halves first).
    want = ids[..., None] * m - (m if cfg.overlap else 0) + jnp.arange(S)  # [B, J, S]
    idx = want - p0[:, None, None] + first[:, None, None]
    flat = jnp.clip(idx, 0, T - 1).reshape(B, J * S)
    at = lambda a: jnp.take_along_axis(a, flat, axis=1).reshape(B, J, S)
    rows = lambda a: jnp.take_along_axis(a, flat[..., None], axis=1).reshape(B, J, S, -1)
    found = (idx >= 0) & (idx < T) & at(valid) & (at(positions) == want)
    cv, zv = rows(c), rows(z)
    if state is not None:
      R = state.pos.shape[1]
      slot = (want % R).reshape(B, J * S)
      ring = lambda a: jnp.take_along_axis(a, slot[..., None], axis=1).reshape(B, J, S, -1)
      in_ring = ~found & (want >= 0) & (
          jnp.take_along_axis(state.pos, slot, axis=1).reshape(B, J, S) == want)
      cv = jnp.where(in_ring[..., None], ring(state.c), cv)
      zv = jnp.where(in_ring[..., None], ring(state.z), zv)
      found = found | in_ring
    zv = zv + pos_bias[want % m]
    if cfg.overlap:  # a-halves from window w - 1, b-halves from window w
      cv = jnp.concatenate([cv[:, :, :m, :C], cv[:, :, m:, C:]], axis=2)  # [B, J, 2m, C]
      zv = jnp.concatenate([zv[:, :, :m, :C], zv[:, :, m:, C:]], axis=2)
    zv = jnp.where(found[..., None], zv, -jnp.inf)
    # A window with no slot found is never used; zero logits keep its softmax (and grads) finite.
    zv = jnp.where(jnp.any(found, axis=-1)[..., None, None], zv, 0.0)
    complete = jnp.all(found[..., -m:], axis=-1) & jnp.any(valid, axis=1)[:, None]
    e = jnp.sum(cv * jax.nn.softmax(zv, axis=2), axis=2)  # [B, J, C]
    e = RMSNorm(cfg.norm_eps, f32, f32, name="kv_norm")(e)
    e = rope_tail(e[:, :, None], ids * m, cfg.rope_dim, cfg.rope_theta,
                yarn=cfg.yarn)[:, :, 0].astype(x.dtype)
    if state is None:
      return CompressedKeys(e, ids.astype(jnp.int32), complete), None
    cz, pos = ring_write(jnp.concatenate([state.c, state.z], axis=-1), state.pos,
                         jnp.concatenate([c, z], axis=-1), positions, valid)
    n = state.entries.shape[1]
    b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, J))
    entries = state.entries.at[b, jnp.where(complete, ids, n)].set(
        e.astype(state.entries.dtype), mode="drop")
    new = CompressorState(c=cz[..., :Cw], z=cz[..., Cw:], pos=pos, entries=entries)
    keys = CompressedKeys(entries.astype(x.dtype), jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32),
                                                                    (B, n)),
                          jnp.ones((B, n), bool))
    return keys, new

  @staticmethod
  def empty_state(cfg: CompressorConfig, batch: int, max_length: int, dtype) -> CompressorState:
    """The state of a compressor before any token: empty ring, ``max_length // m`` zero entries."""
    m = cfg.compress_rate
    Cw = 2 * cfg.width if cfg.overlap else cfg.width
    R = 2 * m if cfg.overlap else m
    c, pos = empty_ring(batch, R, Cw, jnp.float32)
    return CompressorState(c=c, z=c, pos=pos,
                           entries=jnp.zeros((batch, max_length // m, cfg.width), dtype))


def indexer_topk(scores: Array, visible: Array, k: int) -> Array:
  """Top-k visible entries per query: ``scores, visible [B, T, n]`` -> ``[B, T, min(k, n)]`` int32.

  Best first, ties to the lower index (``lax.top_k``); a slot whose pick is
  not visible (fewer than k visible entries) holds -1.
  """
  n = scores.shape[-1]
  top = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(k, n))[1]
  return jnp.where(jnp.take_along_axis(visible, top, axis=-1), top, -1).astype(jnp.int32)


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
  """``(x [B, T, D], q_res [B, T, Cq], positions [B, T], mask, state) -> (picks, scores, state)``.

  ``scores [B, T, n]`` over the rows of its compressor's keys (the same rows as
  the attention compressor's, see ``Compressor``), ``picks [B, T, min(k, n)]``
  their top-k visible rows (-1 = none), ``state`` the indexer compressor's.

  Params: ``compressor/...`` (``Compressor``), ``q [Cq, n_h^I, c^I]``, ``weights [D, n_h^I]``.
  """
  cfg: IndexerConfig

  @nn.compact
  def __call__(self, x: Array, q_res: Array, positions: Array, mask: Array | None = None,
               state: CompressorState | None = None):
    cfg, cc = self.cfg, self.cfg.compressor
    if q_res.shape != (*x.shape[:2], cfg.q_lora_rank):
      raise ValueError(f"LightningIndexer: {q_res.shape=} must be "
                       f"{(*x.shape[:2], cfg.q_lora_rank)} (q_lora_rank)")
    f32 = jnp.float32
    keys, state = Compressor(cc, name="compressor")(x, positions, mask, state)
    wq = param(self, "q", (cfg.q_lora_rank, cfg.n_heads, cc.width), ("latent", None, None), f32)
    ww = param(self, "weights", (cc.d_model, cfg.n_heads), ("embed", None), f32)
    q = jnp.einsum("BTC,CHI->BTHI", q_res.astype(f32), wq.astype(f32))
    q = rope_tail(q, positions, cc.rope_dim, cc.rope_theta, yarn=cc.yarn)
    w = (x.astype(f32) @ ww.astype(f32)) * cfg.n_heads ** -0.5  # [B, T, nI]
    dots = jax.nn.relu(jnp.einsum("BTHI,BSI->BTHS", q, keys.keys.astype(f32))) * cc.width ** -0.5
    scores = jnp.einsum("BTHS,BTH->BTS", dots, w)
    picks = indexer_topk(scores, keys.visible(positions, cc.compress_rate), cfg.topk)
    return picks, scores, state
