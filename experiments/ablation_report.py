r"""Report of an OPD ablation sweep: ``python -m experiments.ablation_report --sweep_dir=DIR``.

Reads a sweep made by ``experiments.sweep`` from an ablation of
``experiments/configs/distill.py`` (``ablation=estimator|cold_start|weighting``):
``DIR/sweep_summary.json`` (each run's overrides, status) and each run's
``DIR/<run>/metrics.jsonl`` and ``final_metrics.json``. Runs are grouped
into arms by ``run_label`` (else by their overrides other than ``seed``);
the first arm in sweep order is the reference (the full-vocabulary
estimator, the cold-started student, routing).

Per run, the curve metrics of docs/DESIGN.md §3 ("Baselines and curve
metrics", ``opd.eval.curves.ablation_metrics``): loss fluctuation (%),
gradient-norm CV, final reward, that reward as % of the reference arm's run
with the same seed, the first step reaching 90% of that run's final reward,
the mean wall time per step after the first (which compiles); and the final
held-out reverse KL per teacher. Per arm: mean ± std (ddof 1) over seeds.
The estimator sweep's table also stands beside the seed's figures
(``SEED_FIGURES``). Writes ``ablation_report.{md,json}`` and
``ablation_curves.png`` (loss and reward curves, mean ± std over seeds per
step) to ``--out_dir`` (default DIR).

``run_tiny_ablation`` runs the ``tiny`` form of a sweep in this process (the
teachers built once, one compile cache): what the notebook and CI use.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opd.eval import curves
from opd.training import metrics_writer

SUMMARY_FILE = "sweep_summary.json"
FINAL_METRICS_FILE = "final_metrics.json"
REPORT = "ablation_report"
PLOT = "ablation_curves.png"
FRACTION = 0.9
STEPS_KEY = f"steps_to_{FRACTION:g}_of_reference"
# The seed's figures for the estimator ablation (issue #10): loss fluctuation
# (%), final score (% of full vocabulary), steps to converge (× full's).
SEED_FIGURES = {"full": (2.0, 100.0, 1.0), "top-10": (5.0, 97.0, None),
                "token": (15.0, 92.0, 1.5)}
CURVE_KEYS = ("train/loss", "reward/mean")
TIME_KEY = "perf/step_time_s"


@dataclasses.dataclass
class Run:
  """One finished run of the sweep."""
  name: str
  label: str
  seed: int
  history: list[dict[str, Any]]
  final: dict[str, Any]


def _label(overrides: Mapping[str, Any]) -> str:
  if overrides.get("run_label"):
    return str(overrides["run_label"])
  rest = [f"{k.split('.')[-1]}={v}" for k, v in overrides.items() if k != "seed"]
  return ", ".join(rest) or "base"


def load_runs(sweep_dir: str | os.PathLike) -> tuple[list[Run], list[str]]:
  """``(finished runs in sweep order, names of runs that did not finish)``.

  A run's directory is ``sweep_dir/<name>`` (not the absolute path recorded in
  the summary, so a sweep directory can be moved or copied).
  """
  sweep_dir = pathlib.Path(sweep_dir)
  path = sweep_dir / SUMMARY_FILE
  if not path.is_file():
    raise ValueError(f"sweep_dir={str(sweep_dir)!r} has no {SUMMARY_FILE}: run "
                     "python -m experiments.sweep --workdir=... first")
  runs, failed = [], []
  for entry in json.loads(path.read_text()):
    if entry["status"] not in ("ok", "cached"):
      failed.append(entry["name"])
      continue
    run_dir = sweep_dir / entry["name"]
    final = run_dir / FINAL_METRICS_FILE
    runs.append(Run(entry["name"], _label(entry["overrides"]),
                    int(entry["overrides"].get("seed", 0)),
                    metrics_writer.read_metrics(run_dir),
                    json.loads(final.read_text()) if final.is_file() else {}))
  if not runs:
    raise ValueError(f"sweep_dir={str(sweep_dir)!r}: no finished run (failed: {failed})")
  return runs, failed


def group_arms(runs: Sequence[Run]) -> dict[str, list[Run]]:
  """``{label: runs}`` in sweep order; the first arm is the reference."""
  arms: dict[str, list[Run]] = {}
  for r in runs:
    arms.setdefault(r.label, []).append(r)
  return arms


def run_metrics(runs: Sequence[Run]) -> list[dict[str, Any]]:
  """One row per run: ``ablation_metrics`` against the reference arm's run of
  the same seed (its first run if it has none), plus ``rkl_final/<teacher>``."""
  arms = group_arms(runs)
  reference = next(iter(arms.values()))
  by_seed = {r.seed: r for r in reference}
  rows = []
  for r in runs:
    ref = by_seed.get(r.seed, reference[0])
    try:
      m = curves.ablation_metrics(r.history, ref.history, fraction=FRACTION)
    except ValueError as e:
      raise ValueError(f"run {r.name}: {e}") from None
    if m["final_reward_pct_of_reference"] is None:
      m[STEPS_KEY] = None  # the reference ends at reward 0: any step "reaches" 90% of it
    times = [row[TIME_KEY] for row in r.history if TIME_KEY in row][1:]
    if times:  # the first step compiles every program: left out of the time per step
      m["step_time_s"] = float(np.mean(times))
    m.update({k: v for k, v in r.final.items() if k.startswith("rkl_final/")})
    rows.append({"run": r.name, "arm": r.label, "seed": r.seed, **m})
  return rows


def _stats(values: Sequence[float | None]) -> dict[str, float | int | None]:
  x = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
  return {"mean": float(x.mean()) if x.size else None,
          "std": float(x.std(ddof=1)) if x.size > 1 else None,
          "n": int(x.size), "of": len(values)}


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict]]:
  """``{arm: {metric: {"mean", "std" (ddof 1), "n" (finite values), "of" (runs)}}}``.

  Also ``steps_ratio``: the arm's mean steps to 90% over the reference arm's.
  """
  arms: dict[str, list[Mapping[str, Any]]] = {}
  for row in rows:
    arms.setdefault(row["arm"], []).append(row)
  out = {}
  for arm, arm_rows in arms.items():
    keys = [k for k in arm_rows[0] if k not in ("run", "arm", "seed")]
    out[arm] = {k: _stats([r.get(k) for r in arm_rows]) for k in keys}
  ref_steps = next(iter(out.values()))[STEPS_KEY]["mean"]
  for stats in out.values():
    mean = stats[STEPS_KEY]["mean"]
    stats["steps_ratio"] = {"mean": mean / ref_steps if mean is not None and ref_steps else None,
                            "std": None, "n": stats[STEPS_KEY]["n"],
                            "of": stats[STEPS_KEY]["of"]}
  return out


def seed_bands(runs: Sequence[Run], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(steps [S], mean [S], std [S])`` of ``key`` over the runs (ddof 0), on
  the steps every run logged it."""
  series = [{row["step"]: row[key] for row in r.history if key in row} for r in runs]
  steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
  if not steps:
    raise ValueError(f"no step where every run logged {key!r}: {[r.name for r in runs]}")
  values = np.asarray([[s[t] for t in steps] for s in series], np.float64)  # [runs, S]
  return np.asarray(steps), values.mean(axis=0), values.std(axis=0)


