"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) in HF interop: MLA fields and tensors (docs/DESIGN.md §2).

``opd.models.hf_config`` and ``opd.models.hf`` dispatch here for
``model_type="deepseek_v3"``; this module holds what differs from the dense
families: the multi-head latent attention sub-config (``MLAConfig``) read from
and written to ``config.json``, the attention rows of the tensor table, the
multi-token-prediction (MTP) layers and YaRN RoPE scaling
(``rope_parameters`` with ``rope_type='yarn'`` ↔ ``MLAConfig.yarn``). The
MoE layers' fields and tensors are ``opd.models.hf_moe``'s.

MTP layers (``num_nextn_predict_layers > 0``; DeepSeek-V3 ships one, stored
as ``model.layers.{n_layers}.*``) predict a second token ahead for
speculative decoding. They play no part in the causal-LM logits, so loading
drops their tensors with one logged warning naming the count, and a saved
checkpoint declares ``num_nextn_predict_layers=0``.

Tensor layout (HF ``[out, in]`` ↔ ours ``[in, ...]``, heads split out; Dq =
Dn + Dr): ``q_proj [H·Dq, D] ↔ attn/q [D, H, Dq]`` or ``q_a_proj [Cq, D] ↔
attn/q_a [D, Cq]``, ``q_a_layernorm [Cq] ↔ attn/q_a_norm/scale``,
``q_b_proj [H·Dq, Cq] ↔ attn/q_b [Cq, H, Dq]``; ``kv_a_proj_with_mqa
[C + Dr, D] ↔ attn/kv_a [D, C + Dr]``, ``kv_a_layernorm [C] ↔
attn/kv_a_norm/scale``, ``kv_b_proj [H·(Dn + Dv), C] ↔ attn/kv_b [C, H,
Dn + Dv]``, ``o_proj [D, H·Dv] ↔ attn/o [H, Dv, D]``.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Mapping

from opd.models.config import MLAConfig, ModelConfig, YaRNConfig

log = logging.getLogger(__name__)

MODEL_TYPE = "deepseek_v3"
HF_CLASS = "DeepseekV3ForCausalLM"
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# HF YaRN key -> YaRNConfig field.
_YARN_KEYS = {"factor": "factor", "original_max_position_embeddings": "original_max_position",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
              "mscale_all_dim": "mscale_all_dim"}


def split_yarn(hf: Mapping[str, Any]) -> tuple[dict[str, Any], YaRNConfig | None]:
  """``(hf with its YaRN RoPE dict made 'default', the YaRNConfig or None)``.

  The ``rope_parameters`` / legacy ``rope_scaling`` dict with
  ``rope_type='yarn'`` becomes ``{'rope_type': 'default', 'rope_theta': ...}``
  so the generic RoPE check reads the base; the legacy field wins when both
  are YaRN, as in transformers.

  Raises:
    ValueError: naming the field for a YaRN key this model does not
      implement (``attention_factor``, ``truncate=False``, anything unknown)
      or a missing ``factor``.
  """
  out, yarn = dict(hf), None
  for field in ("rope_parameters", "rope_scaling"):
    params = hf.get(field)
    if not isinstance(params, Mapping) or params.get("rope_type", params.get("type")) != "yarn":
      continue
    extra = sorted(set(params) - set(_YARN_KEYS) - {"rope_type", "type", "rope_theta",
                                                     "attention_factor", "truncate"})
    if extra or params.get("attention_factor") is not None or not params.get("truncate", True):
      bad = extra or ["attention_factor" if params.get("attention_factor") is not None
                      else "truncate"]
      raise ValueError(f"HF config {field} (YaRN) sets {bad}, which is not supported")
    if params.get("factor") is None:
      raise ValueError(f"HF config {field} (YaRN) lacks 'factor'")
    values = {ours: params[key] for key, ours in _YARN_KEYS.items() if params.get(key) is not None}
    values.setdefault("original_max_position", hf.get("max_position_embeddings"))
    try:
      yarn = YaRNConfig(**values)
    except (TypeError, ValueError) as e:
      raise ValueError(f"HF config {field} (YaRN): {e}") from None
    out[field] = {"rope_type": "default",
                  **({"rope_theta": params["rope_theta"]} if "rope_theta" in params else {})}
  return out, yarn


