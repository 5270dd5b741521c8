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


def test_pooled_pairs_average_each_examples_differences_over_the_pairs(tmp_path):
  """``--mean``: per example the mean over the pairs of A − B, its bootstrap SE
  over the examples, and the pairs' own averages' spread, against numpy."""
  rng = np.random.default_rng(3)
  pairs = [(_result(f"student: OPD#{s}", rng), _result("baseline: mixed RL", rng))
           for s in range(3)]
  for s, (a, b) in enumerate(pairs):
    _save(tmp_path / f"a{s}", [a])
    _save(tmp_path / f"b{s}", [b])
  paired_diff._rows.cache_clear()
  specs = [x for s in range(3) for x in (f"{tmp_path / f'a{s}'}:student: OPD#{s}",
                                          f"{tmp_path / f'b{s}'}:baseline: mixed RL")]
  got = paired_diff.compare_pooled(
      [(paired_diff.row(a), paired_diff.row(b)) for a, b in zip(specs[::2], specs[1::2])],
      "reward@1")
  sampled = paired_diff.compare_pooled(pairs, "mean@4")
  for d in DOMAINS:
    per_example = np.mean([np.subtract(a.domains[d].greedy_rewards, b.domains[d].greedy_rewards)
                           for a, b in pairs], axis=0)
    assert got["domains"][d][0] == pytest.approx(100 * per_example.mean(), abs=1e-9)
    assert got["domains"][d][1] == pytest.approx(
        100 * per_example.std() / math.sqrt(len(per_example)), rel=0.15)
    per_sampled = np.mean([np.subtract(a.domains[d].sampled_rewards,
                                       b.domains[d].sampled_rewards).mean(1) for a, b in pairs],
                          axis=0)
    assert sampled["domains"][d][0] == pytest.approx(100 * per_sampled.mean(), abs=1e-9)
  own = [np.mean([100 * np.mean(np.subtract(a.domains[d].greedy_rewards,
                                            b.domains[d].greedy_rewards)) for d in DOMAINS])
         for a, b in pairs]
  assert got["average"][0] == pytest.approx(np.mean(own), abs=1e-9)
  assert got["spread"] == pytest.approx(np.std(own, ddof=1), abs=1e-9)
  text = paired_diff.main(["--mean", *specs])
  assert f"mean of the 3 pairs: greedy {got['average'][0]:+.1f} ± {got['average'][1]:.1f}" in text
  # a pair on other examples is refused
  other = _result("x", rng, n=41)
  with pytest.raises(ValueError, match="other math examples"):
    paired_diff.compare_pooled([pairs[0], (other, pairs[0][1])], "reward@1")
