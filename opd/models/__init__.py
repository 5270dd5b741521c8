"""One decoder family for student, teachers and reward models (docs/DESIGN.md §2)."""
from opd.models.config import ModelConfig, to_model_config
from opd.models.moe import MoEConfig
from opd.models.decoder import (Decoder, DecoderOutput, KVCache, check_token_ids,
                                default_positions, forward, head_matrix, init_cache, init_kind,
                                init_params, last_token_values, param_logical_axes,
                                token_logprobs)

__all__ = ["Decoder", "DecoderOutput", "KVCache", "MoEConfig", "ModelConfig", "check_token_ids",
           "default_positions", "forward", "head_matrix", "init_cache", "init_kind",
           "init_params", "last_token_values", "param_logical_axes", "to_model_config",
           "token_logprobs"]
