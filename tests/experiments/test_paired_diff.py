"""``experiments.paired_diff``: paired differences of two rows in different
workdirs, against a numpy computation of the same per-example differences."""
import json
import math

import numpy as np
import pytest

from experiments import paired_diff
from opd.eval.results import DomainResult, EvalConfig, EvalResult, Estimate

DOMAINS = ("math", "code")


def _result(name, rng, n=40, samples=4):
  domains = {}
  for d in DOMAINS:
    greedy = rng.integers(0, 2, n).astype(float).tolist()
    sampled = rng.integers(0, 2, (n, samples)).astype(float).tolist()
    domains[d] = DomainResult(d, {"reward@1": Estimate(100 * float(np.mean(greedy)), 0.0)},
                              [f"{d}-{i}" for i in range(n)], greedy, [1.0] * n, sampled,
                              [[1.0] * samples] * n, {}, [])
  return EvalResult(name, EvalConfig(domains=DOMAINS, num_samples=samples), domains, {})


def _save(workdir, results):
  (workdir / "v4").mkdir(parents=True)
  (workdir / "v4" / "results.json").write_text(
      json.dumps({"scale": "0-100", "results": [r.to_dict() for r in results]}))


def test_differences_across_workdirs_match_numpy(tmp_path):
  rng = np.random.default_rng(0)
  a, b = _result("student: OPD#0", rng), _result("baseline: mixed RL", rng)
  _save(tmp_path / "one", [a])
  _save(tmp_path / "two", [b])
  paired_diff._rows.cache_clear()
  got_a = paired_diff.row(f"{tmp_path / 'one'}:student: OPD#0")
  got_b = paired_diff.row(f"{tmp_path / 'two'}:baseline: mixed RL")
  g = paired_diff.compare(got_a, got_b, "reward@1")
  m = paired_diff.compare(got_a, got_b, "mean@4")
  for d in DOMAINS:
    dg = np.subtract(a.domains[d].greedy_rewards, b.domains[d].greedy_rewards)
    ds = np.subtract(a.domains[d].sampled_rewards, b.domains[d].sampled_rewards).mean(1)
    assert g["domains"][d][0] == pytest.approx(100 * dg.mean(), abs=1e-9)
    assert m["domains"][d][0] == pytest.approx(100 * ds.mean(), abs=1e-9)
    # the bootstrap SE of a mean: close to the plug-in SE std/sqrt(n) (1000
    # resamples: within 15% of it)
    assert g["domains"][d][1] == pytest.approx(100 * dg.std() / math.sqrt(len(dg)), rel=0.15)
  assert g["average"][0] == pytest.approx(np.mean([g["domains"][d][0] for d in DOMAINS]))
  assert g["average"][1] == pytest.approx(
      math.sqrt(sum(g["domains"][d][1] ** 2 for d in DOMAINS)) / len(DOMAINS))
  text = paired_diff.main([f"{tmp_path / 'one'}:student: OPD#0",
                           f"{tmp_path / 'two'}:baseline: mixed RL"])
  assert f"greedy {g['average'][0]:+.1f} ± {g['average'][1]:.1f}" in text


def test_bad_arguments_name_what_is_missing(tmp_path):
  paired_diff._rows.cache_clear()
  with pytest.raises(ValueError, match="is not WORKDIR:ROW"):
    paired_diff.row("no-colon")
  with pytest.raises(ValueError, match="no results.json under"):
    paired_diff.row(f"{tmp_path}:x")
  _save(tmp_path / "w", [_result("a", np.random.default_rng(1))])
  with pytest.raises(ValueError, match=r"no row 'b' in .*rows: \['a'\]"):
    paired_diff.row(f"{tmp_path / 'w'}:b")
