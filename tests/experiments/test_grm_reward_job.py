"""experiments/configs/grm_reward.py: the ``tiny`` three-reward writing GRPO through the real CLI."""
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from opd.config import overrides as config_utils
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "grm_reward.py"


def test_tiny_grm_reward_job_trains_under_each_reward_and_scores_the_rubric(tmp_path):
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}:tiny",
         f"--workdir={tmp_path}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  metrics = json.loads((tmp_path / "final_metrics.json").read_text())
  cfg = config_utils.load_config(f"{CONFIG}:tiny")
  for name in cfg.rewards + ("init",):  # every policy, and the one they start from
    for judge in ("rubric", f"rubric_mean@{cfg.eval.num_samples}", "score_grm", "score_bt"):
      assert 0.0 <= metrics[f"{judge}/{name}"] <= 1.0, (judge, name)
  for name in cfg.rewards:
    for f in ("train.json", "scores.json"):
      assert (tmp_path / name / f).is_file(), (name, f)
    assert math.isfinite(metrics[f"train_reward/{name}"]), name
    assert (tmp_path / name / "metrics.jsonl").is_file(), name
    # Each trained policy is kept (and a stopped GRPO resumes from it).
    assert list((tmp_path / name / "checkpoints").iterdir()), name
  # Every GRM sample of every step is counted: B·k per step, valid or invalid.
  B = cfg.grpo.group_size * cfg.grpo.prompts_per_step
  assert metrics["grm/samples"] == cfg.train.steps * B * cfg.grm.k
  assert 0 <= metrics["grm/invalid_samples"] <= metrics["grm/samples"]
  saved = json.loads((tmp_path / "rubric_scores.json").read_text())
  assert saved == {k: v for k, v in metrics.items() if k.startswith("rubric")}
  # The paired gains are the per-prompt differences from the initial policy.
  init = json.loads((tmp_path / "init_scores.json").read_text())["per_example"]
  mean_n = f"rubric_mean@{cfg.eval.num_samples}"
  for name in cfg.rewards:
    per = json.loads((tmp_path / name / "scores.json").read_text())["per_example"]
    assert len(per["rubric"]) == cfg.data.num_test
    assert np.asarray(per[mean_n]).shape == (cfg.data.num_test, cfg.eval.num_samples)
    for key in ("rubric", mean_n, "score_grm", "score_bt"):
      d = np.asarray(per[key], float) - np.asarray(init[key], float)
      d = d.mean(axis=1) if d.ndim == 2 else d
      assert metrics[f"{key}_gain/{name}"] == pytest.approx(d.mean(), abs=1e-12)
      assert metrics[f"{key}/{name}"] == pytest.approx(np.mean(per[key]), abs=1e-12)
      assert metrics[f"{key}_se/{name}"] >= 0.0 and metrics[f"{key}_gain_se/{name}"] >= 0.0


def test_grm_reward_config_rejects_an_unknown_reward(tmp_path):
  from experiments import grm_reward

  cfg = config_utils.load_config(f"{CONFIG}:tiny")
  cfg.rewards = ("grm", "vibes")
  with pytest.raises(ValueError, match="rewards"):
    grm_reward.run(cfg, str(tmp_path))
