"""Evaluation reports: markdown tables, JSON save/load and heatmaps.

``results_table`` renders models × domains as markdown (``mean ± se``),
``save_results``/``load_results`` round-trip JSON, and ``heatmap`` draws a
PNG of one metric. Scores are on the 0-100 scale of ``opd.eval.results``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Sequence

import numpy as np

from opd.eval.results import EvalResult
from opd.eval.stats import Estimate


def _grid(results: Sequence[EvalResult], metric: str) -> tuple[list[str], list[list[Estimate | None]]]:
  """Domains (union, first-seen order) and ``[model][domain]`` scores (None if absent)."""
  if not results:
    raise ValueError("results must not be empty")
  domains = list(dict.fromkeys(d for r in results for d in r.domains))
  for r in results:
    have = {m for dr in r.domains.values() for m in dr.metrics}
    if metric not in have:
      raise ValueError(f"metric={metric!r} is not in result {r.name!r}; it has {sorted(have)}")
  return domains, [[r.domains[d].metrics.get(metric) if d in r.domains else None
                    for d in domains] for r in results]


def results_table(results: Sequence[EvalResult], metric: str = "pass@1") -> str:
  """Markdown table, models × domains, cells ``mean ± se`` (0-100).

  The last column averages the domains; its SE treats the domains as
  independent, ``sqrt(sum se^2) / #domains``. Missing cells show ``–``.
  """
  domains, grid = _grid(results, metric)
  lines = [f"| {metric} | " + " | ".join(domains) + " | avg |",
           "|---|" + "---:|" * (len(domains) + 1)]
  for r, row in zip(results, grid):
    cells = [str(s) if s is not None else "–" for s in row]
    if all(s is not None for s in row):
      avg = Estimate(float(np.mean([s.value for s in row])),
                  float(math.sqrt(sum(s.se ** 2 for s in row)) / len(row)))
      cells.append(str(avg))
    else:
      cells.append("–")
    lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def save_results(results: Sequence[EvalResult], out_dir: str) -> dict[str, str]:
  """Writes ``results.json`` (everything, ``load_results`` reads it back)
  and ``results.md`` (one table per metric, then the transcripts).

  Returns:
    ``{"json": path, "markdown": path}``.
  """
  if not results:
    raise ValueError("results must not be empty")
  os.makedirs(out_dir, exist_ok=True)
  paths = {"json": os.path.join(out_dir, "results.json"),
           "markdown": os.path.join(out_dir, "results.md")}
  with open(paths["json"], "w") as f:
    json.dump({"scale": "0-100", "results": [r.to_dict() for r in results]}, f)
  metrics = list(dict.fromkeys(m for r in results for m in r.config.metrics))
  parts = ["# Evaluation\n", "Scores in %, mean ± bootstrap standard error over examples.\n"]
  for m in metrics:
    if all(m in r.config.metrics for r in results):
      parts += [f"## {m}\n", results_table(results, m)]
  parts.append("## Transcripts\n")
  for r in results:
    for d, dr in r.domains.items():
      for t in dr.transcripts:
        parts.append(f"- **{r.name} / {d}** reward {t['reward']:.2f} ({t['reason']}): "
                     f"{json.dumps(t['prompt'])} → {json.dumps(t['response'])}")
  with open(paths["markdown"], "w") as f:
    f.write("\n".join(parts) + "\n")
  return paths


def load_results(path: str) -> list[EvalResult]:
  """Reads a ``results.json`` written by ``save_results``."""
  with open(path) as f:
    data = json.load(f)
  return [EvalResult.from_dict(r) for r in data["results"]]


def heatmap_figure(results: Sequence[EvalResult], metric: str = "pass@1"):
  """A matplotlib Figure: models × domains, colour = score (0-100), cells
  annotated ``value\\n±se``; missing cells are blank and marked ``–``."""
  domains, grid = _grid(results, metric)
  return grid_heatmap_figure([r.name for r in results], domains, grid, f"{metric} (%)")


def grid_heatmap_figure(rows: Sequence[str], columns: Sequence[str],
                        grid: Sequence[Sequence[Estimate | None]], title: str):
  """``heatmap_figure`` for any grid of ``Estimate``s (rows × columns, 0-100)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  columns, rows = list(columns), list(rows)
  values = np.array([[s.value if s is not None else np.nan for s in row] for row in grid])
  fig = Figure(figsize=(1.3 * len(columns) + 2.5, 0.55 * len(rows) + 1.6))
  FigureCanvasAgg(fig)  # no pyplot: nothing global changes, no display needed
  ax = fig.add_subplot()
  im = ax.imshow(values, vmin=0, vmax=100, cmap="viridis", aspect="auto")
  ax.set_xticks(range(len(columns)), columns)
  ax.set_yticks(range(len(rows)), rows)
  for i, row in enumerate(grid):
    for j, s in enumerate(row):
      text = "–" if s is None else f"{s.value:.1f}\n±{s.se:.1f}"
      dark = s is not None and s.value < 60
      ax.text(j, i, text, ha="center", va="center", fontsize=8,
              color="white" if dark else "black")
  ax.set_title(title)
  fig.colorbar(im, ax=ax)
  fig.tight_layout()
  return fig


def heatmap(results: Sequence[EvalResult], path: str, metric: str = "pass@1") -> str:
  """Saves ``heatmap_figure(results, metric)`` as a PNG at ``path``; returns ``path``."""
  fig = heatmap_figure(results, metric)
  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=100)
  return path
