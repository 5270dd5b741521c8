"""Curve metrics of the ablation (opd/eval/curves.py) on synthetic curves with known answers."""
import math

import numpy as np
import pytest

from opd.eval.curves import (ablation_metrics, centred_moving_average, coefficient_of_variation,
                             final_value, loss_fluctuation, steps_to_reach)

# Everything below is float64 arithmetic on O(1) numbers over <= 100 terms:
# rounding stays below 100 · 2⁻⁵² ≈ 2e-14 relative.
RTOL = 1e-12


@pytest.mark.parametrize("window", [3, 5, 9])
def test_alternating_noise_on_a_constant_has_a_closed_form(window):
  # x_t = c (1 + ε s_t), s_t = (−1)^t. The centred window of w = 2h+1 points
  # sums Σ_{k=−h..h} (−1)^{t+k} = (−1)^{t+h}, so m_t = c (1 + ε (−1)^{t+h} / w)
  # and the relative deviation is ε (s_t − (−1)^{t+h}/w) / (1 + ε (−1)^{t+h}/w).
  c, eps, n = 2.5, 0.1, 40
  t = np.arange(n)
  s = (-1.0) ** t
  h = window // 2
  x = c * (1 + eps * s)
  span = t[max(n // 2, h):n - h]
  ma_sign = (-1.0) ** (span + h)
  rel = eps * (s[span] - ma_sign / window) / (1 + eps * ma_sign / window)
  want = 100 * math.sqrt(np.mean(rel ** 2))
  assert loss_fluctuation(x, window) == pytest.approx(want, rel=RTOL)
  # Units: a ±10% wobble is about 10% (± the 1/w the average itself moves).
  assert 100 * eps * (1 - 1 / window) / (1 + eps) < want < 100 * eps * (1 + 1 / window) / (1 - eps)


def test_a_linear_trend_is_not_fluctuation():
  x = 5.0 - 0.01 * np.arange(100)
  assert loss_fluctuation(x, 9) < 1e-10
  x2 = x * (1 + 0.02 * (-1.0) ** np.arange(100))
  assert loss_fluctuation(x2, 9) > 1.0


def test_matches_a_loop_reference_on_a_random_curve():
  rng = np.random.default_rng(0)
  n, w, frac = 57, 7, 0.4
  x = 3.0 * np.exp(-np.arange(n) / 20) + 0.5 + 0.05 * rng.standard_normal(n)
  h = w // 2
  devs = []
  for t in range(max(int(frac * n), h), n - h):
    m = np.mean(x[t - h:t + h + 1])
    devs.append((x[t] - m) / abs(m))
  want = 100 * np.sqrt(np.mean(np.square(devs)))
  assert loss_fluctuation(x, w, from_fraction=frac) == pytest.approx(want, rel=RTOL)
  ma = centred_moving_average(x, w)
  assert ma.shape == (n - w + 1,)
  assert ma[5] == pytest.approx(np.mean(x[5:5 + w]), rel=RTOL)


def test_coefficient_of_variation_over_the_second_half():
  rng = np.random.default_rng(1)
  g = 1.0 + 0.3 * rng.random(31)
  half = g[15:]  # floor(0.5 · 31) = 15
  want = math.sqrt(sum((v - half.mean()) ** 2 for v in half) / len(half)) / half.mean()
  assert coefficient_of_variation(g) == pytest.approx(want, rel=RTOL)
  assert coefficient_of_variation(g, from_fraction=0.0) == pytest.approx(
      np.std(g) / np.mean(g), rel=RTOL)


def test_steps_to_reach_a_saturating_curve():
  # r_t = 1 − exp(−t/τ) at steps t = 1..n reaches a level L first at
  # t* = ceil(−τ ln(1 − L)).
  tau, n = 12.0, 200
  steps = np.arange(1, n + 1)
  r = 1 - np.exp(-steps / tau)
  level = 0.9 * r[-1]
  assert steps_to_reach(r, level, window=1) == math.ceil(-tau * math.log(1 - level))
  assert steps_to_reach(r, 1.5) is None
  # A trailing mean of w points lags the raw curve; reference loop:
  w = 5
  trailing = [np.mean(r[max(0, i + 1 - w):i + 1]) for i in range(n)]
  want = next(int(steps[i]) for i in range(n) if trailing[i] >= level)
  assert steps_to_reach(r, level, window=w) == want
  assert steps_to_reach(r, level, steps=10 * steps, window=w) == 10 * want


def test_ablation_metrics_against_a_reference_run():
  # Reference run: reward 1 − exp(−t/τ); the compared run converges 1.5× slower
  # to 0.8 of it (the seed's token-level picture).
  tau, n = 10.0, 120
  t = np.arange(1, n + 1)
  ref_reward = 1 - np.exp(-t / tau)
  run_reward = 0.8 * (1 - np.exp(-t / (1.5 * tau)))
  loss = 2.0 + 0.1 * (-1.0) ** t
  grad = 1.0 + 0.2 * (t % 2)
  ref = [{"train/loss": 1.0, "train/grad_norm": 1.0, "reward/mean": r} for r in ref_reward]
  run = [{"train/loss": l, "train/grad_norm": g, "reward/mean": r, "perf/step_time_s": 0.5}
         for l, g, r in zip(loss, grad, run_reward)]
  got = ablation_metrics(run, ref, window=3, final_window=1, fraction=0.7)
  assert got["final_reward"] == run_reward[-1]
  assert got["final_reward_pct_of_reference"] == pytest.approx(
      100 * run_reward[-1] / ref_reward[-1], rel=RTOL)
  level = 0.7 * ref_reward[-1]  # the run needs 1 − exp(−t/15) >= level / 0.8
  assert got["steps_to_0.7_of_reference"] == math.ceil(-1.5 * tau * math.log(1 - level / 0.8))
  assert got["grad_norm_cv"] == pytest.approx(np.std(grad[n // 2:]) / np.mean(grad[n // 2:]),
                                              rel=RTOL)
  assert got["loss_fluctuation_pct"] == pytest.approx(loss_fluctuation(loss, 3), rel=RTOL)
  assert got["step_time_s"] == 0.5
  assert "final_reward_pct_of_reference" not in ablation_metrics(run, window=3)


def test_final_value_is_the_mean_of_the_last_points():
  assert final_value([1.0, 2.0, 3.0, 4.0], window=2) == 3.5
  assert final_value([1.0, 2.0], window=5) == 1.5


@pytest.mark.parametrize("call, match", [
    (lambda: loss_fluctuation(np.ones(20), 4), "window=4 must be odd"),
    (lambda: loss_fluctuation(np.ones(20), 1), "window=1 must be >= 3"),
    (lambda: loss_fluctuation(np.ones(6), 5, from_fraction=0.9), "no step"),
    (lambda: loss_fluctuation([1.0, np.nan, 1.0, 1.0, 1.0, 1.0], 3), "non-finite"),
    (lambda: loss_fluctuation(np.zeros((3, 3)), 3), "1-D curve"),
    (lambda: loss_fluctuation(np.zeros(20), 3), "moving average of the loss is 0"),
    (lambda: loss_fluctuation(np.ones(20), 3, from_fraction=1.0), "from_fraction"),
    (lambda: coefficient_of_variation(np.zeros(4)), "mean 0"),
    (lambda: steps_to_reach([1.0, 2.0], 1.0, steps=[1]), "steps has shape"),
    (lambda: ablation_metrics([{"train/loss": 1.0}]), "train/grad_norm"),
])
def test_bad_input_is_refused(call, match):
  with pytest.raises(ValueError, match=match):
    call()
