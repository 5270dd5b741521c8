"""Bootstrap statistics of evaluation scores (docs/DESIGN.md §10).

Every score is a mean over examples with a bootstrap standard error:
examples are resampled with replacement (an example's N samples stay
together, so the SE reflects the spread between problems, not only sampling
noise), and the SE is the standard deviation of the resampled means.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from opd.config.fields import check_int


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A mean and its bootstrap standard error, both on the 0-100 scale."""
  value: float
  se: float

  def __str__(self) -> str:
    return f"{self.value:.1f} ± {self.se:.1f}"


def bootstrap_seed(seed: int, domain: str) -> tuple[int, int]:
  """The ``np.random.default_rng`` seed of a domain's resamples. It does not
  depend on the model, so models are compared on the same resamples."""
  return (int(seed), zlib.crc32(domain.encode()))


def bootstrap_se(values, num_resamples: int, seed) -> float:
  """Bootstrap standard error of the mean over examples.

  Args:
    values: ``[n]`` one value per example, or ``[n, N]`` N values per
      example that are resampled together (the row mean is the example's
      value).
    num_resamples: B >= 2 resamples of n examples drawn with replacement.
    seed: anything ``np.random.default_rng`` takes; resample b uses the
      b-th row of ``rng.integers(0, n, size=(B, n))``.

  Returns:
    The standard deviation (ddof=1) of the B resampled means, in the units
    of ``values``.
  """
  x = np.asarray(values, np.float64)
  if x.ndim not in (1, 2) or x.shape[0] == 0 or x.size == 0:
    raise ValueError(f"values must be a non-empty [n] or [n, N] array, got shape {x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError("values must be finite")
  num_resamples = check_int("bootstrap_se", "num_resamples", num_resamples, min_value=2)
  if x.ndim == 2:
    x = x.mean(axis=1)
  n = x.shape[0]
  rng = np.random.default_rng(seed)
  # Blocks bound memory (B * n indices); rows come off the stream in order.
  rows = max(1, (1 << 22) // n)
  means = np.concatenate([x[rng.integers(0, n, size=(min(rows, num_resamples - b), n))].mean(1)
                          for b in range(0, num_resamples, rows)])
  return float(means.std(ddof=1))


def estimate(values, num_resamples: int, seed) -> Estimate:
  """``Estimate`` of the mean of ``values`` in [0, 1] (``bootstrap_se``'s
  shapes), both scaled to 0-100."""
  return Estimate(100.0 * float(np.mean(values)), 100.0 * bootstrap_se(values, num_resamples, seed))


def paired_difference(a, b, num_resamples: int, seed) -> tuple[float, float]:
  """``mean(a − b)`` of two models' scores on the same examples, with the
  bootstrap SE of the per-example differences (``bootstrap_se``): tighter
  than two SEs in quadrature when the examples' difficulty is shared.

  Args:
    a, b: ``[n]`` or ``[n, N]`` (an example's N samples; row means are
      differenced), the same shape, row i the same example in both.
    num_resamples, seed: as ``bootstrap_se``.

  Returns:
    ``(mean difference, SE)`` in the units of the values.
  """
  x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if x.shape != y.shape:
    raise ValueError(f"paired_difference: shapes {x.shape} and {y.shape} differ (the same "
                     "examples, in the same order, are needed)")
  d = x - y
  if d.ndim == 2:
    d = d.mean(axis=1)
  return float(d.mean()), bootstrap_se(d, num_resamples, seed)


def ratio_estimate(num, den) -> tuple[float, float]:
  """``R = mean(num) / mean(den)`` over the same examples, with its delta-method SE.

  Both means move together when the examples' difficulty is shared (a
  student and its teacher, a model's sampled and greedy scores), so the SE
  uses the per-example residuals ``r_i = num_i − R · den_i``:
  ``SE = sqrt(Σ r_i² / (n (n − 1))) / |mean(den)|`` (first-order Taylor
  expansion of the ratio of means; equal to
  ``sqrt((s_aa − 2R s_ab + R² s_bb) / n) / |b̄|`` with sample (co)variances).

  Args:
    num, den: ``[n]`` or ``[n, N]`` (an example's N values; row means are
      used), row i the same example in both; n >= 2.

  Returns:
    ``(R, SE)``, unitless.

  Raises:
    ValueError: different numbers of examples, n < 2, non-finite values or
      ``mean(den) == 0`` (the ratio is undefined).
  """
  a, b = (_example_means(v, name) for v, name in ((num, "num"), (den, "den")))
  if a.shape != b.shape or a.shape[0] < 2:
    raise ValueError(f"ratio_estimate: num has {a.shape[0]} examples, den {b.shape[0]}; "
                     "the same examples (>= 2), in the same order, are needed")
  mean_b = float(b.mean())
  if mean_b == 0:
    raise ValueError("ratio_estimate: mean(den) is 0, the ratio is undefined")
  r = float(a.mean()) / mean_b
  n = a.shape[0]
  resid = a - r * b
  return r, float(np.sqrt(np.sum(resid ** 2) / (n * (n - 1))) / abs(mean_b))


def _example_means(values, name: str) -> np.ndarray:
  """``[n]`` per-example values of ``[n]`` or ``[n, N]`` (row means)."""
  x = np.asarray(values, np.float64)
  if x.ndim not in (1, 2) or x.size == 0:
    raise ValueError(f"{name} must be a non-empty [n] or [n, N] array, got shape {x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"{name} must be finite")
  return x.mean(axis=1) if x.ndim == 2 else x
