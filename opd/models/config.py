"""The frozen config that drives every model of the family (SPEC §2).

Student, teachers, generative reward models and the scalar meta-RM are the
same decoder; only this dataclass differs between them. Dimension letters
used across the codebase: B batch, T sequence, D model width, H query heads,
K kv heads, G = H // K query heads per kv head, Dh head dim, F MLP width,
V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


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

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                 "d_ff"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.head_dim is None:
      if self.d_model % self.n_heads:
        raise ValueError(
            f"ModelConfig.d_model={self.d_model} is not divisible by "
            f"n_heads={self.n_heads}; set head_dim explicitly or change one of them")
    elif not isinstance(self.head_dim, int) or self.head_dim <= 0:
      raise ValueError(f"ModelConfig.head_dim must be a positive int or None, got {self.head_dim!r}")
    if self.resolved_head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.resolved_head_dim} must be even for RoPE")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} is not divisible by "
          f"n_kv_heads={self.n_kv_heads}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(
            f"ModelConfig.{name}={getattr(self, name)!r} is not one of {sorted(_DTYPES)}")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
    if not self.norm_eps > 0:
      raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

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
    """Builds a config from a mapping, rejecting unknown keys by name."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"unknown ModelConfig field(s) {unknown}; known: {sorted(fields)}")
    return cls(**dict(d))

  def num_params(self) -> int:
    """Parameter count (embedding and head counted separately if untied)."""
    D, F, V = self.d_model, self.d_ff, self.vocab_size
    H, K, Dh = self.n_heads, self.n_kv_heads, self.resolved_head_dim
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D
    if self.qkv_bias:
      attn += (H + 2 * K) * Dh
    if self.o_bias:
      attn += D
    if self.qk_norm:
      attn += 2 * Dh
    block = attn + 3 * D * F + 2 * D
    total = self.n_layers * block + V * D + D
    if not self.tie_embeddings:
      total += D * V
    if self.scalar_head:
      total += D + 1
    return total

  def flops_per_token(self, seq_len: int) -> float:
    """Forward matmul FLOPs per token (2 per multiply-add), attention included."""
    D, F, V = self.d_model, self.d_ff, self.vocab_size
    H, K, Dh = self.n_heads, self.n_kv_heads, self.resolved_head_dim
    proj = 2 * (D * H * Dh + 2 * D * K * Dh + H * Dh * D)
    mlp = 2 * 3 * D * F
    attn = 2 * 2 * H * Dh * seq_len  # QK^T and PV against seq_len keys
    return self.n_layers * (proj + mlp + attn) + 2 * D * V
