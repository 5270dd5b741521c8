"""``experiments.demo`` (``make demo``): the strong world's cut builds and passes
the job-start checks, its claims are judged as a normal-approximation
interval says, and the printed differences are the per-example ones."""
import json
import math
import pathlib
import statistics
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import common, demo, jobs, paired_diff
from opd.eval.report import load_results
from opd.eval.results import DomainResult, EvalConfig, EvalResult, Estimate
from opd.parallel import sharding
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)


@pytest.fixture
def one_device(monkeypatch):
  """The job checks on one device, as a CLI run on a one-device machine
  (the suite's 8 fake devices would shard the demo's batches 8 ways)."""
  def mesh_and_rules(config):
    rules = tuple(config.get("sharding_rules", None) or sharding.DEFAULT_RULES)
    return (sharding.make_mesh(tuple(config.mesh), jax.devices()[:1]),
            sharding.validate_rules(rules))
  monkeypatch.setattr(common, "mesh_and_rules", mesh_and_rules)


def test_the_cut_builds_and_passes_the_job_start_checks(one_device):
  config = demo.load_demo_config()
  full = demo.load_demo_config(cut=False)
  # what the cut changes, against the strong config it starts from
  assert full.positive_control.steps > 0 and config.positive_control.steps == 0
  assert tuple(config.baselines.baselines) == ("merge", "task_arithmetic", "mixed_rl")
  assert full.baselines.rl_optim.lr == 2e-4 and config.baselines.rl_optim.lr == 6e-5
  assert tuple(config.student_seeds) == (0,) and config.teacher_shift == 0
  # the rest is the strong world's: its specialists, OPD and cold start
  assert config.specialists.model.tokenizer == full.specialists.model.tokenizer == "bpe:1024"
  assert config.opd_train.steps == full.opd_train.steps == 400
  assert config.cold_start.to_dict() == full.cold_start.to_dict()
  assert config.eval.to_dict() == full.eval.to_dict()  # the full test sets
  assert config.baselines.rl_train.steps == full.baselines.rl_train.steps == 420
  jobs.validate(config)
  control = demo.load_demo_config(extra=demo.negative_control_overrides("workdirs/demo"))
  assert control.teacher_shift == 1 and control.reuse_from == "workdirs/demo"
  jobs.validate(control)


def test_bad_cut_override_names_the_field():
  with pytest.raises((ValueError, KeyError, AttributeError), match="no_such_field"):
    demo.load_demo_config(extra=("eval.no_such_field=1",))


def _claim(sign):
  return demo.Claim("c", ("main", "a"), ("main", "b"), sign, "p", "k")


@pytest.mark.parametrize("diff,se,sign,shown", [
    (8.5, 1.9, +1, True),     # the measured OPD − cold start at a quarter of the test set
    (3.0, 2.0, +1, False),    # 3 - 1.96 * 2 = -0.92 < 0
    (-30.4, 2.7, -1, True),   # the negative control
    (-30.4, 2.7, +1, False),  # the wrong side
    (1.0, 0.0, +1, True),     # every example's difference equal
    (0.0, 0.0, +1, False),
])
def test_judge_matches_a_normal_interval(diff, se, sign, shown):
  out = demo.judge(_claim(sign), diff, se)
  assert out["shown"] is shown
  assert out["ci"] == pytest.approx((diff - 1.96 * se, diff + 1.96 * se))
  if se > 0:  # two-sided tail of the standard normal, by the stdlib's NormalDist
    expected = 2 * (1 - statistics.NormalDist().cdf(abs(diff) / se))
  else:
    expected = 0.0 if diff else 1.0
  assert out["chance"] == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_judge_refuses_a_negative_standard_error():
  with pytest.raises(ValueError, match=r"claim 'c': standard error -1.0 must be >= 0"):
    demo.judge(_claim(+1), 1.0, -1.0)


DOMAINS = ("math", "code")


def _result(name, greedy_by_domain):
  domains = {}
  for d, greedy in greedy_by_domain.items():
    n = len(greedy)
    domains[d] = DomainResult(d, {"reward@1": Estimate(100 * float(np.mean(greedy)), 0.0)},
                              [f"{d}-{i}" for i in range(n)], list(greedy), [1.0] * n,
                              [[g] * 2 for g in greedy], [[1.0] * 2] * n, {}, [])
  return EvalResult(name, EvalConfig(domains=DOMAINS, num_samples=2), domains, {})


