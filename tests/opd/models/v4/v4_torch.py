"""Tiny random ``transformers`` DeepSeek-V4 configs and torch<->numpy helpers for the v4 tests."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from opd.models.moe import MoEConfig
from opd.models.v4.attention import V4AttentionConfig
from opd.models.v4.compressor import CompressorConfig, IndexerConfig
from opd.models.v4.moe import V4MoEConfig

RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def tiny_config(**overrides) -> DeepseekV4Config:
  """A DeepseekV4Config small enough for CPU tests (D = 32, head_dim 16, 8 experts)."""
  kw = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=24,
            num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
            hc_mult=4, hc_sinkhorn_iters=20, sliding_window=8, o_groups=2, o_lora_rank=12,
            index_n_heads=2, index_head_dim=8, index_topk=4, partial_rotary_factor=0.5,
            swiglu_limit=0.5, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
            layer_types=["sliding_attention"] * 2, mlp_layer_types=["hash_moe", "moe"])
  kw.update(overrides)
  return DeepseekV4Config(**kw)


def randomize(module: torch.nn.Module, seed: int, std: float = 0.5) -> None:
  """Fills every parameter of ``module`` with N(0, std²) draws (fp32), in place."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


def np_(t: torch.Tensor) -> np.ndarray:
  return t.detach().float().numpy()


def rel_err(got, want) -> float:
  """max |got - want| / max |want| (the relative error the v4 tests bound)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def attention_config(c, **overrides):
  """Our attention config for a sliding layer of transformers' config ``c`` (``overrides`` win)."""
  kw = dict(d_model=c.hidden_size, n_heads=c.num_attention_heads, head_dim=c.head_dim,
            q_lora_rank=c.q_lora_rank, rope_dim=c.qk_rope_head_dim,
            rope_theta=c.rope_parameters["main"]["rope_theta"], sliding_window=c.sliding_window,
            o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, norm_eps=c.rms_norm_eps)
  return V4AttentionConfig(**{**kw, **overrides})


def compressed_attention_config(c, layer_type):
  """Our config for a CSA / HCA layer of transformers' config ``c``."""
  m, theta = RATES[layer_type], c.rope_parameters["compress"]["rope_theta"]
  cc = lambda width, overlap: CompressorConfig(
      d_model=c.hidden_size, width=width, compress_rate=m, overlap=overlap,
      rope_dim=c.qk_rope_head_dim, rope_theta=theta, norm_eps=c.rms_norm_eps)
  csa = layer_type == "compressed_sparse_attention"
  indexer = IndexerConfig(compressor=cc(c.index_head_dim, True), q_lora_rank=c.q_lora_rank,
                          n_heads=c.index_n_heads, topk=c.index_topk) if csa else None
  return attention_config(c, rope_theta=theta, compressor=cc(c.head_dim, csa), indexer=indexer)


def compressor_params(mod):
  """A transformers compressor (or indexer) -> our Compressor params."""
  return {"kv": np_(mod.kv_proj.weight).T, "gate": np_(mod.gate_proj.weight).T,
          "position_bias": np_(mod.position_bias), "kv_norm": {"scale": np_(mod.kv_norm.weight)}}


def attention_params(attn, cfg):
  """transformers' DeepseekV4Attention -> our V4Attention variables."""
  H, Dh, G, R = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
  I = H // G * Dh
  p = {"q_a": np_(attn.q_a_proj.weight).T, "q_a_norm": {"scale": np_(attn.q_a_norm.weight)},
       "q_b": np_(attn.q_b_proj.weight).T.reshape(-1, H, Dh),
       "kv": np_(attn.kv_proj.weight).T, "kv_norm": {"scale": np_(attn.kv_norm.weight)},
       "sink_bias": np_(attn.sinks),
       "o_a": np_(attn.o_a_proj.weight).reshape(G, R, I).transpose(0, 2, 1),
       "o_b": np_(attn.o_b_proj.weight).T.reshape(G, R, -1)}
  if cfg.compressor is not None:
    p["compressor"] = compressor_params(attn.compressor)
  if cfg.indexer is not None:
    ind = attn.compressor.indexer
    wq = np_(ind.q_b_proj.weight).T.reshape(cfg.q_lora_rank, cfg.indexer.n_heads, -1)
    p["indexer"] = {"compressor": compressor_params(ind), "q": wq,
                    "weights": np_(ind.scorer.weights_proj.weight).T}
  return {"params": jax.tree.map(jnp.asarray, p)}


def moe_config(cfg_hf, mlp_type, dispatch="ragged"):
  """Our V4MoEConfig for transformers' config ``cfg_hf``."""
  moe = MoEConfig(n_routed_experts=cfg_hf.n_routed_experts,
                  experts_per_token=cfg_hf.num_experts_per_tok,
                  moe_d_ff=cfg_hf.moe_intermediate_size, n_shared_experts=1,
                  router=cfg_hf.scoring_func, routed_scaling_factor=cfg_hf.routed_scaling_factor,
                  dispatch=dispatch)
  return V4MoEConfig(d_model=cfg_hf.hidden_size, moe=moe, mlp_type=mlp_type,
                     vocab_size=cfg_hf.vocab_size, swiglu_limit=cfg_hf.swiglu_limit)


def moe_params(block, cfg):
  """transformers' block -> our params (the hash table as the flat float ``tid2eid``)."""
  Fe = cfg.moe.moe_d_ff
  gu = np_(block.experts.gate_up_proj)  # [E, 2Fe, D]: gate rows, then up rows
  p = {"router": np_(block.gate.weight).T,
       "gate": gu[:, :Fe].transpose(0, 2, 1), "up": gu[:, Fe:].transpose(0, 2, 1),
       "down": np_(block.experts.down_proj).transpose(0, 2, 1),
       "shared_gate": np_(block.shared_experts.gate_proj.weight).T,
       "shared_up": np_(block.shared_experts.up_proj.weight).T,
       "shared_down": np_(block.shared_experts.down_proj.weight).T}
  if cfg.mlp_type == "hash_moe":
    p["tid2eid"] = block.gate.tid2eid.numpy().reshape(-1).astype(np.float32)
  else:
    p["selection_bias"] = np_(block.gate.e_score_correction_bias)
  return {"params": jax.tree.map(jnp.asarray, p)}


def mixed_model(seed=21, **overrides):
  """A random tiny transformers V4 of the three layer types, with a random hash table
  (``overrides``: more ``DeepseekV4Config`` fields)."""
  c = tiny_config(**{**dict(num_hidden_layers=3, layer_types=LAYERS,
                            mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates=RATES,
                            index_n_heads=4, index_head_dim=12, index_topk=2), **overrides})
  c._attn_implementation = "eager"
  model = hf.DeepseekV4ForCausalLM(c).eval()
  randomize(model, seed=seed, std=0.3)
  rng = np.random.default_rng(4)
  with torch.no_grad():
    model.model.layers[0].mlp.gate.tid2eid.copy_(torch.from_numpy(np.stack(
        [rng.permutation(c.n_routed_experts)[:c.num_experts_per_tok]
         for _ in range(c.vocab_size)])))
  return c, model
