"""experiments/v4_report.py: the V4 tables from evaluation results, against numpy."""
import math

import numpy as np
import pytest

from experiments import v4_report
from opd.eval.results import DomainResult, EvalConfig, EvalResult
from opd.eval.stats import Estimate

DOMAINS = ("math", "code", "instruct")


def _result(name, scores, ses, sampled=None):
  """An EvalResult with reward@1 = scores[d] ± ses[d] and mean@2 = sampled[d] ± 1."""
  sampled = scores if sampled is None else sampled
  domains = {d: DomainResult(d, {"reward@1": Estimate(float(scores[i]), float(ses[i])),
                                 "mean@2": Estimate(float(sampled[i]), 1.0)},
                             [], None, None, None, None, {}, [])
             for i, d in enumerate(DOMAINS)}
  return EvalResult(name, EvalConfig(domains=DOMAINS, num_samples=2), domains, {})


@pytest.fixture
def results():
  rng = np.random.default_rng(0)
  out = [_result("base", [10, 5, 20], [2, 1, 3])]
  out += [_result(f"{d}-specialist", np.full(3, 50.0) + 10 * (np.arange(3) == i), [4, 4, 4])
          for i, d in enumerate(DOMAINS)]
  for seed in range(3):
    out.append(_result(f"student: OPD + annealing#{seed}", rng.uniform(20, 60, 3), [3, 3, 3]))
    out.append(_result(f"student: OPD#{seed}", rng.uniform(20, 60, 3), [3, 3, 3]))
  out.append(_result("baseline: mixed RL", [30, 25, 35], [5, 6, 7]))
  return out


def test_single_runs_keep_bootstrap_se_and_average_in_quadrature(results):
  s = v4_report.summarize(results, DOMAINS, "reward@1", "mean@2")
  cells = s["table"]["reward@1"]["baseline: mixed RL"]
  assert cells["code"] == (25.0, 6.0)
  assert cells[v4_report.AVG][0] == pytest.approx(np.mean([30, 25, 35]))
  assert cells[v4_report.AVG][1] == pytest.approx(math.sqrt(25 + 36 + 49) / 3)


def test_seeds_fold_into_mean_and_std_across_seeds(results):
  s = v4_report.summarize(results, DOMAINS, "reward@1", "mean@2")
  runs = [r for r in results if r.name.startswith("student: OPD + annealing#")]
  x = np.array([[r.score(d, "reward@1").value for d in DOMAINS] for r in runs])
  row = s["table"]["reward@1"][v4_report.FINAL]
  for i, d in enumerate(DOMAINS):
    assert row[d] == pytest.approx((x[:, i].mean(), x[:, i].std(ddof=1)))
  assert row[v4_report.AVG] == pytest.approx((x.mean(1).mean(), x.mean(1).std(ddof=1)))
  assert s["seeds"][v4_report.FINAL] == 3 and s["seeds"]["base"] == 1


def test_retention_and_margins(results):
  s = v4_report.summarize(results, DOMAINS, "reward@1", "mean@2")
  main = s["table"]["reward@1"]
  for d in DOMAINS:
    spec = [r for r in results if r.name == f"{d}-specialist"][0].score(d, "reward@1").value
    assert spec == 60.0
    assert s["retention"][d] == pytest.approx(100 * main[v4_report.FINAL][d][0] / spec)
    assert s["retention_opd"][d] == pytest.approx(100 * main[v4_report.STUDENT_ROWS["opd"]][d][0]
                                                  / spec)
  final, rl = main[v4_report.FINAL][v4_report.AVG], main["baseline: mixed RL"][v4_report.AVG]
  assert s["opd_minus"]["baseline: mixed RL"] == pytest.approx(
      (final[0] - rl[0], math.hypot(final[1], rl[1])))
  assert v4_report.FINAL not in s["opd_minus"]


def test_row_order_and_report(results, tmp_path):
  s = v4_report.summarize(results, DOMAINS, "reward@1", "mean@2")
  assert list(s["table"]["reward@1"]) == [
      "base", "code-specialist", "instruct-specialist", "math-specialist", "student: OPD",
      "student: OPD + annealing", "baseline: mixed RL"]
  text = v4_report.render(s)
  assert "| student: OPD + annealing (3 seeds) |" in text and "retention" in text
  assert "mean@2" in text
  path = v4_report.heatmap(s, tmp_path / "h.png", "reward@1")
  assert (tmp_path / "h.png").stat().st_size > 0 and path.endswith("h.png")
