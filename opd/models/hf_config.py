"""Hugging Face ``config.json`` <-> ``ModelConfig`` for Llama / Qwen2 / Qwen3 /
DeepSeek-V3 (docs/DESIGN.md §2).

Anything the decoder does not implement (RoPE scaling, sliding-window
attention, MLP biases, activations other than SiLU, ...) raises a
``ValueError`` naming the HF field and its value instead of silently
producing a different model. ``opd.models.hf`` maps the tensors and reads
and writes the files; DeepSeek-V3's multi-head latent attention
fields are ``opd.models.hf_deepseek``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from opd.models import hf_deepseek, hf_moe, hf_v4
from opd.models.config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3", hf_deepseek.MODEL_TYPE, hf_moe.QWEN3_MOE, hf_v4.MODEL_TYPE)
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", hf_deepseek.MODEL_TYPE: hf_deepseek.HF_CLASS,
            hf_moe.QWEN3_MOE: hf_moe.QWEN3_MOE_CLASS}



def _rope_theta(hf: Mapping[str, Any]) -> float:
  """RoPE base from the transformers-5 (``rope_parameters``) or older layout.

  Precedence as in transformers: the legacy ``rope_scaling``, then
  ``rope_parameters``, then a top-level ``rope_theta``, then 10000.
  """
  theta = hf.get("rope_theta", 10_000.0)
  for field in ("rope_parameters", "rope_scaling"):
    params = hf.get(field) or {}
    if not isinstance(params, Mapping):
      raise ValueError(f"HF config {field}={params!r} must be a dict or null")
    if any(isinstance(v, Mapping) for v in params.values()):
      raise ValueError(f"HF config {field}={params!r} is nested per layer type; "
                       "only one global RoPE is supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"HF config {field} has rope_type={rope_type!r}; only 'default' RoPE "
                       "is implemented")
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
      raise ValueError(f"HF config partial_rotary_factor={factor!r} is not supported "
                       "(must be 1.0)")
    theta = params.get("rope_theta", theta)
  return float(theta)


def _arch_of(hf: Mapping[str, Any]) -> str:
  arch = hf.get("model_type")
  if arch is None:
    names = hf.get("architectures") or []
    by_class = {v: k for k, v in HF_CLASS.items()}
    arch = next((by_class[n] for n in names if n in by_class), None)
    if arch is None:
      raise ValueError(f"HF config has no model_type and architectures={names!r} names none "
                       f"of {sorted(by_class)}")
  if arch not in ARCHS:
    raise ValueError(f"HF config model_type={arch!r} is not supported; supported: {ARCHS}")
  return arch


def _check_no_sliding_window(hf: Mapping[str, Any], n_layers: int) -> None:
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    bad = sorted({t for t in layer_types if t != "full_attention"})
    if bad:
      raise ValueError(f"HF config layer_types contains {bad}; only 'full_attention' is supported")
  if hf.get("use_sliding_window", False) and hf.get("sliding_window") is not None:
    # As transformers: layers i >= max_window_layers use the window.
    if hf.get("max_window_layers", 28) < n_layers:
      raise ValueError(
          f"HF config use_sliding_window=True with sliding_window={hf['sliding_window']} and "
          f"max_window_layers={hf.get('max_window_layers', 28)} < num_hidden_layers={n_layers}: "
          "sliding-window attention is not supported")


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32",
                   param_dtype: str | None = None) -> ModelConfig:
  """Maps a HF ``config.json`` dict (Llama / Qwen2 / Qwen3) to a ``ModelConfig``.

  Args:
    hf: the parsed ``config.json``.
    dtype: compute dtype of the returned config.
    param_dtype: storage dtype; defaults to ``dtype``.

  Raises:
    ValueError: naming the HF field and value for anything the decoder does
      not implement, a missing required field, or ``hf`` not a JSON object.
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"HF config must be a JSON object (field: value), got a "
                     f"{type(hf).__name__}: {str(hf)[:80]}")
  arch = _arch_of(hf)
  if arch == hf_v4.MODEL_TYPE:  # its own schema (opd.models.hf_v4)
    return hf_v4.config_from_hf(hf, dtype=dtype, param_dtype=param_dtype or dtype)
  for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size"):
    if name not in hf:
      raise ValueError(f"HF config lacks required field {name!r}")
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"HF config hidden_act={act!r} is not supported (only silu)")
  if hf.get("mlp_bias", False):
    raise ValueError("HF config mlp_bias=True is not supported (the MLP has no biases)")
  n_layers = hf["num_hidden_layers"]
  _check_no_sliding_window(hf, n_layers)
  rope_hf, yarn = hf, None
  if arch == hf_deepseek.MODEL_TYPE:  # MLA implements YaRN; the generic check sees the base
    rope_hf, yarn = hf_deepseek.split_yarn(hf)
  theta = _rope_theta(rope_hf)
  if arch == hf_deepseek.MODEL_TYPE:
    moe = None  # first_k_dense_replace >= num_hidden_layers: every MLP is dense
    if hf.get("first_k_dense_replace", 3) < n_layers:
      moe = hf_moe.moe_from_hf(hf, arch, n_layers)
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n_layers,
        n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"], rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mla=hf_deepseek.mla_from_hf(hf, yarn), moe=moe, dtype=dtype,
        param_dtype=param_dtype or dtype)

  D, H = hf["hidden_size"], hf["num_attention_heads"]
  K = hf.get("num_key_value_heads") or H
  head_dim = hf.get("head_dim")
  if head_dim is not None and D % H == 0 and head_dim == D // H:
    head_dim = None  # our default, so configs round-trip to the same dataclass
  attention_bias = bool(hf.get("attention_bias", False))
  if arch == "qwen2":
    qkv_bias, o_bias, qk_norm = True, False, False
  elif arch in ("qwen3", hf_moe.QWEN3_MOE):
    qkv_bias, o_bias, qk_norm = attention_bias, attention_bias, True
  else:
    qkv_bias, o_bias, qk_norm = attention_bias, attention_bias, False
  return ModelConfig(
      vocab_size=hf["vocab_size"], d_model=D, n_layers=n_layers, n_heads=H, n_kv_heads=K,
      head_dim=head_dim, d_ff=hf["intermediate_size"], rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=qk_norm, qkv_bias=qkv_bias,
      o_bias=o_bias, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      moe=hf_moe.moe_from_hf(hf, arch, n_layers) if arch == hf_moe.QWEN3_MOE else None,
      dtype=dtype, param_dtype=param_dtype or dtype)


