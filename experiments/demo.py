"""``make demo``: the main job on the CPU-sized default config.

  python -m experiments.demo --workdir=workdirs/demo [--config=FILE.py[:ARG]]

Runs the V4 post-training pipeline (``experiments/configs/v4.py``, job
``experiments.v4``): pre-trains the tiny base, trains five domain
specialists (SFT then GRPO), distils them into one student (cold start, OPD
with routing, annealing to uniform weights), trains the baselines, evaluates
every model on all five test sets, prints the tables and writes a heatmap.
Re-running continues where it stopped.
"""
from __future__ import annotations

import pathlib
import sys

from absl import app, flags

flags.DEFINE_string("workdir", "workdirs/demo", "where every stage writes its run directory")
flags.DEFINE_string("config", "experiments/configs/v4.py",
                    "config file (and optional :ARG) to run")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from experiments import launch
  from experiments.common import enable_compilation_cache
  from opd.config import overrides as config_utils
  enable_compilation_cache()
  config = config_utils.load_config(FLAGS.config)
  print(f"[demo] {FLAGS.config} → {FLAGS.workdir}  (job {config.job!r})", flush=True)
  metrics = launch.launch(config, pathlib.Path(FLAGS.workdir))
  print("[demo] done. Final metrics in", pathlib.Path(FLAGS.workdir) / launch.FINAL_METRICS_FILE)
  for key in ("heatmap", "report", "plot"):
    if key in metrics:
      print(f"[demo] {key}: {metrics[key]}")
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
