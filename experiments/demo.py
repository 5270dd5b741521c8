"""``make demo``: a one-seed cut of the strong toy world, and the claims it shows.

  python -m experiments.demo --workdir=workdirs/demo [--config=FILE.py[:ARG]] [--nocut]
      [--nonegative_control]

Runs the V4 post-training pipeline on the strong world
(``experiments/configs/v4.py:strong``, job ``experiments.v4``; docs/RESULTS.md,
"A stronger toy world"): the BPE base, five specialists (shared SFT, SFT,
GRPO), the student's cold start, multi-teacher OPD and annealing for one
seed, mixed RL and the two merging baselines, every model on the five test
sets. Then the negative control in ``WORKDIR/negative_control`` (OPD and annealing with every
domain's teacher shifted one domain, the rest read from the first run).
Last it prints each claim the cut shows: the prediction, the paired
difference with its 95% interval, the chance of so large a difference
without an effect, and the control. Re-running continues where it stopped.

The cut (``CUT``, overrides of the strong config; ``--nocut`` runs the config
as given) keeps one seed and leaves out the positive control (five
single-teacher OPD runs), sequential RL, off-policy KD and seeds 1-2; mixed RL
runs at one rate, 6e-5, the best of the four the replication sweeps. It keeps
the full test sets (up to 200 examples a domain; an evaluation row costs ~10
CPU-s): at a quarter of them the paired SE of OPD + annealing − mixed RL (1.0
on the full sets, +3.7 measured) would double to ~1.9, a 95% interval of
±3.7 that no longer excludes 0. Everything the cut leaves out is in
``python -m experiments.replicate``.

Time (docs/LOG.md, 2026-12-03; empty compilation cache, a machine loaded by
other jobs; measured stage by stage over two runs that share the specialists,
the student and the negative control's training): 1,439 CPU-s (user + sys;
the specialists 436, the student 323, mixed RL 227, the negative control's
OPD and annealing 298, 15 evaluation rows 143, the merges 4, start-up 8); the
pieces took 71 min wall there.
At the idle 2-core machine's CPU/wall ratio of 1.37 (the byte-world
specialists' cold run: 20 min user in 14.6 min wall) that is ~18 min cold
(bounds: CPU / 2 = 12 min, CPU / 1 = 24 min). Printed: OPD − cold
start +8.5 ± 1.0, the negative control −30.4 ± 1.4, OPD + annealing − mixed RL
+3.7 ± 1.0 (95% [+1.7, +5.7]), − weight average +17.9 ± 1.3, − task arithmetic
+33.9 ± 1.2: all five shown, each equal to the full strong run's seed 0 (the
same stages; the runs are deterministic).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import resource
import sys
import time

from absl import app, flags

DEMO_CONFIG = "experiments/configs/v4.py:strong"
# Overrides of DEMO_CONFIG for the demo's cut (fields outside config.opd).
CUT = ("positive_control.steps=0", "baselines.baselines=('merge', 'task_arithmetic', 'mixed_rl')",
       "baselines.rl_optim.lr=6e-5")
# The negative control's run: its own workdir, every finished stage read from
# the main run (``{main}``), OPD and annealing with the teachers shifted.
NEGATIVE_CONTROL_DIR = "negative_control"
NEGATIVE_CONTROL = ("teacher_shift=1", "reuse_from={main}")

flags.DEFINE_string("workdir", "workdirs/demo", "where every stage writes its run directory")
flags.DEFINE_string("config", DEMO_CONFIG, "config file (and optional :ARG) to run")
flags.DEFINE_bool("cut", True, "apply the demo's cut (CUT) to the config")
flags.DEFINE_bool("negative_control", True,
                  "also run the negative control (a v4 job only) and print the claims")
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Claim:
  """``a − b > 0`` (``sign`` +1) or ``< 0`` (−1) on the average greedy reward@1.

  ``a`` and ``b`` are ``(run, row)``: run ``"main"`` or ``"negative_control"``
  and a row of that run's ``v4/results.json``.
  """
  name: str
  a: tuple[str, str]
  b: tuple[str, str]
  sign: int
  prediction: str
  control: str


CLAIMS = (
    Claim("OPD beats its cold start", ("main", "student: OPD#0"),
          ("main", "student: cold start#0"), +1,
          "OPD − cold start > 0 (the full strong run, seed 0: +8.5 ± 1.0)",
          "the negative control below: the same OPD budget with the wrong teachers"),
    Claim("negative control: OPD with every domain's teacher shifted falls below the cold start",
          ("negative_control", "student: OPD#0"), ("main", "student: cold start#0"), -1,
          "shifted OPD − cold start ≤ −5 (the full strong run: −30.4 ± 1.4)",
          "the cold start, the same student before any OPD"),
    Claim("OPD + annealing beats mixed RL at equal updates and sampled tokens",
          ("main", "student: OPD + annealing#0"), ("main", "baseline: mixed RL"), +1,
          "OPD + annealing − mixed RL (lr 6e-5) > 0 (the full strong run: +3.7 ± 1.0)",
          "mixed RL's own gain over the cold start (its row against the cold start's)"),
    Claim("OPD + annealing beats weight averaging of the specialists",
          ("main", "student: OPD + annealing#0"), ("main", "baseline: weight average"), +1,
          "OPD + annealing − weight average > 0 (the full strong run: +17.9 ± 1.3)",
          "the specialists it merges (their rows in the table above)"),
    Claim("OPD + annealing beats task arithmetic",
          ("main", "student: OPD + annealing#0"), ("main", "baseline: task arithmetic"), +1,
          "OPD + annealing − task arithmetic > 0",
          "the specialists it merges (their rows in the table above)"),
)


def load_demo_config(spec: str = DEMO_CONFIG, cut: bool = True, extra=()):
  """The config ``spec`` with the demo's ``CUT`` (if ``cut``) and ``extra`` overrides."""
  from opd.config import overrides as config_utils  # noqa: PLC0415 (flags first, jax late)
  config = config_utils.load_config(spec)
  config_utils.apply_overrides(config, [*(CUT if cut else ()), *extra])
  return config


