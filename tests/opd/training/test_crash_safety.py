"""Killed, terminated and resumed runs: the metric log, the first-step figures
and the final state equal an uninterrupted run's (docs/DESIGN.md, "Failure model").

Every run is a subprocess of tests/opd/training/crash_worker.py on one CPU
device; the kills are real signals the worker sends itself at a chosen point
(inside a checkpoint's commit, in the middle of a metrics line, after a step).
"""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from opd.training.checkpoints import CheckpointManager
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")
STEPS, SAVE_EVERY = 10, 2


def _worker(workdir, out, die="", expect=0):
  args = [sys.executable, WORKER, "--workdir", str(workdir), "--steps", str(STEPS),
          "--save-every", str(SAVE_EVERY), "--eval-every", "5", "--out", str(out)]
  if die:
    args += ["--die", die]
  proc = subprocess.run(args, env=one_device_env(JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  output = proc.stdout + proc.stderr
  assert proc.returncode == expect, \
      f"worker {die or 'run'} exited {proc.returncode}:\n{output[-4000:]}"
  return output


def _rows(workdir):
  """metrics.jsonl's rows without wall_time (the one field a rerun changes)."""
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [{k: v for k, v in json.loads(line).items() if k != "wall_time"} for line in lines]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("straight")
  _worker(workdir, workdir / "out.json")
  return _rows(workdir), json.loads((workdir / "out.json").read_text())


def test_sigkill_at_random_points_then_resume_equals_straight_run(straight, tmp_path):
  rows, final = straight
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  # Kill points drawn once from a fixed seed: inside the commit of a save
  # step, in the middle of a later metrics line, right after a later step.
  rng = np.random.default_rng(33)
  save_at = int(rng.choice([4, 6, 8]))
  row_at = int(rng.integers(save_at - 1, STEPS))  # after the resume from save_at - 2
  step_at = int(rng.integers(row_at, STEPS))
  out = tmp_path / "out.json"
  _worker(tmp_path, out, f"save:{save_at}", expect=-signal.SIGKILL)
  # It died inside the save: the step's files are in a tmp directory, not committed.
  assert CheckpointManager(tmp_path / "checkpoints").latest_step() == save_at - 2
  assert any(n.startswith(f"{save_at}.orbax-checkpoint-tmp")
             for n in os.listdir(tmp_path / "checkpoints"))
  assert [r["step"] for r in _rows(tmp_path)] == list(range(1, save_at + 1))  # rows to save_at

  _worker(tmp_path, out, f"row:{row_at}", expect=-signal.SIGKILL)
  text = (tmp_path / "metrics.jsonl").read_text()
  assert not text.endswith("\n")  # the torn line is there
  output = _worker(tmp_path, out, f"step:{step_at}", expect=-signal.SIGKILL)
  assert "cut a torn last line" in output and "metrics.jsonl" in output
  output = _worker(tmp_path, out)
  # Same rows (steps and values, eval rows included) and the same final state,
  # bit for bit: the same compiled steps on the same restored states and
  # batches (docs/DEVELOPING.md: things that are exact stay exact).
  assert _rows(tmp_path) == rows, (save_at, row_at, step_at)
  resumed = json.loads(out.read_text())
  assert resumed == final
  # The first-step figures are the first step's, not the last segment's.
  assert resumed["train_loss_first"] == rows[0]["loss"]
  assert {k: v for k, v in resumed["first_metrics"]["1"].items()} == \
      {k: v for k, v in rows[0].items() if k != "step"}


def test_sigterm_checkpoints_then_exits_and_resumes(straight, tmp_path):
  rows, final = straight
  out = tmp_path / "out.json"
  term_at = 3  # not a save step: the SIGTERM save is an extra one
  output = _worker(tmp_path, out, f"term:{term_at}", expect=143)
  assert f"received SIGTERM: stopped after step {term_at} of {STEPS}" in output
  assert str(tmp_path / "checkpoints" / str(term_at)) in output
  assert CheckpointManager(tmp_path / "checkpoints").all_steps() == [2, term_at]
  assert _rows(tmp_path) == rows[:term_at]  # every row so far is on disk
  assert not out.exists()  # the job did not go on
  _worker(tmp_path, out)
  assert _rows(tmp_path) == rows
  assert json.loads(out.read_text()) == final
