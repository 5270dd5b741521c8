"""Bootstrap standard errors against an independent numpy loop and the
binomial formula."""
import math

import numpy as np
import pytest

from opd.eval import stats


# --- bootstrap ---------------------------------------------------------------

def _loop_bootstrap(values, B, seed):
  """Independent reference: one resample at a time, the mean of every value
  of the drawn examples (all samples of a drawn example included)."""
  values = np.asarray(values, np.float64)
  rows = values.reshape(len(values), -1)
  rng = np.random.default_rng(seed)
  means = []
  for _ in range(B):
    idx = rng.integers(0, len(rows), size=len(rows))
    means.append(rows[idx].ravel().mean())
  m = np.asarray(means)
  return math.sqrt(((m - m.mean()) ** 2).sum() / (B - 1))


@pytest.mark.parametrize("shape,B", [((37,), 500), ((23, 4), 300), ((3000,), 1500)],
                         ids=lambda x: str(x))
def test_bootstrap_se_matches_numpy_loop(shape, B):
  """Same seed, same resamples: equal to 1e-12. (3000,) x 1500 crosses the
  4M-index block boundary, so the blocked draw must continue the stream."""
  x = np.random.default_rng(1).random(shape)
  seed = stats.bootstrap_seed(5, "math")
  assert stats.bootstrap_se(x, B, seed) == pytest.approx(_loop_bootstrap(x, B, seed), rel=1e-12)


@pytest.mark.parametrize("n,k", [(50, 17), (200, 20)])
def test_bootstrap_se_matches_binomial(n, k):
  """For 0/1 values the bootstrap SE estimates sqrt(p(1-p)/n) (plug-in p).

  Monte Carlo error: each resample mean is (Binomial(n, p) / n); the sample
  variance of B of them has relative standard error sqrt(2 / (B - 1) +
  kappa / B), kappa = (1 - 6 p (1 - p)) / (n p (1 - p)) its excess kurtosis,
  and the SE (a square root) half of that: ~0.36% at B = 40000. We allow 5
  such standard errors (a false failure about once in 1.7 million seeds);
  resampling without replacement (SE 0) or resamples of the wrong size
  (n / 2: +41%) fall far outside.
  """
  x = np.zeros(n)
  x[np.random.default_rng(n).choice(n, k, replace=False)] = 1.0
  p, B = k / n, 40_000
  kappa = (1 - 6 * p * (1 - p)) / (n * p * (1 - p))
  mc_rel_se = 0.5 * math.sqrt(2 / (B - 1) + kappa / B)
  assert stats.bootstrap_se(x, B, 0) == pytest.approx(math.sqrt(p * (1 - p) / n),
                                                      rel=5 * mc_rel_se)


def test_bootstrap_se_rejects_bad_input():
  with pytest.raises(ValueError, match="shape"):
    stats.bootstrap_se(np.zeros((2, 2, 2)), 10, 0)
  with pytest.raises(ValueError, match="shape"):
    stats.bootstrap_se([], 10, 0)
  with pytest.raises(ValueError, match="num_resamples"):
    stats.bootstrap_se([1.0, 0.0], 1, 0)




