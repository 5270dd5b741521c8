"""The frozen config that drives every model of the family (docs/DESIGN.md §2).

Student, teachers, generative reward models and the scalar meta-RM are the
same decoder; only this dataclass differs between them. Dimension letters
used across the codebase: B batch, T sequence, D model width, H query heads,
K kv heads, G = H // K query heads per kv head, Dh head dim, F MLP width,
V vocabulary.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import jax.numpy as jnp

from opd.config.fields import check_fields, check_int, from_group, set_field
from opd.models.moe import MoEConfig
from opd.models.v4.config import V4Config, v4_flops_per_token, v4_num_params

_BPE_SPEC = re.compile(r"bpe:[1-9][0-9]*")

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class YaRNConfig:
  """YaRN RoPE scaling as DeepSeek-V3 uses it (docs/DESIGN.md §2, MLA).

  Each RoPE frequency blends its extrapolated value ``θ^(-2i/Dr)`` and the
  interpolated ``θ^(-2i/Dr) / factor`` by a linear ramp over the dims whose
  wavelength lies between ``beta_fast`` and ``beta_slow`` rotations in
  ``original_max_position`` tokens; cos and sin are multiplied by
  ``m(factor, mscale) / m(factor, mscale_all_dim)`` and the softmax scale by
  ``m(factor, mscale_all_dim)²`` (when ``mscale_all_dim`` > 0), with
  ``m(s, a) = 0.1 a ln s + 1`` for s > 1, else 1.

  Attributes:
    factor: context extension factor s.
    original_max_position: the pre-training context length.
    beta_fast, beta_slow: the ramp's rotation bounds.
    mscale, mscale_all_dim: the attention-temperature coefficients
      (0 = unset; with either unset cos and sin are scaled by m(s, 1)).
  """
  factor: float = 1.0
  original_max_position: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0

  def __post_init__(self):
    check_fields(self, "YaRNConfig", ints={"original_max_position": 1},
                 positive=("factor", "beta_fast", "beta_slow"),
                 non_negative=("mscale", "mscale_all_dim"))


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (DeepSeek-V2/V3; docs/DESIGN.md §2).

  Attributes:
    kv_lora_rank: C, width of the compressed key/value latent (the only
      per-token attention state besides the RoPE key).
    qk_nope_head_dim: Dn, per-head query/key dims without RoPE.
    qk_rope_head_dim: Dr, per-head query dims with RoPE, and the width of the
      one RoPE key shared by all heads; even.
    v_head_dim: Dv, per-head value dims.
    q_lora_rank: Cq, width of the compressed query; ``None`` projects the
      query directly from D.
    rope_interleave: the RoPE dims come in interleaved pairs ``(x0, x1),
      (x2, x3), ...`` (DeepSeek's checkpoints) instead of halves.
    yarn: YaRN scaling of the RoPE dims (``None``: plain RoPE); a mapping is
      converted.
  """
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 16
  qk_rope_head_dim: int = 8
  v_head_dim: int = 16
  q_lora_rank: int | None = None
  rope_interleave: bool = False
  yarn: YaRNConfig | None = None

  def __post_init__(self):
    check_fields(self, "MLAConfig",
                 ints=dict.fromkeys(("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                     "v_head_dim"), 1),
                 bools=("rope_interleave",))
    set_field(self, "q_lora_rank", check_int("MLAConfig", "q_lora_rank", self.q_lora_rank,
                                             min_value=1, allow_none=True))
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even "
                       "for RoPE")
    if isinstance(self.yarn, Mapping):
      set_field(self, "yarn", from_group(YaRNConfig, self.yarn, "MLAConfig.yarn"))
    if self.yarn is not None and not isinstance(self.yarn, YaRNConfig):
      raise ValueError(f"MLAConfig.yarn must be a YaRNConfig, a mapping or None, got "
                       f"{type(self.yarn).__name__}")

  @property
  def qk_head_dim(self) -> int:
    """Dn + Dr, the dims a query and a key are dotted over."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of one decoder.

  Attributes:
    vocab_size: V, rows of the embedding table and columns of the LM head.
    d_model: D, residual-stream width.
    n_layers: number of decoder blocks.
    n_heads: H, query heads.
    n_kv_heads: K, key/value heads (grouped-query attention); H % K == 0.
    head_dim: Dh; ``None`` means ``d_model // n_heads`` (and then D % H == 0
      is required). Qwen3 sets it independently of D.
    d_ff: F, SwiGLU hidden width.
    rope_theta: RoPE base.
    norm_eps: RMSNorm epsilon.
    qk_norm: RMSNorm over Dh on queries and keys before RoPE (Qwen3).
    qkv_bias: bias on the q/k/v projections (Qwen2).
    o_bias: bias on the attention output projection (Llama attention_bias).
    tie_embeddings: the LM head is the transposed embedding table.
    scalar_head: add a ``[D, 1]`` value head read at the last real token
      (meta-RM, Bradley–Terry RM). The LM head is kept so the same
      checkpoint can still generate.
    dtype: activation / compute dtype ("float32" or "bfloat16").
    param_dtype: storage dtype of the (master) parameters.
    remat: rematerialise each block in the backward pass.
    mla: multi-head latent attention instead of grouped-query attention
      (``None``, the default, is GQA). With MLA, ``n_kv_heads`` must equal
      ``n_heads``, ``head_dim`` must be None (the sub-config holds the head
      dims), and ``qk_norm`` / ``qkv_bias`` / ``o_bias`` must be False. A
      mapping is converted (``from_dict`` / ``to_dict`` round trip).
    moe: ``None`` (dense) or a ``MoEConfig`` (a mapping is converted):
      layers ``>= moe.first_k_dense`` replace the dense MLP with routed (+
      shared) experts (``opd.models.moe``); the others keep width ``d_ff``.
    tokenizer: the task tokenizer the vocabulary belongs to (docs/DESIGN.md
      §9, "Tokenizers"): ``"byte"`` or ``"bpe:<V>"`` (a BPE of V entries
      trained on the task corpus; ``vocab_size`` must be >= V). Every stage
      of a pipeline copies the model group, so its tokenizer travels with it.
      Models imported from HF carry their own tokenizer files instead; this
      field then stays ``"byte"`` and is unused.
    v4: ``None`` or a ``V4Config`` (a mapping is converted): the DeepSeek-V4
      decoder (``opd.models.v4``, docs/DESIGN.md §2) with ``n_layers`` entries
      in its per-layer schedules. It needs ``moe`` (every V4 layer is MoE: one
      shared expert, renormalised top-k, ``first_k_dense`` 0), one key/value
      head (``n_kv_heads=1``), no ``mla``, ``qk_norm``, ``qkv_bias``, ``o_bias``;
      ``d_ff`` is unused.
  """
  vocab_size: int = 512
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int | None = None
  d_ff: int = 384
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qk_norm: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  tie_embeddings: bool = False
  scalar_head: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  mla: MLAConfig | None = None
  moe: MoEConfig | None = None
  tokenizer: str = "byte"
  v4: V4Config | None = None

  def __post_init__(self):
    self._check_moe()
    self._check_tokenizer()
    check_fields(self, "ModelConfig",
                 ints=dict.fromkeys(("vocab_size", "d_model", "n_layers", "n_heads",
                                     "n_kv_heads", "d_ff"), 1),
                 positive=("rope_theta", "norm_eps"),
                 bools=("qk_norm", "qkv_bias", "o_bias", "tie_embeddings", "scalar_head",
                        "remat"),
                 choices=dict.fromkeys(("dtype", "param_dtype"), tuple(_DTYPES)))
    set_field(self, "head_dim", check_int("ModelConfig", "head_dim", self.head_dim, min_value=1,
                                          allow_none=True))
    if self.v4 is not None:
      self._check_v4()
    if self.mla is not None:
      self._check_mla()
    else:
      self._check_gqa()

  def _check_moe(self):
    if isinstance(self.moe, Mapping):
      set_field(self, "moe", from_group(MoEConfig, self.moe, "ModelConfig.moe"))
    if self.moe is not None and not isinstance(self.moe, MoEConfig):
      raise ValueError(f"ModelConfig.moe must be a MoEConfig, a mapping or None, got "
                       f"{type(self.moe).__name__}")
    if self.moe is not None and self.moe.first_k_dense > self.n_layers:
      raise ValueError(f"ModelConfig.moe.first_k_dense={self.moe.first_k_dense} exceeds "
                       f"n_layers={self.n_layers}")

  def _check_tokenizer(self):
    spec = self.tokenizer
    if not isinstance(spec, str) or not (spec == "byte" or _BPE_SPEC.fullmatch(spec)):
      raise ValueError(f"ModelConfig.tokenizer={spec!r}: expected 'byte' or 'bpe:<V>' "
                       "(e.g. 'bpe:1024')")
    if spec != "byte" and int(spec.split(":")[1]) > self.vocab_size:
      raise ValueError(f"ModelConfig.vocab_size={self.vocab_size} is smaller than the "
                       f"tokenizer's {spec!r}: set vocab_size >= {spec.split(':')[1]}")

  def _check_v4(self):
    if isinstance(self.v4, Mapping):
      set_field(self, "v4", from_group(V4Config, self.v4, "ModelConfig.v4"))
    if not isinstance(self.v4, V4Config):
      raise ValueError(f"ModelConfig.v4 must be a V4Config, a mapping or None, got "
                       f"{type(self.v4).__name__}")
    v4, moe = self.v4, self.moe
    if len(v4.layer_types) != self.n_layers:
      raise ValueError(f"ModelConfig.v4.layer_types has {len(v4.layer_types)} entries, "
                       f"n_layers={self.n_layers}: one per layer")
    if self.mla is not None:
      raise ValueError("ModelConfig.mla must be None with v4 (DeepSeek-V4 has its own attention)")
    if self.n_kv_heads != 1:
      raise ValueError(f"ModelConfig.n_kv_heads={self.n_kv_heads} must be 1 with v4 (one shared "
                       "key = value head)")
    for name in ("qk_norm", "qkv_bias", "o_bias"):
      if getattr(self, name):
        raise ValueError(f"ModelConfig.{name}=True is not supported with v4")
    if moe is None:
      raise ValueError("ModelConfig.moe must be set with v4 (every DeepSeek-V4 layer is MoE), "
                       "got None")
    wants = {"n_shared_experts": 1, "norm_topk_prob": True, "n_group": 1, "first_k_dense": 0}
    for name, value in wants.items():
      if getattr(moe, name) != value:
        raise ValueError(f"ModelConfig.moe.{name}={getattr(moe, name)!r} must be {value!r} "
                         "with v4")
    if self.param_dtype != "float32" and moe.n_routed_experts > 256:
      raise ValueError(f"ModelConfig.param_dtype={self.param_dtype!r} holds expert ids exactly "
                       f"only up to 256; the hash tables need n_routed_experts="
                       f"{moe.n_routed_experts}: use float32")
    if self.n_heads % v4.o_groups:
      raise ValueError(f"ModelConfig.n_heads={self.n_heads} is not divisible by "
                       f"v4.o_groups={v4.o_groups}")
    if self.resolved_head_dim < v4.rope_dim:
      raise ValueError(f"ModelConfig.v4.rope_dim={v4.rope_dim} exceeds head_dim="
                       f"{self.resolved_head_dim}")

  def _mlp_params(self, layer: int) -> tuple[int, int]:
    """(stored, active per token) weights of layer ``layer``'s MLP or MoE block."""
    D, moe = self.d_model, self.moe
    if moe is None or not moe.is_moe_layer(layer):
      return 3 * D * self.d_ff, 3 * D * self.d_ff
    expert = 3 * D * moe.moe_d_ff
    shared = moe.n_shared_experts * expert
    bias = moe.n_routed_experts if moe.router == "sigmoid" else 0
    return (D * moe.n_routed_experts + bias + moe.n_routed_experts * expert + shared,
            D * moe.n_routed_experts + moe.experts_per_token * expert + shared)

  def _check_gqa(self):
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"ModelConfig.d_model={self.d_model} is not divisible by "
          f"n_heads={self.n_heads}; set head_dim explicitly or change one of them")
    if self.resolved_head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.resolved_head_dim} must be even for RoPE")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} is not divisible by "
          f"n_kv_heads={self.n_kv_heads}")

  def _check_mla(self):
    if isinstance(self.mla, Mapping):
      set_field(self, "mla", from_group(MLAConfig, self.mla, "ModelConfig.mla"))
    if not isinstance(self.mla, MLAConfig):
      raise ValueError(f"ModelConfig.mla must be an MLAConfig, a mapping or None, got "
                       f"{type(self.mla).__name__}")
    if self.n_kv_heads != self.n_heads:
      raise ValueError(f"ModelConfig.n_kv_heads={self.n_kv_heads} must equal "
                       f"n_heads={self.n_heads} with mla (every head reads the shared latent)")
    if self.head_dim is not None:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be None with mla (the head "
                       "dims are mla.qk_nope_head_dim, qk_rope_head_dim and v_head_dim)")
    for name in ("qk_norm", "qkv_bias", "o_bias"):
      if getattr(self, name):
        raise ValueError(f"ModelConfig.{name}=True is not supported with mla")

  @property
  def resolved_head_dim(self) -> int:
    """Dh, the dims a query and a key are dotted over (Dn + Dr with MLA)."""
    if self.mla is not None:
      return self.mla.qk_head_dim
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  def _attn_params(self) -> int:
    D, H, K, Dh = self.d_model, self.n_heads, self.n_kv_heads, self.resolved_head_dim
    if self.mla is not None:
      m = self.mla
      q = D * H * Dh if m.q_lora_rank is None else D * m.q_lora_rank + m.q_lora_rank * (
          1 + H * Dh)
      kv = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * (
          1 + H * (m.qk_nope_head_dim + m.v_head_dim))
      return q + kv + H * m.v_head_dim * D
    return D * H * Dh + 2 * D * K * Dh + H * Dh * D

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def storage_dtype(self):
    return _DTYPES[self.param_dtype]

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from a mapping (``opd.config.from_group``), naming unknown keys."""
    return from_group(cls, d, "ModelConfig")

  def num_params(self) -> int:
    """Parameter count (embedding and head counted separately if untied)."""
    if self.v4 is not None:
      return v4_num_params(self)
    D, V = self.d_model, self.vocab_size
    H, K, Dh = self.n_heads, self.n_kv_heads, self.resolved_head_dim
    attn = self._attn_params()
    if self.qkv_bias:
      attn += (H + 2 * K) * Dh
    if self.o_bias:
      attn += D
    if self.qk_norm:
      attn += 2 * Dh
    total = self.n_layers * (attn + 2 * D) + V * D + D
    total += sum(self._mlp_params(i)[0] for i in range(self.n_layers))
    if not self.tie_embeddings:
      total += D * V
    if self.scalar_head:
      total += D + 1
    return total

  def flops_per_token(self, seq_len: int) -> float:
    """Forward matmul FLOPs per token (2 per multiply-add), attention included."""
    if self.v4 is not None:
      return v4_flops_per_token(self, seq_len)
    D, V = self.d_model, self.vocab_size
    H, Dh = self.n_heads, self.resolved_head_dim
    proj = 2 * (self._attn_params() - (0 if self.mla is None else self.mla.kv_lora_rank + (
        self.mla.q_lora_rank or 0)))  # matmul weights only (not the latent norms' scales)
    mlp = sum(2 * self._mlp_params(i)[1] for i in range(self.n_layers))  # active weights
    Dv = Dh if self.mla is None else self.mla.v_head_dim
    attn = 2 * H * (Dh + Dv) * seq_len  # QK^T and PV against seq_len keys
    return self.n_layers * (proj + attn) + mlp + 2 * D * V


def with_added_fields(saved: Mapping[str, Any]) -> dict[str, Any]:
  """A model config saved before some ``ModelConfig`` fields existed, completed
  with those fields' defaults. Every field added to ``ModelConfig`` defaults to
  "off" (``moe``/``mla``/``v4`` None, ``tokenizer`` "byte"), which is what the
  saved model was; the checkpoint loader and the stage compare read old
  records through this one rule."""
  added = {f.name: f.default for f in dataclasses.fields(ModelConfig)
           if f.name not in saved and f.default is not dataclasses.MISSING}
  return {**added, **saved}


def to_model_config(model: Mapping[str, Any], where: str = "config.model") -> ModelConfig:
  """The decoder's ``ModelConfig`` from a config group (``opd.config.from_group``).

  Args:
    model: e.g. ``config.model`` or ``config.teachers.math.model`` (a
      ``ConfigDict`` or a mapping).
    where: the group's path, used in error messages.

  Raises:
    ValueError: naming ``where`` and the unknown or invalid field(s).
  """
  return from_group(ModelConfig, model, where)

