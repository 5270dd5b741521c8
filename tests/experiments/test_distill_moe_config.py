"""experiments/configs/distill.py:tiny,moe: an MoE math teacher beside a dense instruct one.

The run itself goes through the same code as ``tiny`` (its CLI test); here
the variant's configs: the math teacher's model group builds a
``ModelConfig`` with the ``MOE_TEACHER`` mixture of experts, the instruct
teacher and the student stay dense, and ``moe`` without ``tiny`` is refused.
"""
import pathlib

import pytest

from experiments.configs import distill
from opd.config import overrides as config_utils
from opd.models import MoEConfig, to_model_config

CONFIG = pathlib.Path(distill.__file__)


def test_tiny_moe_variant_builds_an_moe_teacher():
  c = config_utils.load_config(f"{CONFIG}:tiny,moe")
  math = to_model_config(c.teachers.math.model, "config.teachers.math.model")
  assert math.moe == MoEConfig(**distill.MOE_TEACHER)
  assert math.n_layers > math.moe.first_k_dense  # at least one MoE layer
  assert to_model_config(c.teachers.instruct.model).moe is None
  assert to_model_config(c.student.model).moe is None
  plain = config_utils.load_config(f"{CONFIG}:tiny")
  assert to_model_config(plain.teachers.math.model).moe is None


def test_moe_needs_tiny():
  with pytest.raises(ValueError, match="config arg moe needs tiny"):
    config_utils.load_config(f"{CONFIG}:moe")
