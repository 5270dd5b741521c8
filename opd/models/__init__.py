"""One decoder family for student, teachers and reward models (SPEC §2)."""
from opd.models.config import ModelConfig
from opd.models.decoder import (Decoder, DecoderOutput, KVCache, default_positions, forward, init_kind,
                                head_matrix, init_cache, init_params, last_token_values,
                                param_logical_axes, token_logprobs)
