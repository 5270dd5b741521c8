"""``make demo``: the main job on the CPU-sized default config.

  python -m experiments.demo --workdir=workdirs/demo [--config=FILE.py[:ARG]]

Runs the specialists pipeline (``experiments/configs/specialists.py``):
pre-trains the tiny base, trains five domain specialists (SFT then GRPO),
evaluates the base and every specialist on all five test sets, prints the
results table and writes a heatmap. Re-running continues where it stopped.
"""
from __future__ import annotations

import pathlib
import sys

from absl import app, flags

flags.DEFINE_string("workdir", "workdirs/demo", "where every stage writes its run directory")
flags.DEFINE_string("config", "experiments/configs/specialists.py",
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