def _save(workdir, results):
  (workdir / "v4").mkdir(parents=True)
  (workdir / "v4" / "results.json").write_text(
      json.dumps({"scale": "0-100", "results": [r.to_dict() for r in results]}))


def test_claims_report_prints_the_per_example_differences(tmp_path):
  rng = np.random.default_rng(0)
  greedy = {row: {d: rng.integers(0, 2, 60).astype(float) for d in DOMAINS}
            for row in ("student: OPD#0", "student: cold start#0", "student: OPD + annealing#0",
                        "baseline: mixed RL", "baseline: weight average",
                        "baseline: task arithmetic", "shifted")}
  _save(tmp_path / "main", [_result(r, g) for r, g in greedy.items() if r != "shifted"])
  _save(tmp_path / "neg", [_result("student: OPD#0", greedy["shifted"])])
  paired_diff._rows.cache_clear()
  text = demo.claims_report({"main": tmp_path / "main", "negative_control": tmp_path / "neg"})
  cold = greedy["student: cold start#0"]
  for i, (a, b) in enumerate([(greedy["student: OPD#0"], cold), (greedy["shifted"], cold)], 1):
    # the average over domains of the mean per-example difference (numpy)
    diff = np.mean([100 * np.mean(a[d] - b[d]) for d in DOMAINS])
    assert f"= {diff:+.1f} ± " in text.split(f"\n{i}. ")[1].split("\n")[2]
  assert text.count("   prediction: ") == text.count("   control: ") == len(demo.CLAIMS) == 5
  assert "Not in this cut" in text
  assert "student: OPD#0 (negative control) − student: cold start#0 = " in text
  # SE: the quadrature mean of the domains' bootstrap SEs, each near the plug-in std/sqrt(n)
  a, b = greedy["student: OPD#0"], cold
  plug_in = math.sqrt(sum((100 * np.std(a[d] - b[d]) / math.sqrt(60)) ** 2 for d in DOMAINS)) / 2
  se = float(text.split("\n1. ")[1].split("\n")[2].split(" ± ")[1].split(" ")[0])
  assert se == pytest.approx(plug_in, rel=0.15, abs=0.05)


def test_make_demo_tiny_path_runs_the_negative_control_and_prints_the_claims(tmp_path):
  """``python -m experiments.demo`` end to end on ``v4.py:tiny`` (``--nocut``):
  the main run, the negative control in its own workdir reading the main run's
  finished stages, and the claims block, whose differences match numpy on the
  two runs' results.json."""
  root = pathlib.Path(__file__).resolve().parents[2]
  workdir = tmp_path / "demo"
  cmd = [sys.executable, "-m", "experiments.demo", "--config=experiments/configs/v4.py:tiny",
         "--nocut", f"--workdir={workdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=one_device_env(), timeout=1200,
                        cwd=root)
  assert proc.returncode == 0, proc.stderr[-3000:]
  control = workdir / demo.NEGATIVE_CONTROL_DIR
  # the control trains its own OPD and annealing; the cold start is the main run's
  assert (control / "student" / "seed0" / "opd" / "checkpoints").is_dir()
  assert not (control / "student" / "seed0" / "cold_start").exists()
  assert json.loads((control / "config.json").read_text())["teacher_shift"] == 1
  out = proc.stdout
  assert out.count("   prediction: ") == len(demo.CLAIMS)
  main_rows = {r.name: r for r in load_results(str(workdir / "v4" / "results.json"))}
  control_rows = {r.name: r for r in load_results(str(control / "v4" / "results.json"))}
  runs = {"main": main_rows, "negative_control": control_rows}
  block = out.split("Claims this demo shows")[1]
  for i, claim in enumerate(demo.CLAIMS, 1):
    a, b = runs[claim.a[0]][claim.a[1]], runs[claim.b[0]][claim.b[1]]
    diff = np.mean([100 * np.mean(np.subtract(a.domains[d].greedy_rewards,
                                              b.domains[d].greedy_rewards))
                    for d in a.domains])
    outcome = block.split(f"\n{i}. ")[1].split("\n")[2]
    # printed to one decimal: within 0.05 of numpy's
    assert float(outcome.split(" = ")[1].split(" ± ")[0]) == pytest.approx(diff, abs=0.051)
