"""Tests for experiments/launch.py and the job registry in experiments/jobs.py.

The job is ``line_fit_job.run`` (a numpy gradient-descent line fit defined
next to this file), registered through ``experiments.jobs.register``.
"""
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

import line_fit_job
from experiments import jobs, launch
from opd.config import overrides as config_utils

HERE = pathlib.Path(__file__).parent
CONFIG = str(HERE / "line_fit_config.py")


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
  return env


def test_launch_runs_job_and_writes_files(tmp_path):
  config = config_utils.load_config(f"{CONFIG}:steps=400")
  metrics = launch.launch(config, tmp_path)
  # Independent reference: the least-squares line through the same data.
  x, y = line_fit_job.make_data(config)
  slope, intercept = np.polyfit(x, y, 1)
  best_loss = np.mean((slope * x + intercept - y) ** 2)
  # Convergence tolerance. Full-batch GD on the MSE from theta_0 = 0 moves the
  # error by e_{k+1} = (I - 2 lr H) e_k, H = [[<x^2>, <x>], [<x>, 1]], so after
  # k steps ||e_k|| <= rho^k ||theta*||, rho = max_i |1 - 2 lr lambda_i(H)|
  # (~0.93 here, rho^400 ~ 3e-13). float64 rounding adds ~c eps64 ||theta*|| per
  # step, damped by the same contraction: at most c eps64 ||theta*|| / (1 - rho),
  # c = 64 covering the means over n = 64 points. A wrong step size (a lost
  # factor 2 gives rho^400 ~ 1e-6) or a wrong gradient fails this bound.
  steps, lr = config.train.steps, config.optim.lr
  H = np.array([[np.mean(x * x), np.mean(x)], [np.mean(x), 1.0]])
  rho = np.max(np.abs(1 - 2 * lr * np.linalg.eigvalsh(H)))
  assert rho < 1  # the step size is inside GD's stability region
  eps64 = np.finfo(np.float64).eps
  norm_star = np.hypot(slope, intercept)
  bound = rho ** steps * norm_star + 64 * eps64 * norm_star / (1 - rho)
  assert np.hypot(metrics["slope"] - slope, metrics["intercept"] - intercept) <= bound
  # The loss exceeds the minimum by e^T H e <= lambda_max ||e||^2, plus the
  # rounding of a mean of n squares (n eps64 relative).
  excess = np.linalg.eigvalsh(H).max() * bound ** 2 + len(x) * eps64 * best_loss
  assert abs(metrics["final_loss"] - best_loss) <= excess
  assert json.loads((tmp_path / launch.FINAL_METRICS_FILE).read_text()) == metrics
  assert json.loads((tmp_path / launch.CONFIG_FILE).read_text()) == \
      config_utils.config_to_dict(config)
  losses = [json.loads(l)["loss"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(losses) == 401 and losses[-1] == metrics["final_loss"]  # JSON floats round-trip
  assert losses[-1] < losses[0] / 10
  assert config.is_locked  # a misspelt new field inside the job would raise


def test_registry_errors(tmp_path):
  config = config_utils.load_config(CONFIG)
  config.job = "no_such_job"
  with pytest.raises(ValueError, match=r"unknown job 'no_such_job' \(config.job\); known jobs: "
                                       r"\[.*'line_fit'.*'pretrain'.*\]"):
    launch.launch(config, tmp_path)
  assert not (tmp_path / launch.CONFIG_FILE).exists()  # failed before writing anything
  jobs.register("test_missing_module", "experiments.no_such_module:run")
  with pytest.raises(ValueError, match=r"registered as experiments.no_such_module:run, but "
                                       r"module 'experiments.no_such_module' does not exist"):
    jobs.get_job("test_missing_module")
  jobs.register("test_missing_fn", "experiments.jobs:no_such_function")
  with pytest.raises(ValueError, match=r"module 'experiments.jobs' has no function "
                                       r"'no_such_function'"):
    jobs.get_job("test_missing_fn")
  jobs.register("line_fit", line_fit_job.run)  # same target again: fine
  with pytest.raises(ValueError, match=r"job 'line_fit' is already registered as "
                                       r"line_fit_job:run"):
    jobs.register("line_fit", "experiments.other:run")
  with pytest.raises(ValueError, match="must look like 'package.module:function'"):
    jobs.register("bad_target", "experiments.other")
  assert jobs.known_jobs()["pretrain"] == "experiments.pretrain:run"


def test_job_return_value_is_checked(tmp_path):
  config = config_utils.load_config(CONFIG)
  jobs.register("test_returns_list", lambda config, workdir: [1.0])
  jobs.register("test_returns_numpy", lambda config, workdir: {"loss": np.float32(0.5),
                                                               "n": np.int64(3)})
  config.job = "test_returns_list"
  with pytest.raises(ValueError, match="must return a dict of final metrics, got list"):
    launch.launch(config, tmp_path / "a")
  config = config_utils.load_config(CONFIG)
  config.job = "test_returns_numpy"
  assert launch.launch(config, tmp_path / "b") == {"loss": 0.5, "n": 3}
  assert json.loads((tmp_path / "b" / launch.FINAL_METRICS_FILE).read_text())["n"] == 3


def test_explain_flag_error_names_field_and_value():
  argv = ["launch", f"--config={CONFIG}:steps=3", "--config.optim.lr=fast"]
  assert launch.explain_flag_error(argv) == "config field 'optim.lr' expects float, got 'fast'"
  argv = ["launch", "--config", CONFIG, "--config.train.step=3"]
  assert "config.train has no field 'step' (did you mean 'steps'?)" in \
      launch.explain_flag_error(argv)
  assert launch.explain_flag_error(["launch", f"--config={CONFIG}", "--config.seed=1"]) is None


# A successful CLI launch with --config.* overrides is covered by test_sweep.py,
# whose runs are `python -m experiments.launch` subprocesses.


def test_cli_unknown_override_is_a_clear_error(tmp_path):
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}",
         f"--workdir={tmp_path}", "--config.optim.lrr=0.3", "--jobs_module=line_fit_job"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
  assert proc.returncode == 2
  assert ("FATAL Flags parsing error: unknown config field 'optim.lrr': config.optim has no "
          "field 'lrr' (did you mean 'lr'?)") in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not any(tmp_path.iterdir())


# --- one owner per workdir, config checked before it is recorded (issue 33) ------------------

def _fit_reference(config, workdir):
  """What an undisturbed run of ``config`` returns, computed in another directory."""
  return launch._final_metrics_json(line_fit_job.run(config, str(workdir)), "line_fit")


def test_two_concurrent_launches_one_refused_the_other_intact(tmp_path):
  """A second launch while the first still runs is refused naming the first's
  pid and host; the first finishes with its own config, metrics and log rows."""
  import gated_job  # noqa: F401 (registers gated_line_fit for the in-process launch)
  import socket
  from opd.training.workdir import WorkdirBusyError
  from subprocess_env import one_device_env
  work, gate = tmp_path / "run", tmp_path / "gate"
  gate.mkdir()
  env = one_device_env(GATE_DIR=str(gate))
  env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}:steps=30",
         f"--workdir={work}", "--config.job=gated_line_fit", "--jobs_module=gated_job"]
  first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env)
  try:
    for _ in range(2400):  # up to 120 s for the first launch to reach its job
      if (gate / "started").exists() or first.poll() is not None:
        break
      time.sleep(0.05)
    assert (gate / "started").exists(), first.communicate()[1][-2000:]
    saved = (work / launch.CONFIG_FILE).read_bytes()
    second = config_utils.load_config(f"{CONFIG}:steps=30")
    second.job, second.optim.lr = "gated_line_fit", 0.05
    with pytest.raises(WorkdirBusyError, match=rf"in use by pid {first.pid} on host "
                                               rf"'{socket.gethostname()}'"):
      launch.launch(second, work)
    assert (work / launch.CONFIG_FILE).read_bytes() == saved  # the refused launch wrote nothing
  finally:
    (gate / "go").write_text("")
    out, err = first.communicate(timeout=120)
  assert first.returncode == 0, err[-2000:]
  config = config_utils.load_config(f"{CONFIG}:steps=30")
  expected = _fit_reference(config, tmp_path / "reference")
  assert json.loads(out.strip().splitlines()[-1]) == expected
  assert json.loads((work / launch.FINAL_METRICS_FILE).read_text()) == expected
  config.job = "gated_line_fit"
  assert json.loads((work / launch.CONFIG_FILE).read_text()) == config_utils.config_to_dict(config)
  def rows(d):  # wall_time differs between runs; step and loss must not
    return [{k: v for k, v in json.loads(line).items() if k != "wall_time"}
            for line in (d / "metrics.jsonl").read_text().splitlines()]

  assert rows(work) == rows(tmp_path / "reference") and len(rows(work)) == 31


