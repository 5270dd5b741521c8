"""experiments/configs/distill.py: the ``tiny`` OPD and cold-start jobs through the real CLI.

``python -m experiments.launch --config=experiments/configs/distill.py:tiny``
builds two tiny specialists (math, instruct; D=48 x 1 layer against the
student's D=32 x 2), then distils them; the cold start reuses those teacher
checkpoints through ``--config.teachers.<name>.init`` overrides.
"""
import json
import math
import pathlib
import subprocess
import sys

import pytest

from opd.config import overrides as config_utils
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "distill.py"


def _launch(workdir, arg, *overrides):
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}:{arg}",
         f"--workdir={workdir}", *overrides]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  if proc.returncode:
    raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads((pathlib.Path(workdir) / "final_metrics.json").read_text())


@pytest.fixture(scope="module")
def opd_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("distill_tiny")
  return workdir, _launch(workdir, "tiny")


def test_tiny_opd_runs_through_the_cli(opd_run):
  workdir, metrics = opd_run
  cfg = config_utils.load_config(f"{CONFIG}:tiny")
  steps, names = cfg.train.steps, sorted(cfg.teachers)
  assert metrics["steps"] == metrics["updates"] == steps
  assert (workdir / "checkpoints" / str(steps)).is_dir()
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  eval_steps = [r["step"] for r in rows if f"eval/rkl/{names[0]}" in r]
  assert eval_steps == [0] + list(range(cfg.train.eval_every, steps + 1, cfg.train.eval_every))
  for n in names:
    width = cfg.teachers[n].model.d_model
    assert metrics[f"cache_bytes_per_token/{n}"] == width * 2  # bf16 hidden states
    assert metrics[f"skips/{n}"] == 0
    for k in ("rkl_initial", "rkl_final", "overlap@8_last"):
      assert math.isfinite(metrics[f"{k}/{n}"]), (k, n, metrics)
    assert any(f"diag/{n}/overlap@8" in r for r in rows)
  assert all(0 <= r["reward/mean"] <= 1 for r in rows if r["step"] > 0)  # opd.verify
  assert metrics["logits_bytes_per_token"] == cfg.student.model.vocab_size * 4
  for name in ("rkl.png", "overlap.png", "skips.png"):
    assert (workdir / name).is_file()


def test_tiny_cold_start_runs_through_the_cli(opd_run, tmp_path):
  teachers = opd_run[0] / "teachers"
  metrics = _launch(tmp_path, "tiny,job=cold_start",
                    *(f"--config.teachers.{n}.init={teachers / n / 'checkpoints'}"
                      for n in ("math", "instruct")))
  for n in ("math", "instruct"):
    assert metrics[f"cold_start/{n}/answered"] == 16
    assert (metrics[f"cold_start/{n}/kept"] + metrics[f"cold_start/{n}/rejected"]
            == metrics[f"cold_start/{n}/answered"])
  assert metrics["cold_start/kept"] >= 1 and metrics["steps"] == 3
  assert (tmp_path / "checkpoints" / "3").is_dir()
  assert not (tmp_path / "teachers").exists()  # the given checkpoints were used


def test_config_variants_are_validated():
  with pytest.raises(ValueError, match="job='sft'"):
    config_utils.load_config(f"{CONFIG}:job=sft")
  assert config_utils.load_config(f"{CONFIG}:tiny,steps=100").train.steps == 100


def test_tiny_opd_with_a_lora_student_through_the_cli(opd_run, tmp_path):
  """``--config.student.lora.rank=2``: the job trains adapters on the frozen
  student (the checkpoint records the LoRA config; the teachers are reused)."""
  from opd.training.checkpoints import CheckpointManager  # noqa: PLC0415
  teachers = opd_run[0] / "teachers"
  metrics = _launch(tmp_path, "tiny", "--config.student.lora.rank=2",
                    *(f"--config.teachers.{n}.init={teachers / n / 'checkpoints'}"
                      for n in ("math", "instruct")))
  cfg = config_utils.load_config(f"{CONFIG}:tiny")
  assert metrics["steps"] == cfg.train.steps
  saved = CheckpointManager(tmp_path / "checkpoints").read_config()
  assert saved["lora"]["rank"] == 2 and saved["experiment"]["student"]["lora"]["rank"] == 2


def test_a_misspelt_lora_field_is_named():
  import ml_collections  # noqa: PLC0415
  from experiments import common  # noqa: PLC0415
  group = ml_collections.ConfigDict(dict(rank=2, alpah=16.0))
  with pytest.raises(ValueError, match=r"config.student.lora has unknown field\(s\) \['alpah'\]"):
    common.lora_student({"w": 0}, group, "config.student.lora")
  assert common.lora_student({"w": 0}, ml_collections.ConfigDict(dict(rank=0)), "x") == {"w": 0}
