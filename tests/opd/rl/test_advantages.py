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
  rewards[3] = [0.5, 0.5 + 3e-6, 0.5, 0.5 - 1e-6]  # near-equal: std ~ eps, A ~ 1
  eps = 1e-6
  got = group_advantages(rewards, scale_by_std=scale, eps=eps)
  assert got.shape == (5, 4) and got.dtype == np.float32
  want = _advantages_reference(rewards, scale, eps)
  # Both sides compute in float64 (the mean and std in another order): r - mean
  # is off by ~G eps64 max|r|, amplified by 1 / (std + eps) when scaled, which
  # is large for a near-equal group. Then got is rounded once to float32:
  # at most half an ulp, rtol = eps32 / 2.
  G, eps64 = rewards.shape[1], np.finfo(np.float64).eps
  spread = rewards.std(axis=1, keepdims=True) + eps if scale else 1.0
  atol = 4 * G * eps64 * np.abs(rewards).max(axis=1, keepdims=True) / spread
  err = np.abs(got - want) - np.finfo(np.float32).eps / 2 * np.abs(want)
  assert np.all(err <= atol), (got, want, atol)
  assert np.all(got[1] == 0.0)
  assert np.all(np.isfinite(group_advantages(np.zeros((3, 2)), scale_by_std=scale, eps=0.0)))


def test_group_advantages_reject_bad_input():
  with pytest.raises(ValueError, match=r"\[P, G\].*\(6,\)"):
    group_advantages(np.zeros(6))
  with pytest.raises(ValueError, match="finite"):
    group_advantages(np.array([[0.0, np.nan]]))
  with pytest.raises(ValueError, match=r"group_advantages.eps must be .*>= 0(\.0)?, got -1e-06"):
    group_advantages(np.zeros((2, 2)), eps=-1e-6)
