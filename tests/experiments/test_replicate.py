"""``experiments.replicate``'s budget: every run has one, the replication fits
the issue's 3 hours, and the dry run prints each run's budget and their sum.
(Each run's config and overrides are checked in test_job_checks.py.)"""
import re

from experiments import replicate


def test_every_run_has_a_positive_budget_and_the_total_fits_three_hours():
  assert set(replicate.BUDGET_MIN) == set(replicate.NAMES)
  assert all(v > 0 or name == "estimator_full_s0" for name, v in replicate.BUDGET_MIN.items())
  assert sum(replicate.BUDGET_MIN.values()) <= replicate.BUDGET_LIMIT_MIN == 180


def test_dry_run_prints_each_budget_and_the_total(capsys):
  replicate.run("workdirs", ["negative_control", "anneal_confidence"], dry_run=True)
  out = capsys.readouterr().out
  rows = dict(re.findall(r"^  (\S+)\s+([\d.]+) min", out, flags=re.M))
  assert set(rows) == {"negative_control", "anneal_confidence", "total"}
  assert float(rows["total"]) == round(replicate.BUDGET_MIN["negative_control"]
                                       + replicate.BUDGET_MIN["anneal_confidence"], 1)
  assert float(rows["negative_control"]) == round(replicate.BUDGET_MIN["negative_control"], 1)
  # the launch lines, in RUNS' order, each with its budget
  launches = re.findall(r"^\[replicate (\d)/2\] (\S+) \(~\d+ min\): -m experiments.launch", out,
                        flags=re.M)
  assert launches == [("1", "negative_control"), ("2", "anneal_confidence")]
