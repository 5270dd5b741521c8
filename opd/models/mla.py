"""Multi-head latent attention, MLA (DeepSeek-V2/V3; docs/DESIGN.md §2).

Per token, the keys and values of all H heads come from one compressed
latent ``c = RMSNorm(x W_DKV)`` of width C (``kv_lora_rank``) plus one RoPE
key ``k_r = RoPE(x W_KR)`` of width Dr shared by every head:

  k_h = [c W_UK_h ; k_r]        v_h = c W_UV_h
  q_h = [q_nope_h ; RoPE(q_rope_h)]   (q from x directly, or from a compressed
                                       query RMSNorm(x W_DQ) when q_lora_rank)
  o   = sum_h softmax(q_h . k_h / sqrt(Dn + Dr)) v_h W_O_h

Without a cache (training, scoring) the keys and values are expanded per head
(the plain form). With a cache (the sampler) only ``c`` and ``k_r`` are
stored, ``C + Dr`` values per token and layer, and the up-projections are
absorbed: ``q_h . k_h = (q_nope_h W_UK_h^T) . c + q_rope_h . k_r`` and
``softmax(.) v_h = (softmax(.) c) W_UV_h``, so attention runs in the latent
space and nothing per head is ever cached. The two forms are the same
function up to float rounding (tests/opd/models/test_mla.py).

RoPE covers the Dr dims only, in DeepSeek's interleaved layout when
``rope_interleave`` and with YaRN scaling when ``yarn`` (``mla_rope``,
``softmax_scale``).

Parameters (our layout; ``opd.models.hf_deepseek`` maps DeepSeek-V3's):
``q [D, H, Dn+Dr]`` or ``q_a [D, Cq]``, ``q_a_norm/scale [Cq]``,
``q_b [Cq, H, Dn+Dr]``; ``kv_a [D, C + Dr]`` (latent, then RoPE key),
``kv_a_norm/scale [C]``, ``kv_b [C, H, Dn + Dv]`` (W_UK, then W_UV),
``o [H, Dv, D]``.

The cache reuses ``KVCache``: ``k`` holds the latent ``[B, 1, S, C]`` and
``v`` the RoPE key ``[B, 1, S, Dr]`` (one "kv head"), so the sampler and the
prefill sharing handle both attention kinds with the same code.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opd.models.config import MLAConfig, ModelConfig, YaRNConfig
from opd.models.layers import RMSNorm, rope
from opd.models.layers import param as _param

# DeepSeek's q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _yarn_m(scale: float, coef: float) -> float:
  return 0.1 * coef * math.log(scale) + 1.0 if scale > 1 else 1.0


def yarn_frequencies(dr: int, theta: float, yarn: YaRNConfig) -> tuple[np.ndarray, float]:
  """YaRN's RoPE frequencies ``[Dr/2]`` (float32) and its cos/sin factor (YaRNConfig)."""
  s = yarn.factor
  base = theta ** (np.arange(0, dr, 2, dtype=np.float64) / dr)  # theta^(2i/Dr)
  # The dim whose wavelength completes `rotations` turns in the original context, clipped
  # to whole dims as transformers' default truncate=True.
  dim_of = lambda rotations: dr * math.log(
      yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))
  low = max(math.floor(dim_of(yarn.beta_fast)), 0)
  high = min(math.ceil(dim_of(yarn.beta_slow)), dr - 1)
  ramp = np.clip((np.arange(dr // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
  extrapolate = 1.0 - ramp  # 1: keep the frequency, 0: divide it by the factor
  inv_freq = (1.0 / base) * extrapolate + (1.0 / (s * base)) * (1.0 - extrapolate)
  if yarn.mscale and yarn.mscale_all_dim:
    factor = _yarn_m(s, yarn.mscale) / _yarn_m(s, yarn.mscale_all_dim)
  else:
    factor = _yarn_m(s, 1.0)
  return inv_freq.astype(np.float32), factor


def softmax_scale(m: MLAConfig) -> float:
  """``1 / sqrt(Dn + Dr)``, times YaRN's ``m(s, mscale_all_dim)²`` when set."""
  scale = m.qk_head_dim ** -0.5
  if m.yarn is not None and m.yarn.mscale_all_dim:
    scale *= _yarn_m(m.yarn.factor, m.yarn.mscale_all_dim) ** 2
  return scale


def mla_rope(x: jax.Array, positions: jax.Array, theta: float, m: MLAConfig) -> jax.Array:
  """RoPE over the last axis of ``x [B, T, N, Dr]``, with ``m``'s layout and scaling.

  ``m.rope_interleave``: the pairs are ``(x0, x1), (x2, x3), ...``
  (DeepSeek's layout). Rotating pair i by angle i equals rotate-half RoPE of
  the de-interleaved ``[x0, x2, ..., x1, x3, ...]``, which is also the layout
  of the output (as transformers' ``apply_rotary_pos_emb_interleave``);
  queries and keys share it, so their dot products are unchanged.
  ``m.yarn``: YaRN frequencies, and cos / sin scaled (``yarn_frequencies``).
  """
  if m.rope_interleave:
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  if m.yarn is None:
    return rope(x, positions, theta)
  inv_freq, factor = yarn_frequencies(x.shape[-1], theta, m.yarn)
  out = rope(x, positions, theta, inv_freq=jnp.asarray(inv_freq))
  return out if factor == 1.0 else (out.astype(jnp.float32) * factor).astype(x.dtype)


def cache_values_per_token(cfg: ModelConfig) -> int:
  """Values one token adds to the decode cache, summed over layers.

  MLA: ``C + Dr`` per layer (latent and shared RoPE key); GQA: ``2 K Dh``.
  Multiply by the cache dtype's itemsize for bytes.
  """
  if cfg.mla is not None:
    per_layer = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  else:
    per_layer = 2 * cfg.n_kv_heads * cfg.resolved_head_dim
  return cfg.n_layers * per_layer


def cache_bytes_per_token(cfg: ModelConfig, dtype=None) -> int:
  """Bytes one token adds to the decode cache (``init_cache``'s dtype by default)."""
  return cache_values_per_token(cfg) * jnp.dtype(dtype or cfg.compute_dtype).itemsize


class MLAttention(nn.Module):
  """Drop-in for ``decoder.Attention`` when ``cfg.mla`` is set (same call)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, key_mask, layer_cache):
    """x: [B, T, D]; positions: [B, T]; key_mask: [B, T, S] bool.

    layer_cache: None (plain form), or (latent [B, 1, S, C], rope key
    [B, 1, S, Dr], index) where the T new tokens are written at slots
    ``[index, index + T)`` and attention runs in the absorbed form.
    """
    cfg, m = self.cfg, self.cfg.mla
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    D, H = cfg.d_model, cfg.n_heads
    C, Dn, Dr, Dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    x = x.astype(dt)
    if m.q_lora_rank is None:
      wq = _param(self, "q", (D, H, Dn + Dr), ("embed", "q_heads", "head_dim"), pdt)
      q = jnp.einsum("BTD,DHE->BTHE", x, wq.astype(dt))
    else:
      Cq = m.q_lora_rank
      wqa = _param(self, "q_a", (D, Cq), ("embed", "latent"), pdt)
      wqb = _param(self, "q_b", (Cq, H, Dn + Dr), ("latent", "q_heads", "head_dim"), pdt)
      cq = RMSNorm(LATENT_NORM_EPS, dt, pdt, name="q_a_norm")(x @ wqa.astype(dt))  # [B, T, Cq]
      q = jnp.einsum("BTC,CHE->BTHE", cq, wqb.astype(dt))
    q = nn.with_logical_constraint(q, ("batch", "length", "q_heads", "head_dim"))
    q_nope = q[..., :Dn]  # [B, T, H, Dn]
    q_rope = mla_rope(q[..., Dn:], positions, cfg.rope_theta, m)  # [B, T, H, Dr]

    wkva = _param(self, "kv_a", (D, C + Dr), ("embed", "latent"), pdt)
    wkvb = _param(self, "kv_b", (C, H, Dn + Dv), ("latent", "q_heads", "head_dim"), pdt)
    wo = _param(self, "o", (H, Dv, D), ("q_heads", "head_dim", "embed"), pdt)
    ckv = x @ wkva.astype(dt)  # [B, T, C + Dr]
    c = RMSNorm(LATENT_NORM_EPS, dt, pdt, name="kv_a_norm")(ckv[..., :C])  # [B, T, C]
    k_r = mla_rope(ckv[:, :, None, C:], positions, cfg.rope_theta, m)[:, :, 0]
    w_uk, w_uv = wkvb[..., :Dn].astype(dt), wkvb[..., Dn:].astype(dt)  # [C, H, Dn], [C, H, Dv]
    scale = softmax_scale(m)
    big_neg = jnp.finfo(jnp.float32).min

    def attend(scores):  # [B, H, T, S] fp32 -> probabilities in dt
      scores = jnp.where(key_mask[:, None, :, :], scores * scale, big_neg)
      return jax.nn.softmax(scores, axis=-1).astype(dt)

    new_cache = None
    if layer_cache is None:
      # Plain form: per-head keys [c W_UK_h ; k_r] and values c W_UV_h.
      k_nope = jnp.einsum("BSC,CHE->BSHE", c, w_uk)
      v = jnp.einsum("BSC,CHE->BSHE", c, w_uv)
      scores = (jnp.einsum("BTHE,BSHE->BHTS", q_nope, k_nope, preferred_element_type=jnp.float32)
                + jnp.einsum("BTHE,BSE->BHTS", q_rope, k_r, preferred_element_type=jnp.float32))
      out = jnp.einsum("BHTS,BSHE->BTHE", attend(scores), v)  # [B, T, H, Dv]
    else:
      # Absorbed form against the latent cache: W_UK into the query, W_UV
      # after the attention-weighted sum of latents.
      cc, cr, index = layer_cache
      cc = jax.lax.dynamic_update_slice_in_dim(cc, c[:, None].astype(cc.dtype), index, axis=2)
      cr = jax.lax.dynamic_update_slice_in_dim(cr, k_r[:, None].astype(cr.dtype), index, axis=2)
      new_cache = (cc, cr)
      lat, kr = cc[:, 0].astype(dt), cr[:, 0].astype(dt)  # [B, S, C], [B, S, Dr]
      q_lat = jnp.einsum("BTHE,CHE->BTHC", q_nope, w_uk)  # [B, T, H, C]
      scores = (jnp.einsum("BTHC,BSC->BHTS", q_lat, lat, preferred_element_type=jnp.float32)
                + jnp.einsum("BTHE,BSE->BHTS", q_rope, kr, preferred_element_type=jnp.float32))
      o_lat = jnp.einsum("BHTS,BSC->BTHC", attend(scores), lat)  # [B, T, H, C]
      out = jnp.einsum("BTHC,CHE->BTHE", o_lat, w_uv)  # [B, T, H, Dv]
    return jnp.einsum("BTHE,HED->BTD", out, wo.astype(dt)), new_cache
