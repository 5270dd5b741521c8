"""The strong toy world's full replication: every run behind docs/RESULTS.md's
"A stronger toy world" tables, in order, each resumable (issue #26).

  python -m experiments.replicate                       # everything, under workdirs/
  python -m experiments.replicate --dry_run             # the launch commands only
  python -m experiments.replicate --only=v4_strong,negative_control

Each run is one ``python -m experiments.launch`` in its own process (its
progress bars and stage lines go to the terminal); a finished stage is read,
not rerun, so an interrupted replication continues where it stopped. Later
runs read the finished stages of earlier ones (``--config.reuse_from``).
Budget (``BUDGET_MIN``; ``--dry_run`` prints it): each run's wall time alone
on the 2-core reference machine with nothing else running, estimated as its
CPU time (user + sys) / 1.37, the CPU/wall ratio of the byte-world
specialists' cold run on the idle machine (docs/LOG.md, 2026-11-30: 20 min
user in 14.6 min). The CPU times are those ``make demo``'s cut measured for
the same stages (docs/LOG.md, 2026-12-03; on a loaded machine, wall ~4x
these): specialists 436 s, the cold start 45 s, OPD (400 steps) 258 s,
annealing 20 s, mixed RL (420 steps) 227 s, a merge 2 s, an evaluation row
(200 examples a domain) 10 s. Stages the cut does not run are scaled from
OPD by their wall-time ratio to the OPD stage run beside them (docs/LOG.md,
tenth session): the positive control 1.24x, sequential RL 0.57x, off-policy
KD 0.35x, a seed's second cold start 0.13x its first, an estimator arm
0.19x. Each launch adds ~10 CPU-s of start-up.

  specialists 5.4 min, v4_strong 23.6, negative_control 3.7,
  anneal_confidence 1.2, mixed_rl_lr* 3 x 3.0, estimator_* 11 x 0.9 (+ full_s0,
  read from v4_strong, 0.1): total ~53 min; seeds 1 and 2's own baselines
  (twelfth session; baselines_s* 2 x 7.0, mixed_rl_lr6e-5_s* 2 x 3.2) ~20 min
  more. Measured (docs/LOG.md, eleventh session; fresh clone, empty compilation cache, idle 2 cores): 46 min 41 s,
  specialists 4.5, v4_strong 19.4, negative_control 3.8, anneal_confidence 1.4,
  mixed_rl_lr* 2.3 / 2.4 / 2.5, estimator_* 0.8-1.0 each.

Bounds: CPU / 2 (both cores always busy) ~36 min, CPU / 1 (no overlap) ~72
min. So nothing needs cutting for the issue's 3 hours; the 3.5 h the tenth
session's loaded wall times summed to were the load (17-26 on 2 cores).
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
    # Seeds 1 and 2's baselines from their own cold starts (seed 0's are in
    # v4_strong and v4_strong_rl6e-5): the student-side baselines (mixed and
    # sequential RL) start from the seed's cold start, and every baseline
    # samples with the seed (``baselines.seed``), so each seed compares like with like.
    *(run for seed in (1, 2) for run in (
        (f"baselines_s{seed}", f"{V4},all_baselines", f"v4_strong_s{seed}",
         (f"--config.reuse_from={REUSE}", f"--config.student_seeds=({seed},)",
          f"--config.baselines.seed={seed}", "--config.positive_control.steps=0")),
        (f"mixed_rl_lr6e-5_s{seed}", V4, f"v4_strong_rl6e-5_s{seed}",
         (f"--config.reuse_from={{root}}/v4_strong_s{seed},{REUSE}",
          f"--config.student_seeds=({seed},)", f"--config.baselines.seed={seed}",
          "--config.baselines.rl_optim.lr=6e-5", "--config.positive_control.steps=0")))),
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

# Estimated wall minutes of each run alone on the 2-core reference machine
# with nothing else running (how: the module docstring).
BUDGET_MIN: dict[str, float] = {
    "specialists": 5.4, "v4_strong": 23.6, "negative_control": 3.7, "anneal_confidence": 1.2,
    **{f"mixed_rl_lr{lr}": 3.0 for lr in ("2e-5", "6e-5", "6e-4")},
    # mixed RL 3.0 + sequential RL 1.7 + off-policy KD 1.0 + merges and five
    # evaluations ~1.3 (the scaling above); mixed RL at 6e-5 with its evaluation 3.2
    **{f"baselines_s{seed}": 7.0 for seed in (1, 2)},
    **{f"mixed_rl_lr6e-5_s{seed}": 3.2 for seed in (1, 2)},
    # full_s0 is the positive control's code run, read from v4_strong
    **{f"estimator_{arm}_s{seed}": 0.1 if (arm, seed) == ("full", 0) else 0.9
       for seed in (0, 1, 2) for arm in ("full", "top10", "top32", "token")},
}
BUDGET_LIMIT_MIN = 180  # issue #26: the full replication within 3 h

_ROOT = flags.DEFINE_string("root", "workdirs", "Directory holding every run's workdir.")
_ONLY = flags.DEFINE_list("only", [], f"Run only these (names: {', '.join(NAMES)}).")
_DRY = flags.DEFINE_bool("dry_run", False, "Print the commands and the budget, run nothing.")


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


def budget_table(names: Sequence[str]) -> str:
  """Each run's budget (``BUDGET_MIN``) and their total, one line each."""
  lines = [f"  {name:<22} {BUDGET_MIN[name]:6.1f} min" for name in names]
  total = sum(BUDGET_MIN[name] for name in names)
  return "\n".join([*lines, f"  {'total':<22} {total:6.1f} min "
                             f"(idle 2-core estimate; the bar is {BUDGET_LIMIT_MIN} min)"])


def run(root: str, only: Sequence[str] = (), dry_run: bool = False) -> None:
  """Prints the budget, then launches each run in turn (``dry_run``: prints only)."""
  todo = commands(root, only)
  print("[replicate] budget:\n" + budget_table([name for name, _ in todo]), flush=True)
  for i, (name, cmd) in enumerate(todo, 1):
    print(f"[replicate {i}/{len(todo)}] {name} (~{BUDGET_MIN[name]:.0f} min): "
          f"{' '.join(cmd[1:])}", flush=True)
    if not dry_run:
      subprocess.run(cmd, check=True)


def main(argv: Sequence[str]) -> None:
  del argv
  run(_ROOT.value, _ONLY.value, _DRY.value)


if __name__ == "__main__":
  app.run(main)
