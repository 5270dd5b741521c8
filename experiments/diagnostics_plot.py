"""OPD diagnostics over training, per teacher: top-k overlap and reverse KL by position (docs/DESIGN.md §3).

The OPD rollout source (``opd.distill.source``) logs ``diag/<teacher>/<metric>``
to the run's ``metrics.jsonl`` every ``opd.diag_every`` rollout batches
(``opd.distill.diagnostics``): the diagnostics of batch ``s`` (0-based, the
student's params before update ``s + 1``) are written at step ``s + 1``, so
the point at step 1 is the untrained student's. This module reads those
series back and draws them:

* ``read_diagnostics``: ``{teacher: {metric: (steps [n], values [n])}}`` from
  one run directory or several consecutive ones (OPD, then annealing), the
  later stages' steps shifted past the earlier ones' last step;
* ``diagnostics_figure`` / ``plot_diagnostics``: one panel per metric of
  ``PANELS`` (top-8 overlap; reverse KL over the first 25%, middle 50% and
  last 25% of each response), a line per teacher;
* ``endpoints``: the first and the mean of the last ``tail`` points of each
  series, for tables.
"""
from __future__ import annotations

import math
import pathlib
from typing import Mapping, Sequence

import numpy as np

from opd.training.metrics_writer import read_metrics

PREFIX = "diag/"
PANELS = (("overlap@8", "top-8 overlap (student ∩ teacher)"),
          ("rkl_first", "reverse KL, first 25% of tokens"),
          ("rkl_middle", "reverse KL, middle 50%"),
          ("rkl_last", "reverse KL, last 25%"))

Series = dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]


def read_diagnostics(run_dirs: str | pathlib.Path | Sequence[str | pathlib.Path]) -> Series:
  """``{teacher: {metric: (steps, values)}}`` of the ``diag/`` scalars of the runs.

  Args:
    run_dirs: one run directory (holding ``metrics.jsonl``) or several that
      continue each other; a later run's steps are offset by the largest step
      logged by the runs before it. A directory without ``metrics.jsonl`` is
      an error (a ``ValueError`` naming it).

  Returns:
    Per teacher and metric, float64 arrays of the steps and values, in step
    order; non-finite values (an empty position bucket is ``nan``) are dropped.
  """
  dirs = [run_dirs] if isinstance(run_dirs, (str, pathlib.Path)) else list(run_dirs)
  if not dirs:
    raise ValueError("run_dirs=[]: name at least one run directory")
  points: dict[str, dict[str, list[tuple[float, float]]]] = {}
  offset = 0
  for d in dirs:
    path = pathlib.Path(d) / "metrics.jsonl"
    if not path.is_file():
      raise ValueError(f"run_dirs has {str(d)!r}, which holds no metrics.jsonl")
    rows = read_metrics(path)
    for row in rows:
      for key, value in row.items():
        if not key.startswith(PREFIX) or key.count("/") != 2:
          continue
        _, teacher, metric = key.split("/")
        if isinstance(value, (int, float)) and math.isfinite(value):
          points.setdefault(teacher, {}).setdefault(metric, []).append(
              (row["step"] + offset, float(value)))
    offset += max((r["step"] for r in rows), default=0)
  out: Series = {}
  for teacher, metrics in points.items():
    out[teacher] = {}
    for metric, pts in metrics.items():
      pts.sort()
      out[teacher][metric] = (np.array([s for s, _ in pts], np.float64),
                              np.array([v for _, v in pts], np.float64))
  return out


def endpoints(series: Series, tail: int = 1) -> dict[str, dict[str, dict[str, float]]]:
  """``{teacher: {metric: {"first", "last", "n"}}}``: the first point, the mean of
  the last ``tail`` points (fewer if the series is shorter) and the point count."""
  if not isinstance(tail, int) or tail < 1:
    raise ValueError(f"tail={tail!r} must be a positive int")
  return {t: {m: {"first": float(v[0]), "last": float(v[-tail:].mean()), "n": int(v.size)}
              for m, (_, v) in metrics.items() if v.size}
          for t, metrics in series.items()}


def diagnostics_figure(series: Series, title: str = "", panels=PANELS):
  """A row of panels, one per ``(metric, label)`` of ``panels``, a line per teacher."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
  for ax, (metric, label) in zip(axes[0], panels):
    for teacher in sorted(series):
      if metric in series[teacher]:
        steps, values = series[teacher][metric]
        ax.plot(steps, values, label=teacher, marker="o" if steps.size < 20 else None,
                markersize=3)
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylim(0, 1)
  handles, labels = axes[0][0].get_legend_handles_labels()
  if handles:
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8,
               frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0.08 if handles else 0, 1, 1))
  return fig


def plot_diagnostics(run_dirs, path: str | pathlib.Path, title: str = "") -> str | None:
  """Writes ``diagnostics_figure`` of the runs to ``path`` (PNG); ``None`` when the
  runs logged no diagnostics (``opd.diag_every = 0``)."""
  series = read_diagnostics(run_dirs)
  if not series:
    return None
  return save_figure(series, path, title)


def save_figure(series: Series, path: str | pathlib.Path, title: str = "") -> str:
  import matplotlib.pyplot as plt
  fig = diagnostics_figure(series, title)
  fig.savefig(str(path), dpi=100)
  plt.close(fig)
  return str(path)


def relabel(series_by_run: Mapping[str, Series]) -> Series:
  """Several runs' series in one: teacher ``t`` of run ``r`` becomes ``"r: t"``
  (``"r"`` alone when the run has one teacher)."""
  out: Series = {}
  for run, series in series_by_run.items():
    for teacher, metrics in series.items():
      out[run if len(series) == 1 else f"{run}: {teacher}"] = metrics
  return out
