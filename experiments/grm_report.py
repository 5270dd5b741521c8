"""The ``grm`` job's report: the benchmark table and the k-curve (docs/DESIGN.md §6;
the job is ``experiments/grm.py``)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from grm import benchmark_set as bench_lib
from grm.yardstick import MULTI as MULTI_YS
from grm.yardstick import SINGLE as SINGLE_YS

PAPER = {1: 85.6, 32: 89.6}  # DeepSeek-GRM-27B on RewardBench, meta-RM voting (docs/DESIGN.md §6)


def render_report(table: Mapping, invalid: Mapping, sizes: Mapping,
                  extra: Sequence[str] = ()) -> str:
  """Markdown: accuracy (± bootstrap SE) per subset and overall, sizes, invalid
  rates, then ``extra`` lines (e.g. RFT counts)."""
  cols = [s for s in bench_lib.SUBSETS if sizes.get(s, {}).get("groups")] + [bench_lib.OVERALL]
  cols += sorted({k for row in table.values() for k in row} - set(cols))  # e.g. "overall n>=2"
  lines = ["# GRM benchmark (RewardBench-style test set, docs/DESIGN.md §6)", "",
           "Accuracy in % ± bootstrap SE. BT RM and pairwise judge: n >= 2 groups only; "
           "the 'overall n>=2' column holds every method on those groups. "
           f"Paper (DeepSeek-GRM-27B, RewardBench): {PAPER[1]} at k=1, {PAPER[32]} with "
           "meta-RM voting at k=32.", "",
           "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for name, row in table.items():
    cells = [f"{row[s]['value']:.1f} ± {row[s]['se']:.1f}" if s in row else "–" for s in cols]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines += ["", "Groups per subset: " + ", ".join(
      f"{s} {v['groups']}" for s, v in sizes.items()), "", "| model | invalid rate |",
            "|---|---|"]
  lines += [f"| {name} | {v['invalid_rate']:.3f} |" for name, v in invalid.items()]
  if extra:
    lines += [""] + list(extra)
  return "\n".join(lines) + "\n"


def _est(e) -> str:
  return f"{e['value']:.1f} ± {e['se']:.1f}" if e else "–"


def render_yardstick(yard: Mapping, position: Mapping | None = None) -> list[str]:
  """Markdown lines: the yardstick table (``experiments.grm_benchmark.yardstick_table``)
  with chance, the most-common-rating baseline and the content-blind control beside
  every GRM row, and the pairwise judge's "A" rate before and after swap-averaging.

  A row "reads the responses" when its n >= 2 strict accuracy is above its
  control's by more than 2 SE (the two SEs in quadrature); otherwise the
  report says it does not.
  """
  chance = yard.get("chance", {}).get(MULTI_YS, {})
  common = yard.get("most_common_rating", {})
  lines = ["", "## Yardstick (docs/DESIGN.md §6)", "",
           "Accuracy in % ± bootstrap SE; n >= 2 is the headline. strict: the unique best "
           "(ties, invalid: wrong); credit: 1/|tied top| for a tie holding the best, 1/n when "
           "no sample is valid. control: the same GRM on the same groups with every response "
           "taken from another group. valid / tie: rates over the row's samples / groups.",
           ""]
  if chance:
    lines.append(f"Chance (n >= 2, mean 1/n over {chance['groups']} groups): {_est(chance)}.")
  if common:
    lines.append(f"Most common rating (n = 1, rating {common['rating']} from the train "
                 f"split): {_est(common[SINGLE_YS])}; chance 10.0.")
  lines += ["", "| method | n>=2 strict | n>=2 credit | chance | control | reads responses | "
            "valid | tie | n=1 strict | most common rating |", "|---" * 10 + "|"]
  for name, row in yard.items():
    if name in ("chance", "most_common_rating"):
      continue
    multi, single = row.get(MULTI_YS, {}), row.get(SINGLE_YS, {})
    ctrl = row.get("control", {}).get(MULTI_YS, {})
    reads = "–"
    if multi and ctrl:
      a, b = multi["strict"], ctrl["strict"]
      gap = a["value"] - b["value"]
      reads = "yes" if gap > 2 * float(np.hypot(a["se"], b["se"])) else "NO (not above control)"
    elif "control_error" in row:
      reads = "no control: " + row["control_error"][:60]
    lines.append(" | ".join([
        f"| {name}", _est(multi.get("strict")), _est(multi.get("credit")), _est(chance),
        _est(ctrl.get("strict")), reads,
        f"{multi['valid_rate']:.2f}" if multi else "–", f"{multi['tie_rate']:.2f}" if multi
        else "–", _est(single.get("strict")), _est(common.get(SINGLE_YS))]) + " |")
  if position:
    lines += ["", f"Pairwise judge \"A\" rate: {position['a_rate_before']:.3f} of single "
              f"judgements; after swap-averaging the first-shown A gets "
              f"{position['a_rate_after']:.3f} of the credit (0.5 = no position effect); the "
              f"two orders split {position['split_rate']:.3f} of the pairs."]
  return lines


def plot_k_curve(table: Mapping, stages: Sequence[str], path) -> None:
  """Overall accuracy against k for ``{stage}/vote@k`` and ``{stage}/meta@k``
  (whichever k each stage has), bands of ± one bootstrap SE, the paper's points."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for stage in stages:
    for kind, style in (("vote", "-"), ("meta", "--")):
      prefix = f"{stage}/{kind}@"
      rows = sorted((int(name[len(prefix):]), row[bench_lib.OVERALL])
                    for name, row in table.items()
                    if name.startswith(prefix) and bench_lib.OVERALL in row)
      if not rows:
        continue
      ks = np.array([k for k, _ in rows])
      v = np.array([r["value"] for _, r in rows])
      se = np.array([r["se"] for _, r in rows])
      line, = ax.plot(ks, v, style, marker="o", label=f"{stage} {kind}")
      ax.fill_between(ks, v - se, v + se, alpha=0.15, color=line.get_color())
  ax.plot(sorted(PAPER), [PAPER[k] for k in sorted(PAPER)], "k:", marker="s",
          label="paper (RewardBench, meta@k)")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("k (samples)")
  ax.set_ylabel("accuracy (%)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
