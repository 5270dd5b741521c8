"""Tests for experiments/launch.py and the job registry in experiments/jobs.py.

The job is ``line_fit_job.run`` (a numpy gradient-descent line fit defined
next to this file), registered through ``experiments.jobs.register``.
"""
import json
import os
import pathlib
import subprocess
import sys

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
  assert metrics["slope"] == pytest.approx(slope, abs=1e-3)
  assert metrics["intercept"] == pytest.approx(intercept, abs=1e-3)
  assert metrics["final_loss"] == pytest.approx(best_loss, rel=1e-4)
  assert json.loads((tmp_path / launch.FINAL_METRICS_FILE).read_text()) == metrics
  assert json.loads((tmp_path / launch.CONFIG_FILE).read_text()) == \
      config_utils.config_to_dict(config)
  losses = [json.loads(l)["loss"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(losses) == 401 and losses[-1] == pytest.approx(metrics["final_loss"])
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
