"""experiments/grpo.py after a resume: ``reward_first`` / ``reward_last`` are the
uninterrupted run's, not the resumed segment's (issue #33).

The tiny random policy's samples are all malformed (task reward 0 at every
step), which would make any two runs agree; the test gives the job a reward
that reads the sampled text (the number of distinct response tokens, mod 5,
/ 4), so the steps' mean rewards differ and a figure taken from the wrong
steps shows.
"""
import pathlib

import jax

from experiments import baselines
from experiments import grpo
from opd.config import overrides as config_utils
from opd.models import init_params, to_model_config
from opd.rl import grpo as grpo_lib
from opd.training.loop import allowed_config_changes
from opd.training.metrics_writer import read_metrics

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs" / "grpo.py"


def _text_reward(episodes):
  return [(len(set(ep.response_ids.tolist())) % 5) / 4 for ep in episodes]


def _config(steps, init):
  config = config_utils.load_config(f"{CONFIG}:tiny")
  config_utils.apply_overrides(config, [f"train.steps={steps}", "train.save_every=1",
                                        "optim.warmup_steps=1", f"init={init}"])
  return config


def test_reward_first_and_last_survive_a_resume(tmp_path, monkeypatch):
  real_extras = grpo_lib.GRPOExtras
  monkeypatch.setattr(grpo_lib, "GRPOExtras",
                      lambda **kw: real_extras(reward_fn=_text_reward, **kw))
  config = _config(3, "")
  model_cfg = to_model_config(config.model)
  init = baselines.save_model(tmp_path / "init", model_cfg,
                              init_params(model_cfg, jax.random.key(0)), config)

  straight = grpo.run(_config(3, init), str(tmp_path / "straight"))
  grpo.run(_config(1, init), str(tmp_path / "resumed"))  # interrupted after step 1
  with allowed_config_changes(["train.steps"]):  # the launcher's --allow_config_change
    resumed = grpo.run(_config(3, init), str(tmp_path / "resumed"))

  rows = {name: [r["reward/mean"] for r in read_metrics(tmp_path / name) if "reward/mean" in r]
          for name in ("straight", "resumed")}
  # The same compiled steps from the same checkpoint: the logs agree exactly.
  # Steps 1 and 2 differ, so a reward_first read from the resumed segment
  # (steps 2-3: step 2's) would not equal the straight run's (step 1's).
  assert rows["resumed"] == rows["straight"] and len(rows["straight"]) == 3
  assert rows["straight"][0] != rows["straight"][1], rows
  # 3 steps: k = max(1, min(5, 3 // 3)) = 1 step at each end (experiments/grpo.py).
  assert straight["reward_first"] == rows["straight"][0]
  assert straight["reward_last"] == rows["straight"][-1]
  assert resumed["reward_first"] == straight["reward_first"]
  assert resumed["reward_last"] == straight["reward_last"]
  assert resumed["updates"] == straight["updates"]