def negative_control_overrides(main_workdir: str | pathlib.Path) -> tuple[str, ...]:
  """``NEGATIVE_CONTROL`` with the main run's workdir filled in."""
  return tuple(o.format(main=main_workdir) for o in NEGATIVE_CONTROL)


def judge(claim: Claim, diff: float, se: float) -> dict:
  """A claim's outcome from the average paired difference and its SE.

  ``shown``: the 95% interval excludes 0 on the predicted side. ``chance``:
  the two-sided probability of a difference at least ``|diff|`` from 0 when
  the two models do not differ (normal approximation, ``erfc(|z| / √2)``;
  with ``se`` 0, every example's difference equal: 0 unless ``diff`` is 0).
  """
  if not se >= 0:
    raise ValueError(f"claim {claim.name!r}: standard error {se!r} must be >= 0")
  lo, hi = diff - 1.96 * se, diff + 1.96 * se
  shown = lo > 0 if claim.sign > 0 else hi < 0
  if se > 0:
    chance = math.erfc(abs(diff / se) / math.sqrt(2))
  else:
    chance = 1.0 if diff == 0 else 0.0
  return {"diff": diff, "se": se, "ci": (lo, hi), "shown": shown, "chance": chance}


def claims_report(workdirs: dict[str, str | pathlib.Path], claims=CLAIMS) -> str:
  """Each claim's prediction, outcome, interval, chance and control, as text."""
  from experiments import paired_diff  # noqa: PLC0415

  def row(ref):
    run, name = ref
    return paired_diff.row(f"{workdirs[run]}:{name}")

  def label(ref):
    run, name = ref
    return name if run == "main" else f"{name} ({run.replace('_', ' ')})"

  lines = ["", "Claims this demo shows (greedy reward@1, average over the test sets, "
           "paired over test examples; 95% interval = ± 1.96 SE):"]
  for i, claim in enumerate(claims, 1):
    diff, se = paired_diff.compare(row(claim.a), row(claim.b), "reward@1")["average"]
    out = judge(claim, diff, se)
    lines += [f"{i}. {claim.name}: {'SHOWN' if out['shown'] else 'NOT SHOWN'}",
              f"   prediction: {claim.prediction}",
              f"   outcome:    {label(claim.a)} − {label(claim.b)} = {diff:+.1f} ± {se:.1f} "
              f"(95% [{out['ci'][0]:+.1f}, {out['ci'][1]:+.1f}])",
              f"   chance:     {out['chance']:.1g} (two-sided, no difference)",
              f"   control:    {claim.control}"]
  lines.append("Not in this cut (python -m experiments.replicate): sequential RL, off-policy "
               "KD, mixed RL's other rates, the positive control, seeds 1-2, the estimator "
               "ablation.")
  return "\n".join(lines)


def _cpu_s() -> float:
  """User + system CPU seconds of this process and its waited-for children."""
  return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                               resource.getrusage(resource.RUSAGE_CHILDREN)))


def _launch(config, workdir: pathlib.Path, label: str) -> dict:
  from experiments import launch  # noqa: PLC0415
  wall, cpu = time.monotonic(), _cpu_s()
  print(f"[demo] {label} → {workdir}  (job {config.job!r})", flush=True)
  metrics = launch.launch(config, workdir)
  print(f"[demo] {label} done: {time.monotonic() - wall:.0f} s wall, "
        f"{_cpu_s() - cpu:.0f} s CPU (user + sys)", flush=True)
  return metrics


def main(argv):
  del argv
  from experiments.common import enable_compilation_cache  # noqa: PLC0415
  enable_compilation_cache()
  workdir = pathlib.Path(FLAGS.workdir)
  config = load_demo_config(FLAGS.config, FLAGS.cut)
  metrics = _launch(config, workdir, "main run")
  print("[demo] final metrics in", workdir / "final_metrics.json")
  for key in ("heatmap", "diagnostics", "report", "plot"):
    if metrics.get(key):
      print(f"[demo] {key}: {metrics[key]}")
  if not (FLAGS.negative_control and config.job == "v4"):
    return 0
  control_dir = workdir / NEGATIVE_CONTROL_DIR
  control = load_demo_config(FLAGS.config, FLAGS.cut, negative_control_overrides(workdir))
  _launch(control, control_dir, "negative control")
  print(claims_report({"main": workdir, "negative_control": control_dir}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
