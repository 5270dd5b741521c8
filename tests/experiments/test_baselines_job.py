"""experiments/configs/baselines.py: the ``tiny`` baselines through the real CLI.

One ``baselines`` run builds a random base and two tiny specialists (math,
instruct) and runs the five baselines as stages of one workdir; a second
launch with a changed task-arithmetic λ reuses the finished stages and
refuses the one whose directory was written under the old config.
"""
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from opd.config import overrides as config_utils
from opd.models import to_model_config
from opd.training.checkpoints import load_params
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "baselines.py"
JOBS = ("merge", "task_arithmetic", "offpolicy_kd", "mixed_rl", "sequential_rl")
EPS32 = float(np.finfo(np.float32).eps)


def _launch(workdir, arg, *overrides, check=True):
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", "--jobs_module=experiments.baselines",
         f"--config={CONFIG}:{arg}", f"--workdir={workdir}", *overrides]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  if check and proc.returncode:
    raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("baselines_tiny")
  _launch(workdir, "tiny")
  return workdir, json.loads((workdir / "final_metrics.json").read_text())


def _leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def test_every_baseline_writes_its_model(run):
  workdir, metrics = run
  cfg = config_utils.load_config(f"{CONFIG}:tiny")
  model = to_model_config(cfg.model)
  for job in JOBS:
    assert metrics[f"{job}/checkpoint"] == str(workdir / job / "checkpoints")
    assert (workdir / job / "final_metrics.json").is_file()
    load_params(workdir / job / "checkpoints", model)  # the demo evaluates these
  # Merging: the average and base + λ Σ (θ_i − base) of the built specialists.
  base = _leaves(load_params(workdir / "base" / "checkpoints", model))
  spec = [_leaves(load_params(workdir / "teachers" / d / "checkpoints", model))
          for d in cfg.teachers]
  lam = cfg.task_arithmetic.scale
  merged = _leaves(load_params(workdir / "merge" / "checkpoints", model))
  arith = _leaves(load_params(workdir / "task_arithmetic" / "checkpoints", model))
  for i, (b, got_avg, got_ta) in enumerate(zip(base, merged, arith)):
    mags = max(np.abs(b).max(), *(np.abs(s[i]).max() for s in spec))
    # A few float32 roundings, each relative to the largest magnitude involved.
    np.testing.assert_allclose(got_avg, sum(s[i] for s in spec) / len(spec), rtol=0,
                               atol=8 * EPS32 * mags)
    np.testing.assert_allclose(got_ta, b + lam * sum(s[i] - b for s in spec), rtol=0,
                               atol=8 * EPS32 * mags * (1 + 2 * lam * len(spec)))
  assert metrics["task_arithmetic/scale"] == lam
  assert -1 <= metrics["task_arithmetic/task_vector_cos_mean"] <= 1
  # Off-policy KD: trained on kept teacher text, held-out forward KL measured.
  assert metrics["offpolicy_kd/updates"] == cfg.kd.steps
  assert metrics["offpolicy_kd/sequences"] == metrics["offpolicy_kd/kept"] >= 1
  assert metrics["offpolicy_kd/trained_tokens"] > 0
  assert math.isfinite(metrics["offpolicy_kd/fkl_final"])
  # RL baselines: the same budget; mixed RL saw both domains, sequential ran
  # them in the configured order.
  steps = cfg.rl_train.steps
  for job in ("mixed_rl", "sequential_rl"):
    assert metrics[f"{job}/updates"] == steps
    assert 0 < metrics[f"{job}/sampled_tokens"] <= (steps * cfg.grpo.prompts_per_step
                                                    * cfg.grpo.group_size
                                                    * cfg.grpo.max_new_tokens)
  rows = [json.loads(l) for l in (workdir / "mixed_rl" / "metrics.jsonl").read_text().split("\n")
          if l]
  seen = {k.split("/")[2] for r in rows for k in r if k.startswith("reward/domain/")}
  assert seen == set(cfg.domains)
  assert metrics["sequential_rl/order"] == ",".join(cfg.sequential.order)
  for i, d in enumerate(cfg.sequential.order):
    assert (workdir / "sequential_rl" / "stages" / f"{i + 1}_{d}" / "checkpoints").is_dir()


def test_rerun_reuses_finished_stages_and_refuses_a_changed_one(run):
  workdir, _ = run
  # The launcher refuses the changed config before any stage runs ...
  proc = _launch(workdir, "tiny", "--config.task_arithmetic.scale=0.7", check=False)
  assert proc.returncode != 0 and "done earlier" not in proc.stdout
  assert "task_arithmetic.scale: was 0.5, now 0.7" in proc.stderr
  # ... and, that change allowed, the stage whose config it changes refuses it.
  proc = _launch(workdir, "tiny", "--config.task_arithmetic.scale=0.7",
                 "--allow_config_change=task_arithmetic.scale", check=False)
  assert proc.returncode != 0
  assert "merge: done earlier" in proc.stdout
  assert "task_arithmetic.scale: was 0.5, now 0.7" in proc.stderr
  assert json.loads((workdir / "task_arithmetic" / "final_metrics.json").read_text())[
      "scale"] == 0.5


def test_config_variants_are_validated():
  with pytest.raises(ValueError, match="job='opd'"):
    config_utils.load_config(f"{CONFIG}:job=opd")
  assert config_utils.load_config(f"{CONFIG}:tiny,job=mixed_rl").job == "mixed_rl"
