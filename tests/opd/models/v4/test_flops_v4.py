"""``ModelConfig.flops_per_token`` for DeepSeek-V4 (``opd.models.v4.config.v4_flops_per_token``)
against a hand count on the tiny config and, for its weight part, against the params."""
import jax
import numpy as np

from opd.models import init_params
from v4_family import tiny_v4

CFG = tiny_v4()  # V 64, D 32, H 4, Dh 16, N 4, Cq 24, R 12, G 2, E 8, k 2, Fe 16, W 8


def test_hand_count_at_32_positions():
  # Multiply-adds per token with S = 32 positions of context:
  common = (2 * (4 * 32) * (6 * 4)                           # two mHC sites: N·D x (2+N)·N
            + 32 * 24 + 24 * 4 * 16 + 32 * 16 + 4 * 16 * 12 + 2 * 12 * 32  # q_a q_b kv o_a o_b
            + 32 * 8 + 3 * 3 * 32 * 16)                      # router; k + 1 = 3 SwiGLUs
  assert common == 6144 + 4352 + 4864
  sliding = common + 2 * 64 * 8                              # QK, PV (H·Dh = 64) over W = 8 keys
  csa = (common + 2 * 32 * 32 + 2 * 32 * 24                  # compressors: D x 2Dh, D x 2c^I, twice
         + 24 * 4 * 12 + 32 * 4                              # indexer queries, head weights
         + 8 * (4 * 12 + 4)                                  # scores of n = 32 // 4 = 8 entries
         + 2 * 64 * (8 + 2))                                 # 8 window keys + top-2 entries
  hca = common + 2 * 32 * 16 + 2 * 64 * (8 + 32 // 8)        # compressor; 8 keys + 4 entries
  head = 4 * 32 * 4 + 32 * 64                                # mHC collapse, LM head
  assert CFG.flops_per_token(32) == 2 * (sliding + csa + hca + head) == 2 * 58784


def test_weight_part_equals_the_params_a_token_uses():
  # With no context only weights remain: every matrix param a token multiplies (the
  # experts' k of E), not the embedding lookup, the per-slot position biases or 1-D params.
  params = init_params(CFG, jax.random.key(0))
  k, E = CFG.moe.experts_per_token, CFG.moe.n_routed_experts
  total = 0.0
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    if x.ndim < 2 or "embedding" in name or "position_bias" in name:
      continue
    expert = "'mlp'" in name and any(f"'{w}'" in name for w in ("gate", "up", "down"))
    total += x.size * (k / E if expert else 1)
  assert CFG.flops_per_token(0) == 2 * total
  # Attention grows with the context: the window saturates at W, compressed entries don't.
  assert CFG.flops_per_token(64) - CFG.flops_per_token(32) == 2 * (
      (64 // 4 - 32 // 4) * (4 * 12 + 4)                 # indexer scores of 8 more CSA entries
      + 2 * 64 * (64 // 8 - 32 // 8))                    # 4 more HCA entries (top-2 is full)
  assert np.isfinite(CFG.flops_per_token(10 ** 6))
