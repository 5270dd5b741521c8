"""Every config in experiments/configs/ runs its ``tiny`` variant end to end.

Each run is the real command line, ``python -m experiments.launch
--config=FILE.py:tiny --workdir=...``, in a subprocess with one CPU device
(the suite's 8 fake devices would only slow the compile), and is checked for
what a user looks at: final metrics, checkpoints, metrics.jsonl and plots.
"""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from opd import config_utils

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs"
SMOKE_TESTED = {"pretrain", "sft"}


def _load(name, arg="tiny"):
  return config_utils.load_config(f"{CONFIG_DIR / name}.py:{arg}")


def _launch(name, workdir, *overrides, arg="tiny"):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG_DIR / name}.py:{arg}",
         f"--workdir={workdir}", *overrides]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                        cwd=CONFIG_DIR.parents[1])
  if proc.returncode:
    raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads((pathlib.Path(workdir) / "final_metrics.json").read_text())


def test_every_config_has_a_smoke_test():
  configs = {p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__"}
  assert configs == SMOKE_TESTED, f"configs without a smoke test: {configs - SMOKE_TESTED}"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pretrain")
  return workdir, _launch("pretrain", workdir)


def test_pretrain_tiny(pretrained):
  workdir, metrics = pretrained
  cfg = _load("pretrain")
  assert metrics["steps"] == cfg.train.steps
  # A fresh model predicts ~uniformly over the vocabulary: loss ≈ ln(V).
  assert abs(metrics["train_loss_first"] - math.log(cfg.model.vocab_size)) < 0.3
  assert metrics["train_loss_final"] < metrics["train_loss_first"]
  assert math.isfinite(metrics["eval_loss"])
  assert (workdir / "checkpoints" / str(cfg.train.steps)).is_dir()
  assert pathlib.Path(metrics["plot"]).is_file()
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any("eval/loss" in r for r in rows) and any("loss" in r for r in rows)


def test_sft_tiny_from_pretrained(pretrained, tmp_path):
  base_dir, _ = pretrained
  cfg = _load("sft")
  metrics = _launch("sft", tmp_path, f"--config.init={base_dir / 'checkpoints'}",
                    "--config.data.domains=('agent', 'code')")
  assert metrics["steps"] == cfg.train.steps
  assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
  assert (tmp_path / "checkpoints" / str(cfg.train.steps)).is_dir()


def test_sft_without_init_names_the_field(tmp_path):
  from experiments import launch
  with pytest.raises(ValueError, match="config.init must name a checkpoint directory"):
    launch.launch(_load("sft"), tmp_path)
