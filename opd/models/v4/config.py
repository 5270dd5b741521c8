"""``V4Config``: the ``ModelConfig.v4`` sub-config that makes the family's decoder
DeepSeek-V4 (docs/DESIGN.md §2, "DeepSeek-V4"); transformers' ``DeepseekV4Config``
field in brackets.

The shared fields come from ``ModelConfig``: V [``vocab_size``], D
[``hidden_size``], layers [``num_hidden_layers``], H [``num_attention_heads``],
Dh [``head_dim``], the sliding layers' RoPE base [``rope_parameters["main"]``],
[``rms_norm_eps``]; the experts from ``ModelConfig.moe`` (router
``sqrtsoftplus``, one shared expert, renormalised top-k).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from opd.config.fields import check_fields, from_group, set_field

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("moe", "hash_moe")


@dataclasses.dataclass(frozen=True)
class V4YaRN:
  """YaRN on the compressed branches' RoPE (transformers' ``rope_parameters["compress"]``
  with ``rope_type="yarn"``; its keys in brackets).

  The frequencies blend ``θ^(-2i/Dr)`` and ``θ^(-2i/Dr) / factor`` by the linear ramp
  of ``opd.models.mla.yarn_frequencies`` (dims whose wavelength lies between
  ``beta_fast`` and ``beta_slow`` turns in ``original_max_position`` tokens); cos and
  sin are multiplied by ``attention_factor`` (1 in DeepSeek-V4, which transformers
  sets for a YaRN compress branch).

  Attributes:
    factor: s [``factor``]. original_max_position: [``original_max_position_embeddings``].
    beta_fast, beta_slow: the ramp's bounds [``beta_fast``, ``beta_slow``].
    attention_factor: the cos / sin multiplier [``attention_factor``].
  """
  factor: float
  original_max_position: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 1.0

  def __post_init__(self):
    check_fields(self, "V4YaRN", ints={"original_max_position": 1},
                 positive=("factor", "beta_fast", "beta_slow", "attention_factor"))


@dataclasses.dataclass(frozen=True)
class V4Config:
  """What DeepSeek-V4 adds to a ``ModelConfig``.

  Attributes:
    layer_types: one of ``LAYER_TYPES`` per layer [``layer_types``].
    mlp_layer_types: "moe" or "hash_moe" per layer [``mlp_layer_types``].
    q_lora_rank: Cq, the query's low-rank width [``q_lora_rank``].
    rope_dim: Dr, the trailing dims of a head with RoPE
      [``qk_rope_head_dim`` = ``head_dim · partial_rotary_factor``].
    sliding_window: W, keys per query including itself [``sliding_window``].
    o_groups: G, head groups of the output projection [``o_groups``].
    o_lora_rank: R, each group's width [``o_lora_rank``].
    csa_compress_rate, hca_compress_rate: m of CSA and HCA layers [``compress_rates``].
    compress_rope_theta: RoPE base of compressed layers [``rope_parameters["compress"]``].
    index_n_heads, index_head_dim, index_topk: CSA's lightning indexer
      [``index_n_heads``, ``index_head_dim``, ``index_topk``].
    n_streams: N, mHC residual streams [``hc_mult``].
    sinkhorn_iters: Sinkhorn column steps [``hc_sinkhorn_iters``].
    hc_eps: mHC floor [``hc_eps``].
    swiglu_limit: L, the SwiGLU clip [``swiglu_limit``].
    compress_yarn: YaRN on the CSA / HCA layers' RoPE (attention, compressors,
      indexer), None = plain RoPE [``rope_parameters["compress"]``]; a mapping is
      converted.
  """
  layer_types: tuple[str, ...] = ("sliding_attention",)
  mlp_layer_types: tuple[str, ...] = ("moe",)
  q_lora_rank: int = 32
  rope_dim: int = 8
  sliding_window: int = 128
  o_groups: int = 2
  o_lora_rank: int = 32
  csa_compress_rate: int = 4
  hca_compress_rate: int = 128
  compress_rope_theta: float = 160000.0
  index_n_heads: int = 2
  index_head_dim: int = 16
  index_topk: int = 512
  n_streams: int = 4
  sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  swiglu_limit: float = 10.0
  compress_yarn: V4YaRN | None = None

  def __post_init__(self):
    if isinstance(self.compress_yarn, Mapping):
      set_field(self, "compress_yarn", from_group(V4YaRN, self.compress_yarn,
                                                  "V4Config.compress_yarn"))
    if self.compress_yarn is not None and not isinstance(self.compress_yarn, V4YaRN):
      raise ValueError(f"V4Config.compress_yarn must be a V4YaRN, a mapping or None, got "
                       f"{self.compress_yarn!r}")
    for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
      value = getattr(self, name)
      if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise ValueError(f"V4Config.{name} must be a sequence of strings, got {value!r}")
      set_field(self, name, tuple(value))
      bad = [v for v in getattr(self, name) if v not in allowed]
      if bad or not getattr(self, name):
        raise ValueError(f"V4Config.{name} must be a non-empty sequence of {allowed}, got "
                         f"{value!r}")
    check_fields(self, "V4Config",
                 ints=dict.fromkeys(("q_lora_rank", "sliding_window", "o_groups", "o_lora_rank",
                                     "csa_compress_rate", "hca_compress_rate", "index_n_heads",
                                     "index_head_dim", "index_topk", "n_streams",
                                     "sinkhorn_iters"), 1) | {"rope_dim": 0},
                 positive=("compress_rope_theta", "hc_eps", "swiglu_limit"))
    if len(self.layer_types) != len(self.mlp_layer_types):
      raise ValueError(f"V4Config.layer_types has {len(self.layer_types)} entries, "
                       f"mlp_layer_types {len(self.mlp_layer_types)}: one each per layer")
    if self.rope_dim % 2:
      raise ValueError(f"V4Config.rope_dim={self.rope_dim} must be even for RoPE")
    if "compressed_sparse_attention" in self.layer_types and self.rope_dim > self.index_head_dim:
      raise ValueError(f"V4Config.rope_dim={self.rope_dim} must be <= index_head_dim="
                       f"{self.index_head_dim} (the indexer's keys get RoPE too)")


def v4_num_params(cfg) -> int:
  """Parameters of a ``ModelConfig`` with ``v4`` set (its hash tables included)."""
  v4, moe = cfg.v4, cfg.moe
  D, V, H, Dh = cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.resolved_head_dim
  N, Cq, R, G = v4.n_streams, v4.q_lora_rank, v4.o_lora_rank, v4.o_groups
  E, Fe, k = moe.n_routed_experts, moe.moe_d_ff, moe.experts_per_token
  W = (2 + N) * N
  hc = N * D * W + W + 3

  def compressor(width, overlap, m):
    cw = 2 * width if overlap else width
    return 2 * D * cw + m * cw + width

  total = V * D + (N * D * N + N + 1) + D + (0 if cfg.tie_embeddings else D * V)
  total += (D + 1) if cfg.scalar_head else 0
  for layer_type, mlp_type in zip(v4.layer_types, v4.mlp_layer_types):
    attn = D * Cq + Cq + Cq * H * Dh + D * Dh + Dh + H + H * Dh * R + G * R * D
    if layer_type == "heavily_compressed_attention":
      attn += compressor(Dh, False, v4.hca_compress_rate)
    elif layer_type == "compressed_sparse_attention":
      m = v4.csa_compress_rate
      attn += (compressor(Dh, True, m) + compressor(v4.index_head_dim, True, m)
               + Cq * v4.index_n_heads * v4.index_head_dim + D * v4.index_n_heads)
    mlp = D * E + (V * k if mlp_type == "hash_moe" else E) + (E + 1) * 3 * D * Fe
    total += 2 * hc + 2 * D + attn + mlp
  return total


def v4_flops_per_token(cfg, seq_len: int) -> float:
  """Forward matmul FLOPs per token (2 per multiply-add) of a ``ModelConfig`` with ``v4``
  set, for a query with ``seq_len`` positions of context (itself included).

  Every weight matrix a token goes through (mHC projections, attention, compressors and
  indexer, router, its k routed and the shared expert, the head) plus the attention
  products of what a query reads: QK and PV (key = value, H heads of Dh) against the
  ``min(W, S)`` window keys, and per compressed layer its ``n = S // m`` complete
  entries (HCA: all n; CSA: ``min(index_topk, n)`` picks, after the indexer scored all
  n: ``n_h^I · c^I`` per entry, and weighted them: ``n_h^I``). Elementwise work
  (norms, Sinkhorn, softmax, the streams' mixing) is not counted.
  """
  v4, moe = cfg.v4, cfg.moe
  D, V, H, Dh = cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.resolved_head_dim
  N, Cq, R, S = v4.n_streams, v4.q_lora_rank, v4.o_lora_rank, seq_len
  nI, cI = v4.index_n_heads, v4.index_head_dim
  macs = N * D * N + D * V  # the head's mHC collapse and the LM head
  for layer_type, mlp_type in zip(v4.layer_types, v4.mlp_layer_types):
    keys = min(v4.sliding_window, S)
    macs += 2 * N * D * (2 + N) * N  # the two mHC sites
    macs += D * Cq + Cq * H * Dh + D * Dh + H * Dh * R + v4.o_groups * R * D
    if layer_type == "heavily_compressed_attention":
      macs += 2 * D * Dh  # the compressor's kv and gate
      keys += S // v4.hca_compress_rate
    elif layer_type == "compressed_sparse_attention":
      n = S // v4.csa_compress_rate
      macs += 2 * D * 2 * Dh + 2 * D * 2 * cI  # both compressors (two series each)
      macs += Cq * nI * cI + D * nI + n * (nI * cI + nI)  # the indexer's queries and scores
      keys += min(v4.index_topk, n)
    macs += 2 * H * Dh * keys  # QK and PV
    macs += D * moe.n_routed_experts + (moe.experts_per_token + 1) * 3 * D * moe.moe_d_ff
  return 2.0 * macs