def infer_arch(cfg: ModelConfig) -> str:
  """The HF architecture that can express ``cfg`` (mla → deepseek_v3, qk_norm → qwen3,
  q/k/v-only bias → qwen2)."""
  if cfg.v4 is not None:
    return hf_v4.MODEL_TYPE
  if cfg.mla is not None:
    return hf_deepseek.MODEL_TYPE
  if cfg.qk_norm:
    return "qwen3" if cfg.moe is None else hf_moe.QWEN3_MOE
  if cfg.qkv_bias and not cfg.o_bias:
    return "qwen2"
  return "llama"


def _check_arch_fits(cfg: ModelConfig, arch: str) -> None:
  if arch not in ARCHS:
    raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
  if (arch == hf_v4.MODEL_TYPE) != (cfg.v4 is not None):
    raise ValueError(f"arch={arch!r} does not fit cfg.v4={cfg.v4!r}: the DeepSeek-V4 decoder "
                     f"is arch={hf_v4.MODEL_TYPE!r} and only it")
  if arch == hf_v4.MODEL_TYPE:
    return
  if (arch == hf_deepseek.MODEL_TYPE) != (cfg.mla is not None):
    raise ValueError(f"arch={arch!r} does not fit cfg.mla={cfg.mla!r}: multi-head latent "
                     f"attention is arch={hf_deepseek.MODEL_TYPE!r} and only it")
  if arch == hf_deepseek.MODEL_TYPE:
    return
  if (arch == hf_moe.QWEN3_MOE) != (cfg.moe is not None):
    raise ValueError(f"arch={arch!r} does not fit cfg.moe={cfg.moe!r}: of the GQA families "
                     f"only arch={hf_moe.QWEN3_MOE!r} is a mixture of experts")
  if arch == "qwen2":
    if not cfg.qkv_bias or cfg.o_bias or cfg.qk_norm:
      raise ValueError(f"arch='qwen2' needs qkv_bias=True, o_bias=False, qk_norm=False; got "
                       f"{cfg.qkv_bias=}, {cfg.o_bias=}, {cfg.qk_norm=}")
    return
  if cfg.qkv_bias != cfg.o_bias:
    raise ValueError(f"arch={arch!r} has one attention_bias flag for q/k/v and o; got "
                     f"{cfg.qkv_bias=} and {cfg.o_bias=} (use arch='qwen2' for q/k/v-only bias)")
  if arch in ("qwen3", hf_moe.QWEN3_MOE) and not cfg.qk_norm:
    raise ValueError(f"arch={arch!r} always applies q/k norm; got cfg.qk_norm=False")
  if arch == "llama":
    if cfg.qk_norm:
      raise ValueError("arch='llama' has no q/k norm; got cfg.qk_norm=True (use arch='qwen3')")
    if cfg.d_model % cfg.n_heads:
      raise ValueError(f"arch='llama' requires d_model % n_heads == 0 (transformers checks it); "
                       f"got {cfg.d_model=}, {cfg.n_heads=}")


