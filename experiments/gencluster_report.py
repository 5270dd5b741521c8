"""The ``gencluster`` job's report: the compared strategies, the solve-rate table and plot
(docs/DESIGN.md §7; the job is ``experiments/gencluster.py``)."""
from __future__ import annotations

import numpy as np

from grm.gencluster.problems import LEVEL_NAMES

STRATEGIES = ("gencluster", "no_validators", "majority", "random")
LABELS = {"gencluster": "GENCLUSTER (tournament, validated inputs)",
          "no_validators": "tournament without validators",
          "majority": "majority cluster only", "random": "random candidates"}


def mean_se(x) -> tuple[float, float]:
  x = np.asarray(x, float)
  return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def render_report(results: dict, budgets) -> str:
  """Markdown: solve rate (share of subtasks solved, mean ± SE over problems) per budget."""
  st = results["stages"]
  inp, ex, rk, sm = st["inputs"], st["execute"], st["rank"], st["samples"]
  lines = ["# GENCLUSTER (docs/DESIGN.md §7)", "",
           f"{results['problems']} code problems x 3 subtasks ({', '.join(LEVEL_NAMES)}); "
           "solve rate = share of subtasks solved after b submissions, mean ± SE over problems.",
           "", "| strategy | " + " | ".join(f"b={b}" for b in budgets) + " | all 3 solved |",
           "|---" * (len(budgets) + 2) + "|"]
  for name in STRATEGIES:
    row = results["solve_rate"][name]
    cells = [f"{100 * row[str(b)][0]:.1f} ± {100 * row[str(b)][1]:.1f}" for b in budgets]
    lines.append(f"| {LABELS[name]} | " + " | ".join(cells)
                 + f" | {100 * results['all_subtasks_solved_at_budget'][name]:.1f} |")
  lines += ["", f"Upper bound (some candidate passes the subtask): "
            f"{100 * results['upper_bound']:.1f}%.", "",
            f"Policy: {st['policy']['policy']}; model-driven: candidates"
            + (f" (+{sm['planted_candidates']} planted reference/distractor candidates, not "
               "model-driven)" if sm["planted_candidates"] else "")
            + f", generators {inp['generators_model']}/{inp['generators_model'] + inp['generators_fallback']}"
            f" (rest: seeded fallback), validators {inp['validators_model']}/"
            f"{inp['validators_model'] + inp['validators_fallback']} (rest: rule-based), "
            f"tournament judge (valid judgements {rk['valid_judgements']}/{rk['matches']}; "
            f"right on {rk.get('judge_accuracy', float('nan')):.2f} of the "
            f"{rk.get('informative_matches', 0)} matches where exactly one side passes).", "",
            f"Candidates {ex['candidates']}: parsed {ex['parsed']}, dropped (parse) "
            f"{ex['dropped_parse']}, dropped (compile) {ex['dropped_compile']}. Clusters kept "
            f"{ex['validated/clusters_kept']} of {ex['validated/clusters_all']} (validated inputs).",
            f"75% filter: removed {inp['removed']} of {inp['inputs']} generated inputs "
            f"({100 * inp['removal_rate']:.1f}%), in {inp['subtasks_filtered']} subtasks.",
            f"Sandbox: {ex['programs']} programs in {ex['sandbox_wall_s']:.1f} s wall = "
            f"{ex['programs_per_s']:.1f} programs/s (execute stage)."]
  return "\n".join(lines) + "\n"


def plot(curves, upper, path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in STRATEGIES:
    y = 100 * np.mean(curves[name], 0)
    ax.plot(np.arange(1, len(y) + 1), y, label=LABELS[name])
  ax.axhline(100 * upper, color="gray", ls=":", label="upper bound (any candidate)")
  ax.set_xscale("log")
  ax.set_xlabel("submission budget per problem")
  ax.set_ylabel("subtasks solved (%)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)

