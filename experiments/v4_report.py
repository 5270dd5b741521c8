"""Tables of the ``v4`` job (experiments/v4.py): every model × domain, retention, OPD vs baselines.

Rows: the base, each specialist, the student after each stage (cold start,
OPD, OPD + annealing) and each baseline. Columns: the domains and their
average. A cell is ``(value, spread)`` on the 0-100 scale:

* one evaluation: the bootstrap standard error over test examples; the
  average's is ``sqrt(Σ_d se_d²) / n`` (domains are scored on disjoint
  examples, so their errors are independent);
* a student stage run with several seeds (rows named ``<row>#<seed>`` in the
  results): the mean over seeds and the standard deviation across seeds
  (``ddof=1``), a spread that includes the training noise.

Retention (the V4 claim, docs/DESIGN.md §3): the final student's score ÷
the specialist's, per domain, in %. ``opd_minus``: the final student's
average minus each other row's, with the two spreads added in quadrature.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from opd.eval.report import grid_heatmap_figure
from opd.eval.results import EvalResult
from opd.eval.stats import Estimate

STUDENT_ROWS = {"cold_start": "student: cold start", "opd": "student: OPD",
                "anneal": "student: OPD + annealing"}
BASELINE_ROWS = {"merge": "baseline: weight average", "task_arithmetic":
                 "baseline: task arithmetic", "mixed_rl": "baseline: mixed RL",
                 "sequential_rl": "baseline: sequential RL",
                 "offpolicy_kd": "baseline: off-policy KD"}
FINAL = STUDENT_ROWS["anneal"]
AVG = "average"


def _cells(results: Sequence[EvalResult], domains, metric: str) -> dict[str, dict]:
  """``{row: {domain | average: (value, spread)}}``; seeds folded into one row."""
  by_row: dict[str, list[EvalResult]] = {}
  for r in results:
    by_row.setdefault(r.name.split("#")[0], []).append(r)
  table = {}
  for row, runs in by_row.items():
    scores = np.array([[r.score(d, metric).value for d in domains] for r in runs])
    if len(runs) == 1:
      se = [runs[0].score(d, metric).se for d in domains]
      cells = {d: (float(scores[0, i]), float(se[i])) for i, d in enumerate(domains)}
      cells[AVG] = (float(scores[0].mean()), math.sqrt(sum(s * s for s in se)) / len(domains))
    else:
      cells = {d: (float(scores[:, i].mean()), float(scores[:, i].std(ddof=1)))
               for i, d in enumerate(domains)}
      avg = scores.mean(axis=1)
      cells[AVG] = (float(avg.mean()), float(avg.std(ddof=1)))
    table[row] = cells
  return table


def _order(rows) -> list[str]:
  first = ["base"] + sorted(r for r in rows if r.endswith("-specialist"))
  known = first + list(STUDENT_ROWS.values()) + list(BASELINE_ROWS.values())
  return [r for r in known if r in rows] + sorted(r for r in rows if r not in known)


def summarize(results: Sequence[EvalResult], domains: Sequence[str], metric: str,
              sampled: str) -> dict:
  """The JSON-ready summary: tables for ``metric`` and ``sampled``, the seed
  count per row, retention and the final student's margins."""
  domains = tuple(domains)
  tables = {}
  for m in (metric, sampled):
    cells = _cells(results, domains, m)
    tables[m] = {row: cells[row] for row in _order(cells)}
  seeds = {}
  for r in results:
    row = r.name.split("#")[0]
    seeds[row] = seeds.get(row, 0) + 1
  main = tables[metric]
  out = {"metric": metric, "sampled": sampled, "domains": list(domains), "table": tables,
         "seeds": seeds, "retention": {}, "retention_opd": {}, "opd_minus": {}}
  for key, row in (("retention", FINAL), ("retention_opd", STUDENT_ROWS["opd"])):
    if row in main:
      for d in domains:
        spec = main.get(f"{d}-specialist", {}).get(d, (float("nan"),))[0]
        out[key][d] = 100.0 * main[row][d][0] / spec if spec > 0 else float("nan")
  if FINAL in main:
    v, s = main[FINAL][AVG]
    for row, cells in main.items():
      if row != FINAL:
        out["opd_minus"][row] = (v - cells[AVG][0], math.hypot(s, cells[AVG][1]))
  return out


def _fmt(cell) -> str:
  return f"{cell[0]:.1f} ± {cell[1]:.1f}"


def _table(table: Mapping[str, Mapping[str, tuple]], domains, seeds) -> list[str]:
  lines = ["| model | " + " | ".join(domains) + f" | {AVG} |",
           "|---|" + "---|" * (len(domains) + 1)]
  for row, cells in table.items():
    tag = f" ({seeds[row]} seeds)" if seeds.get(row, 1) > 1 else ""
    lines.append(f"| {row}{tag} | " + " | ".join(_fmt(cells[d]) for d in domains)
                 + f" | {_fmt(cells[AVG])} |")
  return lines


def render(summary: Mapping, timer_s: float | None = None) -> str:
  """The markdown report."""
  domains, metric, sampled = summary["domains"], summary["metric"], summary["sampled"]
  lines = [f"## V4 pipeline — greedy {metric} (0–100) on each test set", ""]
  lines += _table(summary["table"][metric], domains, summary["seeds"])
  if summary["retention"]:
    lines.append("| retention: OPD + annealing ÷ specialist | " + " | ".join(
        f"{summary['retention'][d]:.0f}%" for d in domains) + " | |")
    lines.append("| retention: OPD (before annealing) ÷ specialist | " + " | ".join(
        f"{summary['retention_opd'][d]:.0f}%" for d in domains) + " | |")
  lines += ["", f"## The same models, sampled {sampled}", ""]
  lines += _table(summary["table"][sampled], domains, summary["seeds"])
  if summary["opd_minus"]:
    lines += ["", f"## OPD + annealing minus each row (average greedy {metric})", "",
              "| row | difference |", "|---|---|"]
    lines += [f"| {row} | {d:+.1f} ± {s:.1f} |" for row, (d, s) in summary["opd_minus"].items()]
  lines += ["", "± is one bootstrap standard error over test examples, or the standard "
            "deviation across seeds for rows run with several seeds; differences add the two "
            "in quadrature."]
  if timer_s is not None:
    lines.append(f"Wall time of this invocation: {timer_s / 60:.1f} min.")
  return "\n".join(lines) + "\n"


def heatmap(summary: Mapping, path, metric: str) -> str:
  """Rows × (domains + average) of ``metric``, as a PNG at ``path``."""
  table = summary["table"][metric]
  columns = list(summary["domains"]) + [AVG]
  grid = [[Estimate(*cells[c]) for c in columns] for cells in table.values()]
  fig = grid_heatmap_figure(list(table), columns, grid, f"V4 pipeline: greedy {metric} (%)")
  fig.savefig(str(path), dpi=100)
  return str(path)