def config_to_hf(cfg: ModelConfig, arch: str | None = None, **overrides) -> dict[str, Any]:
  """The HF ``config.json`` dict for ``cfg`` (``overrides`` set extra HF fields).

  Args:
    cfg: our config.
    arch: "llama", "qwen2" or "qwen3"; ``None`` picks ``infer_arch(cfg)``.
    **overrides: HF fields added or replaced verbatim, e.g.
      ``max_position_embeddings`` or ``eos_token_id``.

  Raises:
    ValueError: if ``arch`` cannot express ``cfg`` (naming the field).
  """
  arch = arch or infer_arch(cfg)
  _check_arch_fits(cfg, arch)
  if arch == hf_v4.MODEL_TYPE:
    return {**hf_v4.config_to_hf(cfg), **overrides}
  hf: dict[str, Any] = {
      "architectures": [HF_CLASS[arch]],
      "model_type": arch,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.resolved_head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": 32768,
      "dtype": cfg.param_dtype,
  }
  if arch == hf_deepseek.MODEL_TYPE:
    hf.update(hf_deepseek.mla_to_hf(cfg))
    if cfg.moe is None:
      hf.update(first_k_dense_replace=cfg.n_layers)  # every MLP dense
    else:
      hf.update(hf_moe.moe_to_hf(cfg.moe, arch))
  elif arch == "llama":
    hf.update(attention_bias=cfg.o_bias, mlp_bias=False)
  elif arch in ("qwen3", hf_moe.QWEN3_MOE):
    hf.update(attention_bias=cfg.o_bias, use_sliding_window=False, sliding_window=None)
    if cfg.moe is not None:
      hf.update(hf_moe.moe_to_hf(cfg.moe, arch))
  else:
    hf.update(use_sliding_window=False, sliding_window=None)
  hf.update(overrides)
  return hf


def check_config_matches(expected: ModelConfig, found: ModelConfig, where: str) -> None:
  """Raises naming the first architecture field where two configs differ."""
  ignore = {"dtype", "param_dtype", "remat", "scalar_head"}
  for f in dataclasses.fields(ModelConfig):
    if f.name in ignore:
      continue
    a, b = getattr(expected, f.name), getattr(found, f.name)
    if f.name == "head_dim":
      a, b = expected.resolved_head_dim, found.resolved_head_dim
    if f.name == "moe" and hf_moe.same_architecture(a, b):
      continue  # the balance-loss coefficients and the dispatch are the caller's choice
    if a != b:
      raise ValueError(f"checkpoint at {where} does not match the given config: "
                       f"{f.name}={b!r} in the checkpoint, {a!r} in the config")
