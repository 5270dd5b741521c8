"""GRPOConfig (opd/rl/config.py): every field is validated and named in the error."""
import numpy as np
import pytest

from opd.rl.config import GRPOConfig


# Patterns name the field and the value; the wording is opd.config.fields'.
@pytest.mark.parametrize("field,value,match", [
    ("group_size", 1, r"GRPOConfig.group_size must be .*>= 2.*, got 1$"),
    ("group_size", True, r"GRPOConfig.group_size must be .*, got True$"),
    ("clip_eps_low", 1.0, r"GRPOConfig.clip_eps_low must be .*< 1(\.0)?, got 1.0$"),
    ("clip_eps_low", -0.1, r"GRPOConfig.clip_eps_low must be .*>= 0(\.0)?.*, got -0.1$"),
    ("temperature", 0.0, r"GRPOConfig.temperature must be .*> 0(\.0)?, got 0.0$"),
    ("top_p", 0.0, r"GRPOConfig.top_p must be .*> 0(\.0)? and <= 1(\.0)?, got 0.0$"),
    ("loss_aggregation", "mean", r"GRPOConfig.loss_aggregation must be one of .*got 'mean'$"),
    ("kl_coef", float("nan"), r"GRPOConfig.kl_coef must be a finite number >= 0(\.0)?, got nan$"),
    ("scale_advantages_by_std", 1, r"GRPOConfig.scale_advantages_by_std must be .*, got 1$"),
    ("seq_len", 64, r"GRPOConfig.seq_len=64 must be >= max_new_tokens \+ 1 = 65"),
])
def test_config_validation_names_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    GRPOConfig(**{field: value})


def test_numpy_numbers_are_accepted_and_stored_as_python_types():
  cfg = GRPOConfig(group_size=np.int64(4), kl_coef=np.float32(0.5), seq_len=np.int32(128),
                   scale_advantages_by_std=np.bool_(False))
  assert (cfg.group_size, cfg.kl_coef, cfg.seq_len) == (4, 0.5, 128)
  assert type(cfg.group_size) is int and type(cfg.kl_coef) is float
  assert cfg.scale_advantages_by_std is False
  assert cfg == GRPOConfig(group_size=4, kl_coef=0.5, seq_len=128, scale_advantages_by_std=False)
  assert cfg.batch_size == 4 * cfg.prompts_per_step
