"""EvalConfig validation and the metric names it implies."""
import re

import numpy as np
import pytest

from opd.eval.results import GREEDY_METRICS, EvalConfig


# --- config -------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("domains", ("math", "poetry")), ("domains", ()), ("domains", "math"),
    ("domains", ("math", "math")), ("n_per_domain", 0), ("n_per_domain", 2.5),
    ("difficulty", 4), ("seed", -1), ("num_samples", -1), ("temperature", 0.0),
    ("top_p", 1.5), ("max_new_tokens", 0), ("bootstrap_samples", 1), ("batch_size", 0),
    ("prompt_bucket", 0), ("solved_threshold", 0.0), ("greedy", 1),
])
def test_config_rejects(field, value):
  with pytest.raises(ValueError, match=rf"(?s)EvalConfig\.{field}\b.*{re.escape(repr(value))}"):
    EvalConfig(**{field: value})


def test_config_nothing_to_do():
  with pytest.raises(ValueError, match="nothing to evaluate"):
    EvalConfig(greedy=False, num_samples=0)


def test_config_error_names_unknown_domain():
  with pytest.raises(ValueError, match="'poetry'"):
    EvalConfig(domains=("math", "poetry"))


def test_config_accepts_numpy_numbers_and_names_metrics():
  """numpy scalars are as good as literals and are stored as Python types."""
  cfg = EvalConfig(domains=["math"], n_per_domain=np.int64(3), num_samples=np.int32(2),
                   temperature=np.float32(0.5), greedy=np.bool_(True))
  assert cfg == EvalConfig(domains=("math",), n_per_domain=3, num_samples=2, temperature=0.5)
  assert type(cfg.n_per_domain) is int and type(cfg.temperature) is float
  assert cfg.metrics == GREEDY_METRICS + ("mean@2", "solved@2", "format@2")
  assert EvalConfig(num_samples=0).metrics == GREEDY_METRICS

