"""A tiny DeepSeek-V4 ``ModelConfig`` (no transformers needed) for the family-level v4 tests."""
from opd.models import ModelConfig
from opd.models.moe import MoEConfig
from opd.models.v4.config import V4Config

LAYERS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLPS = ("hash_moe", "moe", "moe")


def tiny_v4(**overrides) -> ModelConfig:
  """V = 64, D = 32, 3 layers (sliding/hash, CSA/moe, HCA/moe), W = 8, m = 4 and 8."""
  moe = MoEConfig(n_routed_experts=8, experts_per_token=2, moe_d_ff=16, n_shared_experts=1,
                  router="sqrtsoftplus", routed_scaling_factor=1.5, aux_loss_coef=0.01)
  v4 = V4Config(layer_types=LAYERS, mlp_layer_types=MLPS, q_lora_rank=24, rope_dim=8,
                sliding_window=8, o_groups=2, o_lora_rank=12, csa_compress_rate=4,
                hca_compress_rate=8, index_n_heads=4, index_head_dim=12, index_topk=2,
                swiglu_limit=5.0)
  kw = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=16,
            moe=moe, v4=v4)
  kw.update(overrides)
  return ModelConfig(**kw)