def mla_from_hf(hf: Mapping[str, Any], yarn: YaRNConfig | None = None) -> MLAConfig:
  """The ``MLAConfig`` of a DeepSeek-V3 ``config.json`` (``yarn`` from ``split_yarn``).

  Raises:
    ValueError: naming the HF field for a missing MLA dimension, attention
      biases, quantised weights or ``num_key_value_heads`` other than
      ``num_attention_heads`` (MLA expands the latent to every head).
  """
  for name in _MLA_FIELDS:
    if hf.get(name) is None:
      raise ValueError(f"HF config model_type={MODEL_TYPE!r} lacks required field {name!r}")
  if hf.get("attention_bias", False):
    raise ValueError("HF config attention_bias=True is not supported for deepseek_v3 (MLA has "
                     "no projection biases)")
  if hf.get("quantization_config") is not None:
    method = hf["quantization_config"].get("quant_method", "?") if isinstance(
        hf["quantization_config"], Mapping) else "?"
    raise ValueError(f"HF config quantization_config (quant_method={method!r}) is not "
                     "supported: dequantise the checkpoint to bf16/fp32 first")
  H = hf.get("num_attention_heads")
  K = hf.get("num_key_value_heads")
  if K is not None and K != H:
    raise ValueError(f"HF config num_key_value_heads={K} must equal num_attention_heads={H} "
                     "for deepseek_v3 (every head reads the shared latent)")
  try:
    return MLAConfig(**{name: hf[name] for name in _MLA_FIELDS},
                     q_lora_rank=hf.get("q_lora_rank"),
                     rope_interleave=hf.get("rope_interleave", True), yarn=yarn)
  except ValueError as e:
    raise ValueError(f"HF config: {e}") from None


def mla_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The DeepSeek-V3 ``config.json`` fields that describe ``cfg.mla``."""
  m = cfg.mla
  rope = {}
  if m.yarn is not None:
    rope["rope_parameters"] = {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                               **{key: getattr(m.yarn, ours) for key, ours in _YARN_KEYS.items()}}
    rope["max_position_embeddings"] = round(m.yarn.factor * m.yarn.original_max_position)
  return {**rope, "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank,
          "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
          "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave,
          "head_dim": m.qk_rope_head_dim,  # transformers' RoPE width for this family
          "num_key_value_heads": cfg.n_heads, "attention_bias": False,
          "num_nextn_predict_layers": 0}


def attention_rows(cfg: ModelConfig) -> list[tuple]:
  """Per-layer rows of ``opd.models.hf``'s tensor table for MLA.

  Each row: (HF name under ``model.layers.{i}.``, our path under
  ``layers_{i}/``, HF shape, our shape, transpose, config fields behind the
  shape).
  """
  m, D, H = cfg.mla, cfg.d_model, cfg.n_heads
  C, Dn, Dr, Dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
  Dq = Dn + Dr
  dq = "n_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim"
  if m.q_lora_rank is None:
    rows = [("self_attn.q_proj.weight", "attn/q", (H * Dq, D), (D, H, Dq), True,
             dq + ", d_model")]
  else:
    Cq = m.q_lora_rank
    rows = [("self_attn.q_a_proj.weight", "attn/q_a", (Cq, D), (D, Cq), True,
             "mla.q_lora_rank, d_model"),
            ("self_attn.q_a_layernorm.weight", "attn/q_a_norm/scale", (Cq,), (Cq,), False,
             "mla.q_lora_rank"),
            ("self_attn.q_b_proj.weight", "attn/q_b", (H * Dq, Cq), (Cq, H, Dq), True,
             dq + ", mla.q_lora_rank")]
  rows += [("self_attn.kv_a_proj_with_mqa.weight", "attn/kv_a", (C + Dr, D), (D, C + Dr), True,
            "mla.kv_lora_rank, mla.qk_rope_head_dim, d_model"),
           ("self_attn.kv_a_layernorm.weight", "attn/kv_a_norm/scale", (C,), (C,), False,
            "mla.kv_lora_rank"),
           ("self_attn.kv_b_proj.weight", "attn/kv_b", (H * (Dn + Dv), C), (C, H, Dn + Dv), True,
            "n_heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank"),
           ("self_attn.o_proj.weight", "attn/o", (D, H * Dv), (H, Dv, D), True,
            "d_model, n_heads, mla.v_head_dim")]
  return rows


def mtp_tensors(hf: Mapping[str, Any], n_layers: int, names: Iterable[str]) -> list[str]:
  """The checkpoint's multi-token-prediction tensors, to be dropped (logged).

  Those are the ``model.layers.{i}.*`` tensors with ``n_layers <= i <
  n_layers + num_nextn_predict_layers`` (``config.json``); any other layer
  index is left for the caller to refuse as unexpected.
  """
  n_mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
  if n_mtp <= 0:
    return []
  dropped = sorted(n for n in names
                   if (m := _LAYER.match(n)) and n_layers <= int(m.group(1)) < n_layers + n_mtp)
  if dropped:
    layers = sorted({int(_LAYER.match(n).group(1)) for n in dropped})
    log.warning("dropping %d multi-token-prediction tensors of layer(s) %s "
                "(num_nextn_predict_layers=%d): they do not affect the causal-LM logits",
                len(dropped), layers, n_mtp)
  return dropped