def test_relaunch_with_a_changed_config_is_refused_naming_the_field(tmp_path):
  config = config_utils.load_config(f"{CONFIG}:steps=20")
  launch.launch(config, tmp_path)
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
  changed = config_utils.load_config(f"{CONFIG}:steps=20")
  changed.optim.lr, changed.data.noise = 0.2, 0.3
  from opd.training.workdir import ConfigChangedError
  with pytest.raises(ConfigChangedError, match=r"data.noise: was 0.1, now 0.3; optim.lr: was "
                                               r"0.1, now 0.2.*--allow_config_change="
                                               r"data.noise,optim.lr"):
    launch.launch(changed, tmp_path)
  after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
  assert after == before  # config.json, final metrics and the log untouched
  # Allowing one of the two fields is not enough.
  with pytest.raises(ConfigChangedError, match=r"data.noise: was 0.1, now 0.3\. "):
    launch.launch(changed, tmp_path, allow_config_change=["optim.lr"])
  with pytest.raises(ValueError, match=r"\['optim.lrr'\] name no config field"):
    launch.launch(changed, tmp_path, allow_config_change=["optim.lrr"])
  assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_allow_config_change_lets_the_named_field_through_with_a_log_line(tmp_path):
  """Through the CLI: ``--allow_config_change=train.steps`` continues the run
  under the new step count, logs the change and keeps the old config."""
  from subprocess_env import one_device_env
  config = config_utils.load_config(f"{CONFIG}:steps=10")
  launch.launch(config, tmp_path)
  old = (tmp_path / launch.CONFIG_FILE).read_text()
  env = one_device_env()
  env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}:steps=10",
         f"--workdir={tmp_path}", "--config.train.steps=25", "--jobs_module=line_fit_job"]
  refused = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
  assert refused.returncode != 0
  assert "train.steps: was 10, now 25" in refused.stderr
  proc = subprocess.run(cmd + ["--allow_config_change=train.steps"], capture_output=True,
                        text=True, env=env, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "config field train.steps changes from 10 to 25 (--allow_config_change)" in proc.stderr
  config.train.steps = 25
  assert json.loads((tmp_path / launch.CONFIG_FILE).read_text()) == \
      config_utils.config_to_dict(config)
  kept = list(tmp_path.glob("config.before-*.json"))
  assert len(kept) == 1 and kept[0].read_text() == old
  assert json.loads((tmp_path / launch.FINAL_METRICS_FILE).read_text()) == \
      _fit_reference(config, tmp_path / "reference")


def test_job_start_checks_run_before_the_config_is_recorded(tmp_path):
  """A job's start-up check (``jobs.validate``) refuses a bad config before
  ``config.json`` is written or the job starts."""
  calls = []

  def check(config):
    if config.optim.lr > 1:
      raise ValueError(f"config.optim.lr={config.optim.lr} diverges")

  jobs.register("test_checked_fit", lambda config, workdir: calls.append(1) or {}, check=check)
  config = config_utils.load_config(CONFIG)
  config.job, config.optim.lr = "test_checked_fit", 2.0
  with pytest.raises(ValueError, match=r"config.optim.lr=2.0 diverges"):
    launch.launch(config, tmp_path)
  assert not calls and not (tmp_path / launch.CONFIG_FILE).exists()


def test_allowed_changes_and_fall_back_reach_the_training_loops(tmp_path):
  """What every ``opd.training.loop.train`` inside the job sees (its resume check)."""
  from opd.training.resume import context_allowances
  seen = []
  jobs.register("test_reads_allowances",
                lambda config, workdir: seen.append(context_allowances()) or {})
  config = config_utils.load_config(CONFIG)
  config.job = "test_reads_allowances"
  launch.launch(config, tmp_path)
  config.train.steps = 50
  launch.launch(config, tmp_path, allow_config_change=["train.steps"], fall_back_on_corrupt=True)
  assert seen == [((), False), (("train.steps",), True)]
  assert context_allowances() == ((), False)  # nothing leaks past the job