def curves_figure(arms: Mapping[str, Sequence[Run]], keys: Sequence[str] = CURVE_KEYS):
  """A matplotlib Figure, one panel per key: per arm the mean over seeds and a
  ±1 std band, against the step."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(5.5 * len(keys), 3.6))
  FigureCanvasAgg(fig)  # no pyplot: nothing global changes, no display needed
  for i, key in enumerate(keys):
    ax = fig.add_subplot(1, len(keys), i + 1)
    for arm, runs in arms.items():
      steps, mean, std = seed_bands(runs, key)
      (line,) = ax.plot(steps, mean, label=f"{arm} (n={len(runs)})")
      ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(f"{key}: mean ± std over seeds")
    ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def _cell(s: Mapping[str, Any], fmt: str = ".3g", count: bool = False) -> str:
  if s["mean"] is None:
    text = "–"
  else:
    text = format(s["mean"], fmt) + ("" if s["std"] is None else " ± " + format(s["std"], fmt))
  return text + (f" ({s['n']}/{s['of']})" if count else "")


def markdown(summary: Mapping[str, Mapping[str, Mapping]], title: str = "") -> str:
  """The tables: curve metrics per arm, held-out reverse KL per teacher, and
  (when the arms are the estimator's) ours beside the seed's figures."""
  arms = list(summary)
  ref = arms[0]
  lines = [f"## {title or 'Ablation'} (mean ± std over seeds; reference: {ref})", "",
           f"| arm | seeds | loss fluctuation (%) | grad-norm CV | final reward | "
           f"final reward (% of {ref}) | steps to 90% of {ref} (reached) | s/step |",
           "|---|---|---|---|---|---|---|---|"]
  for arm, s in summary.items():
    time_cell = _cell(s["step_time_s"], ".2f") if "step_time_s" in s else "–"
    lines.append(f"| {arm} | {s['final_reward']['of']} | {_cell(s['loss_fluctuation_pct'], '.2f')}"
                 f" | {_cell(s['grad_norm_cv'], '.3f')} | {_cell(s['final_reward'])} | "
                 f"{_cell(s['final_reward_pct_of_reference'], '.1f')} | "
                 f"{_cell(s[STEPS_KEY], '.1f', count=True)} | {time_cell} |")
  teachers = sorted({k.split("/", 1)[1] for s in summary.values() for k in s
                     if k.startswith("rkl_final/")})
  if teachers:
    lines += ["", "Held-out reverse KL to each teacher after training:", "",
              "| arm | " + " | ".join(teachers) + " |", "|---|" + "---|" * len(teachers)]
    lines += [f"| {arm} | " + " | ".join(_cell(s[f"rkl_final/{t}"]) if f"rkl_final/{t}" in s
                                         else "–" for t in teachers) + " |"
              for arm, s in summary.items()]
  if ref == "full" and any(a in SEED_FIGURES for a in arms[1:]):
    lines += ["", "Beside the seed's figures:", "",
              "| estimator | loss fluct. (%) | seed | final (% of full) | seed | "
              "steps to 90% (× full) | seed |", "|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
      seed = SEED_FIGURES.get(arm, (None, None, None))
      ratio = s["steps_ratio"]["mean"]
      lines.append(
          f"| {arm} | {_cell(s['loss_fluctuation_pct'], '.2f')} | {_fmt(seed[0], '±{:g}')} | "
          f"{_cell(s['final_reward_pct_of_reference'], '.1f')} | {_fmt(seed[1], '{:g}')} | "
          f"{'–' if ratio is None else f'{ratio:.2f}×'} | {_fmt(seed[2], '{:g}×')} |")
  return "\n".join(lines) + "\n"


def _fmt(x, pattern: str) -> str:
  return "–" if x is None else pattern.format(x)


def report(sweep_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
           title: str = "") -> dict[str, Any]:
  """Computes, writes and returns the report of the sweep in ``sweep_dir``.

  Returns:
    ``{"summary", "runs", "failed", "markdown", "paths"}``; the JSON file holds
    the same without ``paths``.
  """
  runs, failed = load_runs(sweep_dir)
  rows = run_metrics(runs)
  summary = summarize(rows)
  text = markdown(summary, title or pathlib.Path(sweep_dir).name)
  if failed:
    text += f"\n{len(failed)} run(s) did not finish and are left out: {', '.join(failed)}\n"
  out = pathlib.Path(out_dir or sweep_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = {"md": out / f"{REPORT}.md", "json": out / f"{REPORT}.json", "png": out / PLOT}
  result = {"summary": summary, "runs": rows, "failed": failed, "markdown": text,
            "seed_figures": SEED_FIGURES}
  paths["md"].write_text(text)
  paths["json"].write_text(json.dumps(result, indent=2) + "\n")
  curves_figure(group_arms(runs)).savefig(paths["png"], dpi=90)
  return {**result, "paths": paths}


def run_tiny_ablation(sweep_dir: str | os.PathLike, ablation: str = "estimator",
                      config_file: str | os.PathLike | None = None,
                      max_runs: int | None = None) -> list:
  """Runs ``distill.py:tiny,ablation=<ablation>`` in this process (its first
  ``max_runs`` entries when given: the sweep goes seed by seed, so a prefix
  holds every arm at the first seeds).

  The two tiny teachers are built once (``sweep_dir/teachers``) and shared
  by every run; each run writes ``sweep_dir/<run_name>`` and the sweep's
  summary files, as ``experiments.sweep`` would (finished runs are kept).

  Returns:
    The ``experiments.sweep.RunResult`` of every entry.
  """
  if max_runs is not None and max_runs <= 0:
    raise ValueError(f"max_runs={max_runs}: expected a positive number of runs")
  from experiments import common, launch, sweep
  from experiments import distill as distill_job
  from opd.config import overrides as config_utils
  config_file = config_file or pathlib.Path(__file__).parent / "configs" / "distill.py"
  sweep_dir = pathlib.Path(sweep_dir)
  common.enable_compilation_cache()
  config = config_utils.load_config(f"{config_file}:tiny,ablation={ablation}")
  distill_job.load_teachers(config, sweep_dir, *common.mesh_and_rules(config))
  spec = f"{config_file}:tiny,ablation={ablation},teachers_dir={sweep_dir / 'teachers'}"
  results = []
  entries = config_utils.load_sweep(spec)[:max_runs]
  for i, overrides in enumerate(entries):
    name = sweep.run_name(i, overrides)
    run_dir = sweep_dir / name
    start = time.time()
    if (run_dir / FINAL_METRICS_FILE).is_file():
      metrics, status = json.loads((run_dir / FINAL_METRICS_FILE).read_text()), "cached"
    else:
      metrics, status = launch.launch(config_utils.apply_overrides(
          config_utils.load_config(spec), overrides), run_dir), "ok"
    results.append(sweep.RunResult(name, overrides, status, 0, time.time() - start, metrics,
                                   str(run_dir)))
  sweep.write_summary(results, sweep_dir)
  return results


def main() -> None:
  from absl import app, flags

  sweep_dir = flags.DEFINE_string("sweep_dir", None, "The sweep's directory.", required=True)
  out_dir = flags.DEFINE_string("out_dir", None, "Where to write (default: --sweep_dir).")
  title = flags.DEFINE_string("title", "", "Heading of the tables (default: the directory name).")

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}")
    result = report(sweep_dir.value, out_dir.value, title.value)
    print(result["markdown"])
    print("wrote " + ", ".join(str(p) for p in result["paths"].values()))

  app.run(run)


if __name__ == "__main__":
  main()
