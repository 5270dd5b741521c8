"""Group-relative advantages (opd/rl/advantages.py) against a plain-python reference."""
import numpy as np
import pytest

from opd.rl.advantages import group_advantages


def _advantages_reference(rewards, scale, eps):
  out = np.zeros_like(rewards, dtype=np.float64)
  for p, row in enumerate(rewards):
    mean = sum(row) / len(row)
    std = (sum((x - mean) ** 2 for x in row) / len(row)) ** 0.5
    for g, x in enumerate(row):
      if max(row) == min(row):
        out[p, g] = 0.0
      else:
        out[p, g] = (x - mean) / (std + eps) if scale else x - mean
  return out


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_numpy(scale):
  rng = np.random.default_rng(0)
  rewards = rng.random((5, 4))
  rewards[1] = 0.1  # all equal: mean is not exactly 0.1 in float, must still give 0
  rewards[2] = [1.0, 0.0, 0.0, 0.0]
  got = group_advantages(rewards, scale_by_std=scale, eps=1e-6)
  assert got.shape == (5, 4) and got.dtype == np.float32
  np.testing.assert_allclose(got, _advantages_reference(rewards, scale, 1e-6), rtol=1e-6,
                             atol=1e-7)
  assert np.all(got[1] == 0.0)
  assert np.all(np.isfinite(group_advantages(np.zeros((3, 2)), scale_by_std=scale, eps=0.0)))


def test_group_advantages_reject_bad_input():
  with pytest.raises(ValueError, match=r"\[P, G\].*\(6,\)"):
    group_advantages(np.zeros(6))
  with pytest.raises(ValueError, match="finite"):
    group_advantages(np.array([[0.0, np.nan]]))
  with pytest.raises(ValueError, match=r"group_advantages.eps must be .*>= 0(\.0)?, got -1e-06"):
    group_advantages(np.zeros((2, 2)), eps=-1e-6)
