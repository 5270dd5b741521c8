"""The V4 claims' metrics (opd/eval/claims.py) against numpy references: sampler
quality and retention as paired ratios, steps to 90% against a dense
piecewise-linear search, and the per-domain fluctuation against a loop, with
a mixed-domain curve whose batch-level fluctuation the mix dominates."""
import math

import numpy as np
import pytest

from opd.eval import claims, curves
from opd.eval.results import DomainResult


def _result(domain, ids, greedy=None, sampled=None):
  return DomainResult(domain, {}, list(ids), greedy, None, sampled, None, {}, [])


def _delta_ratio(a, b):
  """Independent reference: R and the delta-method SE from numpy's covariance."""
  a, b = np.asarray(a, float), np.asarray(b, float)
  r = a.mean() / b.mean()
  c = np.cov(a, b, ddof=1)
  return r, math.sqrt((c[0, 0] - 2 * r * c[0, 1] + r * r * c[1, 1]) / len(a)) / b.mean()


def test_sampler_quality_is_mean_at_n_over_greedy_paired():
  rng = np.random.default_rng(0)
  greedy = (rng.random(30) < 0.7).astype(float).tolist()
  sampled = (rng.random((30, 4)) < 0.5).astype(float).tolist()
  got = claims.sampler_quality(_result("math", range(30), greedy, sampled))
  want = _delta_ratio(np.mean(sampled, axis=1), greedy)
  np.testing.assert_allclose(got, want, rtol=1e-10)  # float64 sums of 30 terms
  with pytest.raises(ValueError, match=r"result \(math\) has no sampled pass"):
    claims.sampler_quality(_result("math", range(30), greedy, None))


def test_retention_pairs_student_and_teacher_examples():
  rng = np.random.default_rng(1)
  ids = [f"e{i}" for i in range(40)]
  teacher = rng.random(40)
  student = np.clip(teacher - 0.2 * rng.random(40), 0, 1)
  got = claims.retention(_result("code", ids, student.tolist()), _result("code", ids,
                                                                         teacher.tolist()))
  np.testing.assert_allclose(got, _delta_ratio(student, teacher), rtol=1e-10)
  # Pairing matters: the SE is far below the unpaired one (two SEs in quadrature).
  unpaired = got[0] * math.hypot(student.std(ddof=1) / student.mean(),
                                 teacher.std(ddof=1) / teacher.mean()) / math.sqrt(40)
  assert got[1] < 0.5 * unpaired
  with pytest.raises(ValueError, match="same examples"):
    claims.retention(_result("code", ids[::-1], student.tolist()),
                     _result("code", ids, teacher.tolist()))
  with pytest.raises(ValueError, match=r"teacher \(code\) has no sampled pass"):
    claims.retention(_result("code", ids, student.tolist(), [[1.0]] * 40),
                     _result("code", ids, teacher.tolist()), mode="sampled")


def _dense_crossing(steps, scores, level):
  """Brute force: walk the piecewise-linear curve on a fine grid (1e-4 of a step)."""
  grid = np.arange(steps[0], steps[-1] + 1e-9, 1e-4)
  line = np.interp(grid, steps, scores)
  hit = np.flatnonzero(line >= level)
  return float(grid[hit[0]]) if hit.size else None


@pytest.mark.parametrize("scores", [
    [10, 30, 20, 50, 60, 80],   # crosses 0.9*60=54 between 50 and 60
    [10, 60, 40, 70, 80, 90],   # crosses early, dips, crosses again: the first counts
    [55, 10, 20, 30, 40, 50],   # already there at the first evaluation
    [10, 20, 30, 40, 50, 53],   # never
], ids=["late", "first-of-two", "at-start", "never"])
def test_steps_to_fraction_is_the_first_interpolated_crossing(scores):
  steps = [0, 20, 40, 60, 80, 100]
  got = claims.steps_to_fraction(steps, scores, target=60.0, fraction=0.9)
  want = _dense_crossing(np.asarray(steps, float), np.asarray(scores, float), 54.0)
  if want is None:
    assert got is None
  else:
    assert got == pytest.approx(want, abs=2e-4)  # the grid's spacing
    first = int(np.flatnonzero(np.asarray(scores) >= 54.0)[0])
    assert claims.steps_to_fraction(steps, scores, 60.0, interpolate=False) == steps[first]


def test_steps_to_fraction_rejects_bad_curves():
  with pytest.raises(ValueError, match="strictly increasing"):
    claims.steps_to_fraction([0, 10, 10], [1, 2, 3], 3.0)
  with pytest.raises(ValueError, match="fraction"):
    claims.steps_to_fraction([0, 10], [1, 2], 3.0, fraction=1.5)
  with pytest.raises(ValueError, match="equal non-empty"):
    claims.steps_to_fraction([0, 10], [1, 2, 3], 3.0)


def _loop_fluctuation(x, from_fraction):
  """Independent reference: a plain loop over the finite values of the span."""
  vals = [v for v in x[int(from_fraction * len(x)):] if not math.isnan(v)]
  d = [vals[i + 1] - vals[i] for i in range(len(vals) - 1)]
  md = sum(d) / len(d)
  sd = math.sqrt(sum((e - md) ** 2 for e in d) / (len(d) - 1))
  return 100 * sd / math.sqrt(2) / (sum(abs(v) for v in vals) / len(vals))


def test_domain_fluctuation_matches_a_loop_and_skips_absent_steps():
  rng = np.random.default_rng(2)
  per = {"math": 2 + 0.1 * rng.standard_normal(60), "code": 0.5 + 0.05 * rng.standard_normal(60)}
  per["code"][rng.random(60) < 0.3] = np.nan  # steps whose batch held no code row
  mean, each = claims.domain_fluctuation(per, from_fraction=0.25)
  for d, x in per.items():
    assert each[d] == pytest.approx(_loop_fluctuation(x, 0.25), rel=1e-10)
  assert mean == pytest.approx(np.mean(list(each.values())), rel=1e-12)
  # A steady trend is not fluctuation.
  assert claims.domain_fluctuation({"a": np.linspace(3, 1, 50)})[0] == pytest.approx(0, abs=1e-9)
  with pytest.raises(ValueError, match="domain 'a' has 2 losses"):
    claims.domain_fluctuation({"a": [1.0, np.nan, 2.0, 3.0]})


def test_the_domain_mix_does_not_dominate():
  """Two domains at losses 2.0 and 0.5, each with 5% independent noise per step;
  each batch holds Binomial(8, 1/2) rows of the first. The batch-mean loss
  fluctuates by ~20% (the mix), the per-domain measure recovers the 5%.
  Tolerance: 200 differences per domain estimate sigma with relative SE
  ~sqrt(3/2 / 200) = 9% (differences of white noise are MA(1)), 6% for the
  two-domain mean: 0.3 points; 1 point is > 3 SEs."""
  rng = np.random.default_rng(4)
  n, levels = 400, {"math": 2.0, "writing": 0.5}
  per = {d: lv * (1 + 0.05 * rng.standard_normal(n)) for d, lv in levels.items()}
  share = rng.binomial(8, 0.5, n) / 8
  mixed = share * per["math"] + (1 - share) * per["writing"]
  assert curves.loss_fluctuation(mixed, window=9) > 10
  mean, _ = claims.domain_fluctuation(per)
  assert mean == pytest.approx(5.0, abs=1.0)
