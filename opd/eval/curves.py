"""Training-curve metrics of the estimator ablation (docs/DESIGN.md §3, "Curve metrics").

All take per-step curves as 1-D sequences (one value per training step, in
step order) and return plain floats:

* ``loss_fluctuation``: the RMS relative deviation, in %, of the per-step
  loss from its centred moving average over the second half of training;
* ``coefficient_of_variation``: std / |mean| of, e.g., the gradient norm
  over the same span;
* ``final_value``: the mean of the last ``window`` points (a final reward
  that one noisy batch does not decide);
* ``steps_to_reach``: the first step whose trailing ``window``-point mean
  reaches a target, e.g. 90% of a reference run's final reward;
* ``ablation_metrics``: all of them for one run against a reference run,
  read from the trainers' metric histories.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from opd.config.fields import check_float, check_int

__all__ = ["ablation_metrics", "centred_moving_average", "coefficient_of_variation",
           "final_value", "loss_fluctuation", "steps_to_reach"]


def _curve(values, name: str, min_len: int = 1) -> np.ndarray:
  x = np.asarray(values, np.float64)
  if x.ndim != 1 or x.shape[0] < min_len:
    raise ValueError(f"{name} must be a 1-D curve of at least {min_len} points, got shape "
                     f"{x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"{name} holds non-finite values at steps "
                     f"{np.flatnonzero(~np.isfinite(x))[:5].tolist()}")
  return x


def _window(window: int) -> int:
  window = check_int("curves", "window", window, min_value=1)
  if window % 2 == 0:
    raise ValueError(f"window={window} must be odd (a centred average needs a middle point)")
  return window


def _start(n: int, from_fraction: float) -> int:
  f = check_float("curves", "from_fraction", from_fraction, min_value=0.0, max_value=1.0,
                  max_exclusive=True)
  return int(math.floor(f * n))


def centred_moving_average(values, window: int) -> np.ndarray:
  """``m_t = mean(x[t − h .. t + h])``, ``h = (window − 1)/2``, for every t
  with a full window: ``[n − window + 1]`` values, entry i centred on step
  ``i + h``."""
  window = _window(window)
  x = _curve(values, "values", window)
  return np.convolve(x, np.full(window, 1.0 / window), mode="valid")


def loss_fluctuation(losses, window: int = 9, from_fraction: float = 0.5) -> float:
  """RMS relative deviation (%) of the loss from its centred moving average.

  ``100 · sqrt(mean_t ((x_t − m_t) / |m_t|)²)`` over the steps t >=
  ``floor(from_fraction · n)`` that have a full centred window of ``window``
  points (so the last ``h`` steps are left out). A steady trend does not
  count (the average follows it; a linear curve gives 0); step-to-step noise
  does.

  Args:
    losses: ``[n]`` per-step losses.
    window: odd width of the centred moving average, >= 3.
    from_fraction: where the measured span starts (0.5: second half).

  Raises:
    ValueError: a bad curve, an even or too-small window, no step with a full
      window in the span, or a moving average of 0 (relative deviation undefined).
  """
  window = _window(window)
  if window < 3:
    raise ValueError(f"window={window} must be >= 3 (a 1-point average never deviates)")
  x = _curve(losses, "losses", window)
  h, n = window // 2, x.shape[0]
  m = centred_moving_average(x, window)  # m[i] centred on step i + h
  lo = max(_start(n, from_fraction), h)
  hi = n - h  # exclusive
  if lo >= hi:
    raise ValueError(f"losses of {n} steps have no step in [{_start(n, from_fraction)}, {n}) "
                     f"with a full centred window of {window}")
  ma = m[lo - h:hi - h]
  if np.any(ma == 0):
    raise ValueError("the moving average of the loss is 0 somewhere: relative deviation "
                     "is undefined")
  rel = (x[lo:hi] - ma) / np.abs(ma)
  return float(100.0 * np.sqrt(np.mean(rel ** 2)))


def coefficient_of_variation(values, from_fraction: float = 0.5) -> float:
  """``std / |mean|`` (ddof 0) of ``values[floor(from_fraction · n):]``."""
  x = _curve(values, "values")
  x = x[_start(x.shape[0], from_fraction):]
  mean = float(np.mean(x))
  if mean == 0:
    raise ValueError("values have mean 0: the coefficient of variation is undefined")
  return float(np.std(x) / abs(mean))


def final_value(values, window: int = 5) -> float:
  """Mean of the last ``min(window, n)`` points."""
  window = check_int("curves", "window", window, min_value=1)
  x = _curve(values, "values")
  return float(np.mean(x[-window:]))


def steps_to_reach(values, target: float, steps: Sequence[int] | None = None,
                   window: int = 5) -> float | None:
  """The first step at which the trailing ``window``-point mean is >= ``target``.

  Args:
    values: ``[n]`` per-step values (e.g. the mean rollout reward).
    target: the level to reach (e.g. ``0.9 · final_value(reference)``).
    steps: ``[n]`` step numbers of ``values`` (default ``1..n``, the loop's
      1-based numbering).
    window: trailing average width (1: the raw curve); the first ``window − 1``
      steps average what exists so far.

  Returns:
    That step, or None if the curve never gets there.
  """
  window = check_int("curves", "window", window, min_value=1)
  x = _curve(values, "values")
  target = check_float("curves", "target", target)
  s = np.arange(1, x.shape[0] + 1) if steps is None else np.asarray(steps)
  if s.shape != x.shape:
    raise ValueError(f"steps has shape {s.shape}, values {x.shape}")
  c = np.concatenate([[0.0], np.cumsum(x)])
  idx = np.arange(x.shape[0])
  lo = np.maximum(idx + 1 - window, 0)
  trailing = (c[idx + 1] - c[lo]) / (idx + 1 - lo)
  hit = np.flatnonzero(trailing >= target)
  return int(s[hit[0]]) if hit.size else None


def _series(history: Sequence[Mapping[str, float]], key: str) -> tuple[np.ndarray, np.ndarray]:
  rows = [(i + 1 if "step" not in m else m["step"], m[key]) for i, m in enumerate(history)
          if key in m]
  if not rows:
    raise ValueError(f"no step of the history has {key!r}")
  steps, vals = zip(*rows)
  return np.asarray(steps), np.asarray(vals, np.float64)


def ablation_metrics(history: Sequence[Mapping[str, float]],
                     reference: Sequence[Mapping[str, float]] | None = None, *,
                     loss_key: str = "train/loss", grad_key: str = "train/grad_norm",
                     reward_key: str = "reward/mean", time_key: str = "perf/step_time_s",
                     window: int = 9, final_window: int = 5, fraction: float = 0.9
                     ) -> dict[str, float | None]:
  """The ablation table's row for one run (``history``: one metrics dict per step).

  Returns ``loss_fluctuation_pct``, ``grad_norm_cv``, ``final_reward``,
  ``step_time_s`` (mean) and, with a ``reference`` run (the full-vocabulary
  one): ``final_reward_pct_of_reference`` (100 · final / reference final)
  and ``steps_to_{fraction}_of_reference`` (``steps_to_reach`` of
  ``fraction · reference final``; None if never reached). A history entry's
  ``step`` field, if any, numbers it; otherwise entries are steps 1..n.
  """
  fraction = check_float("ablation_metrics", "fraction", fraction, min_value=0.0,
                         min_exclusive=True)
  _, loss = _series(history, loss_key)
  _, grad = _series(history, grad_key)
  steps, reward = _series(history, reward_key)
  out: dict[str, float | None] = {
      "loss_fluctuation_pct": loss_fluctuation(loss, window),
      "grad_norm_cv": coefficient_of_variation(grad),
      "final_reward": final_value(reward, final_window),
  }
  if any(time_key in m for m in history):
    out["step_time_s"] = float(np.mean(_series(history, time_key)[1]))
  if reference is not None:
    ref_final = final_value(_series(reference, reward_key)[1], final_window)
    out["final_reward_pct_of_reference"] = (100.0 * out["final_reward"] / ref_final
                                            if ref_final else None)
    out[f"steps_to_{fraction:g}_of_reference"] = steps_to_reach(
        reward, fraction * ref_final, steps, final_window)
  return out
