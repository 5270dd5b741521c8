"""experiments/pretrain.py after a resume: the first-step figure is the
original run's (stored in the checkpoint), not the resumed segment's."""
import pathlib

from experiments import pretrain
from opd.config import overrides as config_utils
from opd.training.loop import allowed_config_changes
from opd.training.metrics_writer import read_metrics

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs" / "pretrain.py"


def _config(steps):
  config = config_utils.load_config(f"{CONFIG}:tiny")
  config_utils.apply_overrides(config, [f"train.steps={steps}", "train.save_every=2",
                                        "train.log_every=1", "optim.warmup_steps=1"])
  return config


def test_train_loss_first_survives_a_resume(tmp_path):
  before = pretrain.run(_config(2), str(tmp_path))
  with allowed_config_changes(["train.steps"]):  # the launcher's --allow_config_change
    after = pretrain.run(_config(3), str(tmp_path))
  rows = read_metrics(tmp_path)
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
  # Step 1's loss, as logged by the first launch; the second launch trained step 3 only.
  assert after["train_loss_first"] == before["train_loss_first"] == rows[0]["loss"]
  assert after["steps"] == 3