@pytest.mark.parametrize("shape", [(31,), (19, 4)], ids=str)
def test_paired_difference_is_the_bootstrap_of_per_example_differences(shape):
  """Reference: the per-example differences of row means, resampled one at a
  time by ``_loop_bootstrap``. With a shared per-example difficulty the paired
  SE is below the two unpaired SEs in quadrature."""
  rng = np.random.default_rng(4)
  hard = rng.random(shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
  a = np.clip(hard + 0.1 * rng.standard_normal(shape), 0, 1)
  b = np.clip(hard - 0.05 + 0.1 * rng.standard_normal(shape), 0, 1)
  d = (a - b).reshape(shape[0], -1).mean(axis=1)
  value, se = stats.paired_difference(a, b, 400, 9)
  assert value == pytest.approx(d.mean(), rel=1e-12)
  assert se == pytest.approx(_loop_bootstrap(d, 400, 9), rel=1e-12)
  assert se < math.hypot(stats.bootstrap_se(a, 400, 9), stats.bootstrap_se(b, 400, 9))
  with pytest.raises(ValueError, match="shapes"):
    stats.paired_difference(a, b[:-1], 400, 9)


def test_estimate_scales_mean_and_se_to_percent():
  x = np.random.default_rng(0).random((7, 3))
  e = stats.estimate(x, 30, (1, 2))
  assert e.value == pytest.approx(100 * x.mean(), abs=1e-12)
  assert e.se == pytest.approx(100 * _loop_bootstrap(x, 30, (1, 2)), abs=1e-9)
  assert str(stats.Estimate(12.345, 0.96)) == "12.3 ± 1.0"


def test_bootstrap_seed_depends_on_domain_not_model():
  assert stats.bootstrap_seed(3, "math") == stats.bootstrap_seed(3, "math")
  assert stats.bootstrap_seed(3, "math") != stats.bootstrap_seed(3, "code")
  assert stats.bootstrap_seed(3, "math") != stats.bootstrap_seed(4, "math")


# --- ratio of means (delta method) --------------------------------------------

@pytest.mark.parametrize("shape", [(40,), (25, 4)], ids=str)
def test_ratio_estimate_matches_the_covariance_form(shape):
  """The residual form equals the textbook delta-method variance
  (s_aa - 2R s_ab + R^2 s_bb) / (n b^2) from numpy's sample covariance; both
  are float64 sums of <= 100 terms of size ~1, so they agree to ~1e-14."""
  rng = np.random.default_rng(3)
  b = rng.random(shape)
  a = 0.6 * b + 0.3 * rng.random(shape)  # correlated with b, as a student with its teacher
  am, bm = (v.mean(axis=1) if v.ndim == 2 else v for v in (a, b))
  r = am.mean() / bm.mean()
  cov = np.cov(am, bm, ddof=1)
  se = math.sqrt((cov[0, 0] - 2 * r * cov[0, 1] + r * r * cov[1, 1]) / len(am)) / bm.mean()
  got = stats.ratio_estimate(a, b)
  assert got[0] == pytest.approx(r, rel=1e-12) and got[1] == pytest.approx(se, rel=1e-10)


def test_ratio_estimate_se_is_the_spread_over_repeated_datasets():
  """Over M = 4000 simulated datasets of n = 300 correlated 0/1 pairs, the std of
  R matches the mean delta-method SE. The std of M draws has relative SE
  1/sqrt(2M) = 1.1%, and the delta method's O(1/n) bias is < 1% here: 5% is
  > 4 SEs."""
  rng = np.random.default_rng(0)
  M, n = 4000, 300
  difficulty = rng.random((M, n))
  teacher = (rng.random((M, n)) < 0.3 + 0.6 * difficulty).astype(float)
  student = (rng.random((M, n)) < 0.2 + 0.5 * difficulty).astype(float)
  ratios = student.mean(1) / teacher.mean(1)
  ses = [stats.ratio_estimate(s, t)[1] for s, t in zip(student[:400], teacher[:400])]
  assert np.mean(ses) == pytest.approx(ratios.std(ddof=1), rel=0.05)


def test_ratio_estimate_rejects_bad_input():
  with pytest.raises(ValueError, match="mean\\(den\\) is 0"):
    stats.ratio_estimate([1.0, 0.0], [0.0, 0.0])
  with pytest.raises(ValueError, match="num has 3 examples, den 2"):
    stats.ratio_estimate([1.0, 0.0, 1.0], [1.0, 1.0])
  with pytest.raises(ValueError, match="den must be finite"):
    stats.ratio_estimate([1.0, 0.0], [1.0, np.nan])
