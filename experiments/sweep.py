r"""Runs a config's sweep: ``python -m experiments.sweep --config=FILE.py:ARG --workdir=DIR``.

The config file's ``get_sweep(arg)`` returns a list of override dicts
(``[{"optim.lr": 1e-3}, {"optim.lr": 3e-3}, ...]``). Each entry runs as its
own ``python -m experiments.launch`` subprocess in ``DIR/<run_name>`` (so a
crash in one run is recorded and the sweep goes on), one after another.
A run whose ``final_metrics.json`` already exists is not run again unless
``--rerun``. The sweep holds ``DIR``'s lock for its life (a second sweep on
the same directory is refused, naming the holder) and every run holds its
own; every summary file is written atomically. At the end the sweep writes ``DIR/sweep_summary.{csv,md,json}``
(each run's overrides, status and final metrics) and ``DIR/sweep_summary.png``
(each final metric against the swept value, then the training curves from
each run's ``metrics.jsonl`` when present).

Flags: --config, --workdir, --max_runs=N (first N entries), --metrics=a,b
(metrics to plot; default: every numeric final metric, at most 6),
--jobs_module (passed to each launch), --run_timeout seconds, --rerun.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.launch import FINAL_METRICS_FILE
from opd.config import overrides as config_utils
from opd.training import metrics_writer
from opd.training.files import atomic_write_json, atomic_write_text, read_json
from opd.training.workdir import WorkdirLock

SUMMARY = "sweep_summary"
MAX_PLOTTED = 6


@dataclasses.dataclass
class RunResult:
  """Outcome of one sweep entry."""
  name: str
  overrides: dict[str, Any]
  status: str  # "ok", "failed", "timeout" or "cached"
  returncode: int | None
  seconds: float
  metrics: dict[str, Any]
  workdir: str


def _format_value(key: str, value: Any) -> str:
  """The text a ``--config.key=`` flag needs to reproduce ``value``."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float, str)):
    return repr(value) if isinstance(value, float) else str(value)
  if isinstance(value, tuple) and all(isinstance(v, (int, float, str, bool)) for v in value):
    return repr(value)
  raise ValueError(f"sweep override {key!r}={value!r} ({type(value).__name__}) cannot be passed "
                   "as a --config flag; use bool, int, float, str or a tuple of those")


def run_name(index: int, overrides: Mapping[str, Any]) -> str:
  """``003_lr=0.001_steps=10``: the index keeps names unique and sorted."""
  parts = [f"{k.split('.')[-1]}={_format_value(k, v)}" for k, v in overrides.items()]
  name = f"{index:03d}_" + ("_".join(parts) if parts else "base")
  return re.sub(r"[^A-Za-z0-9._=+-]+", "-", name)[:120]


