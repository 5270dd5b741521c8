"""Tiny random ``transformers`` DeepSeek-V4 configs and torch<->numpy helpers for the v4 tests."""
from __future__ import annotations

import numpy as np
import torch
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config


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
