"""The strong toy world's full replication: every run behind docs/RESULTS.md's
"A stronger toy world" tables, in order, each resumable (issue #26).

  python -m experiments.replicate                       # everything, under workdirs/
  python -m experiments.replicate --dry_run             # the launch commands only
  python -m experiments.replicate --only=v4_strong,negative_control

Each run is one ``python -m experiments.launch`` in its own process (its
progress bars and stage lines go to the terminal); a finished stage is read,
not rerun, so an interrupted replication continues where it stopped. Later
runs read the finished stages of earlier ones (``--config.reuse_from``).
Measured stage times on the 2-core reference machine (docs/LOG.md, tenth
session; other jobs running): specialists 29 min, the V4 run's first seed
and the positive control 35 min, seeds 1-2 with sequential RL and
off-policy KD 18 min, the negative control 12 min, each mixed-RL learning
rate ~26 min, annealing to confidence ~3 min a seed, each estimator arm
(single-domain control) ~10-15 min.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Sequence

from absl import app
from absl import flags

V4 = "experiments/configs/v4.py:strong"
REUSE = "{root}/v4_strong,{root}/strong"
# (name, config, workdir, extra flags); {root} is --root.
RUNS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("specialists", "experiments/configs/specialists.py:strong", "strong", ()),
    ("v4_strong", f"{V4},seeds=3,all_baselines", "v4_strong",
     ("--config.reuse_from={root}/strong",)),
    ("negative_control", V4, "v4_strong_shift",
     (f"--config.reuse_from={REUSE}", "--config.teacher_shift=1",
      "--config.positive_control.steps=0")),
    ("anneal_confidence", f"{V4},seeds=3", "v4_strong_conf",
     (f"--config.reuse_from={REUSE}", "--config.opd.weighting.anneal_to=confidence",
      "--config.positive_control.steps=0")),
    *((f"mixed_rl_lr{lr}", V4, f"v4_strong_rl{lr}",
       (f"--config.reuse_from={REUSE}", f"--config.baselines.rl_optim.lr={lr}",
        "--config.positive_control.steps=0")) for lr in ("2e-5", "6e-5", "6e-4")),
    *((f"estimator_{arm}_s{seed}", V4, f"est_code/{arm}_s{seed}",
       (f"--config.reuse_from={REUSE}", "--config.positive_control.only=True",
        "--config.positive_control.domains=('code',)", f"--config.student_seeds=({seed},)", *flags_))
      for seed in (0, 1, 2)
      for arm, flags_ in (("full", ("--config.opd.loss.estimator=full",)),
                          ("top10", ("--config.opd.loss.estimator=top_k",
                                     "--config.opd.loss.top_k=10")),
                          ("top32", ("--config.opd.loss.estimator=top_k",
                                     "--config.opd.loss.top_k=32")),
                          ("token", ("--config.opd.loss.estimator=token",)))),
)
NAMES = tuple(name for name, *_ in RUNS)

_ROOT = flags.DEFINE_string("root", "workdirs", "Directory holding every run's workdir.")
_ONLY = flags.DEFINE_list("only", [], f"Run only these (names: {', '.join(NAMES)}).")
_DRY = flags.DEFINE_bool("dry_run", False, "Print the commands, run nothing.")


def commands(root: str, only: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
  """``[(name, argv)]`` of the runs to launch, in order."""
  unknown = sorted(set(only) - set(NAMES))
  if unknown:
    raise ValueError(f"--only names {unknown}; known runs: {list(NAMES)}")
  out = []
  for name, config, workdir, extra in RUNS:
    if only and name not in only:
      continue
    out.append((name, [sys.executable, "-m", "experiments.launch", f"--config={config}",
                       f"--workdir={root}/{workdir}", *(e.format(root=root) for e in extra)]))
  return out


def main(argv: Sequence[str]) -> None:
  del argv
  todo = commands(_ROOT.value, _ONLY.value)
  for i, (name, cmd) in enumerate(todo, 1):
    print(f"[replicate {i}/{len(todo)}] {name}: {' '.join(cmd[1:])}", flush=True)
    if not _DRY.value:
      subprocess.run(cmd, check=True)


if __name__ == "__main__":
  app.run(main)