def _numeric(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def run_sweep(config_spec: str, workdir: str | os.PathLike, *, max_runs: int | None = None,
              metrics: Sequence[str] | None = None, jobs_modules: Sequence[str] = (),
              run_timeout: float | None = None, rerun: bool = False,
              env: Mapping[str, str] | None = None) -> list[RunResult]:
  """Runs every sweep entry in a subprocess, then writes the summary and plot.

  Args:
    config_spec: ``"path/to/config.py:arg"``.
    workdir: the sweep directory; run ``i`` goes to ``workdir/<run_name>``.
    max_runs: only the first ``max_runs`` entries.
    metrics: final metrics to plot (default: all numeric ones, at most 6).
    jobs_modules: passed as ``--jobs_module`` to each launch.
    run_timeout: seconds after which a run is killed and marked "timeout".
    rerun: run entries again even when their ``final_metrics.json`` exists.
    env: environment of the subprocesses (default: this process's).

  Returns:
    One ``RunResult`` per entry, in sweep order.
  """
  path, arg = config_utils.split_config_spec(config_spec)
  spec = str(pathlib.Path(path).resolve()) + ("" if arg is None else f":{arg}")
  sweep = config_utils.load_sweep(spec)
  if max_runs is not None:
    if max_runs <= 0:
      raise ValueError(f"max_runs must be positive, got {max_runs}")
    sweep = sweep[:max_runs]
  if not sweep:
    raise ValueError(f"{path}: get_sweep() returned no runs")
  # Check every entry before the first (possibly long) run starts.
  flags_per_run = []
  for i, overrides in enumerate(sweep):
    try:
      config_utils.apply_overrides(config_utils.load_config(spec), overrides)
    except ValueError as e:
      raise ValueError(f"sweep entry {i} {overrides}: {e}") from None
    flags_per_run.append([f"--config.{k}={_format_value(k, v)}" for k, v in overrides.items()])

  workdir = pathlib.Path(workdir)
  with WorkdirLock(workdir):  # one sweep per directory; each run locks its own
    results = _run_entries(spec, sweep, flags_per_run, workdir, jobs_modules, run_timeout,
                           rerun, env)
    write_summary(results, workdir, metrics=metrics)
  return results


def _run_entries(spec, sweep, flags_per_run, workdir: pathlib.Path, jobs_modules, run_timeout,
                 rerun, env) -> list[RunResult]:
  results = []
  for i, (overrides, run_flags) in enumerate(zip(sweep, flags_per_run)):
    name = run_name(i, overrides)
    run_dir = workdir / name
    final = run_dir / FINAL_METRICS_FILE
    if final.exists() and not rerun:
      results.append(RunResult(name, overrides, "cached", 0, 0.0,
                               read_json(final, expect=dict), str(run_dir)))
      continue
    run_dir.mkdir(parents=True, exist_ok=True)
    if final.exists():
      final.unlink()
    cmd = [sys.executable, "-m", "experiments.launch", f"--config={spec}",
           f"--workdir={run_dir}", *run_flags, *(f"--jobs_module={m}" for m in jobs_modules)]
    print(f"[sweep] {i + 1}/{len(sweep)} {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    with open(run_dir / "log.txt", "w") as log:
      log.write(" ".join(cmd) + "\n")
      log.flush()
      try:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=run_timeout,
                              env=dict(env) if env is not None else None)
        returncode = proc.returncode
        status = "ok" if returncode == 0 and final.exists() else "failed"
      except subprocess.TimeoutExpired:
        returncode, status = None, "timeout"
    seconds = time.time() - start
    run_metrics = read_json(final, expect=dict) if status == "ok" else {}
    if status != "ok":
      tail = (run_dir / "log.txt").read_text().strip().splitlines()[-3:]
      print(f"[sweep] {name} {status} (returncode {returncode}); see {run_dir / 'log.txt'}:\n  "
            + "\n  ".join(tail), flush=True)
    results.append(RunResult(name, overrides, status, returncode, seconds, run_metrics,
                             str(run_dir)))
  return results


def _columns(results: Sequence[RunResult]) -> tuple[list[str], list[str]]:
  override_keys, metric_keys = [], []
  for r in results:
    override_keys += [k for k in r.overrides if k not in override_keys]
    metric_keys += [k for k in r.metrics if k not in metric_keys]
  return override_keys, metric_keys


def write_summary(results: Sequence[RunResult], workdir: str | os.PathLike, *,
                  metrics: Sequence[str] | None = None) -> dict[str, pathlib.Path]:
  """Writes ``sweep_summary.{csv,md,json,png}`` (each atomically) and returns their paths."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  override_keys, metric_keys = _columns(results)
  header = ["run", "status", "seconds", *override_keys, *metric_keys]
  rows = [[r.name, r.status, f"{r.seconds:.1f}",
           *(r.overrides.get(k, "") for k in override_keys),
           *(r.metrics.get(k, "") for k in metric_keys)] for r in results]
  paths = {ext: workdir / f"{SUMMARY}.{ext}" for ext in ("csv", "md", "json", "png")}
  table = io.StringIO(newline="")
  writer = csv.writer(table)
  writer.writerow(header)
  writer.writerows(rows)
  atomic_write_text(paths["csv"], table.getvalue())

  def cell(x):
    return f"{x:.6g}" if isinstance(x, float) else str(x)

  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  atomic_write_text(paths["md"], "\n".join(lines) + "\n")
  atomic_write_json(paths["json"], [dataclasses.asdict(r) for r in results])

  if metrics is None:
    metrics = [k for k in metric_keys
               if any(_numeric(r.metrics.get(k)) for r in results)][:MAX_PLOTTED]
  else:
    unknown = [m for m in metrics if m not in metric_keys]
    if unknown:
      raise ValueError(f"metrics {unknown} are not final metrics of any run; known: {metric_keys}")
  plot_summary(results, metrics, paths["png"])
  return paths


def _swept_axis(results: Sequence[RunResult]) -> tuple[str, list[float]] | None:
  """The single override key that varies numerically across runs, if any."""
  override_keys, _ = _columns(results)
  varying = [k for k in override_keys
             if len({repr(r.overrides.get(k)) for r in results}) > 1]
  if len(varying) == 1 and all(_numeric(r.overrides.get(varying[0])) for r in results):
    return varying[0], [float(r.overrides[varying[0]]) for r in results]
  return None


def _curves(results: Sequence[RunResult]) -> dict[str, list[dict[str, Any]]]:
  curves = {}
  for r in results:
    log = pathlib.Path(r.workdir) / metrics_writer.METRICS_FILE
    if log.exists():
      curves[r.name] = metrics_writer.read_metrics(log)
  return curves


def plot_summary(results: Sequence[RunResult], metrics: Sequence[str],
                 path: str | os.PathLike, curve_metrics: Sequence[str] | None = None) -> None:
  """One panel per final metric (against the swept value, or one bar per run),
  then one panel per training curve from the runs' ``metrics.jsonl``.

  Args:
    results: the runs.
    metrics: final metrics to plot.
    path: the PNG to write.
    curve_metrics: JSONL metrics to plot against step; default every numeric
      one (at most ``MAX_PLOTTED``).
  """
  import matplotlib
  matplotlib.use("Agg")  # no display; must precede pyplot
  import matplotlib.pyplot as plt
  from matplotlib.ticker import NullFormatter

  curves = _curves(results)
  if curve_metrics is None:
    curve_metrics = []
    for rows in curves.values():
      for row in rows:
        curve_metrics += [k for k, v in row.items() if k not in ("step", "wall_time")
                          and k not in curve_metrics and _numeric(v)]
    curve_metrics = curve_metrics[:MAX_PLOTTED]
  panels = [("final", m) for m in metrics] + [("curve", m) for m in curve_metrics]
  n_cols = 2 if len(panels) > 1 else 1
  n_rows = max(math.ceil(len(panels) / n_cols), 1)
  fig, axes = plt.subplots(n_rows, n_cols, figsize=(5.5 * n_cols, 3.4 * n_rows), squeeze=False)
  axes = axes.reshape(-1)
  for ax in axes[len(panels):]:
    ax.axis("off")
  if not panels:
    axes[0].text(0.5, 0.5, "no numeric metrics", ha="center", va="center")
  axis = _swept_axis(results)
  failed = [r.name for r in results if r.status not in ("ok", "cached")]
  note = f" ({len(failed)} run(s) failed)" if failed else ""
  for ax, (kind, metric) in zip(axes, panels):
    ax.set_ylabel(metric)
    if kind == "curve":
      for name, rows in curves.items():
        pts = [(p["step"], p[metric]) for p in rows if _numeric(p.get(metric))]
        if pts:
          ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
      ax.set_xlabel("step")
      ax.set_title(f"{metric} during training{note}")
      if ax.lines:
        ax.legend(fontsize=7)
      continue
    ok = [(i, r) for i, r in enumerate(results) if _numeric(r.metrics.get(metric))]
    if axis is not None:
      key, xs = axis
      pts = sorted((xs[i], r.metrics[metric]) for i, r in ok)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
      if pts and min(p[0] for p in pts) > 0 and max(p[0] for p in pts) >= 10 * min(p[0] for p in pts):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
      ax.set_xlabel(key)
    else:
      ax.bar(range(len(ok)), [r.metrics[metric] for _, r in ok])
      ax.set_xticks(range(len(ok)), [r.name for _, r in ok], rotation=30, ha="right", fontsize=7)
    ax.set_title(f"final {metric}{note}")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def main() -> None:
  from absl import app, flags

  config = flags.DEFINE_string("config", None, "Config file and argument, FILE.py:ARG.",
                               required=True)
  workdir = flags.DEFINE_string("workdir", None, "Sweep directory.", required=True)
  max_runs = flags.DEFINE_integer("max_runs", None, "Run only the first N entries.")
  metrics = flags.DEFINE_list("metrics", None, "Final metrics to plot.")
  modules = flags.DEFINE_multi_string("jobs_module", [], "Passed to each launch.")
  timeout = flags.DEFINE_float("run_timeout", None, "Seconds before a run is killed.")
  rerun = flags.DEFINE_bool("rerun", False, "Run entries again even if they finished.")

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}")
    results = run_sweep(config.value, workdir.value, max_runs=max_runs.value,
                        metrics=metrics.value, jobs_modules=modules.value,
                        run_timeout=timeout.value, rerun=rerun.value)
    print(pathlib.Path(workdir.value, f"{SUMMARY}.md").read_text())
    failed = [r.name for r in results if r.status not in ("ok", "cached")]
    if failed:
      print(f"{len(failed)} run(s) failed: {failed}", file=sys.stderr)
      sys.exit(1)

  app.run(run)


if __name__ == "__main__":
  main()
