"""Paired differences between evaluated models, across workdirs (docs/RESULTS.md).

  python -m experiments.paired_diff "workdirs/v4_strong:student: OPD#0" \
      "workdirs/v4_strong:student: cold start#0" [A2 B2 ...]
  python -m experiments.paired_diff --mean A1 B1 A2 B2 A3 B3   # + the pairs pooled

Each argument is ``WORKDIR:ROW``: a row of ``WORKDIR/v4/results.json`` (or of
``WORKDIR/results.json``). For each pair ``A − B`` (both evaluated on the same
test examples) it prints, per domain, the mean per-example difference of
greedy ``reward@1`` and of ``mean@N`` with the bootstrap SE of the
differences (``experiments.compat.paired_diff``), and the average over
domains with the quadrature mean of the domains' SEs and its 95% half-width.
``--mean`` adds one line for the pairs pooled (e.g. three seeds, each seed's
OPD against its own baseline): per example the mean over the pairs of
``A − B``, with the bootstrap SE over the examples (the seeds' spread on an
example stays inside that example's difference), and the standard deviation
of the pairs' averages across the pairs.
"""
from __future__ import annotations

import functools
import math
import pathlib
import sys
from typing import Sequence

import numpy as np

from experiments.compat import example_rewards, paired_diff
from opd.eval import stats as stats_lib
from opd.eval.report import load_results

RESAMPLES = 1000


@functools.lru_cache(maxsize=None)
def _rows(workdir: str) -> dict:
  path = pathlib.Path(workdir) / "v4" / "results.json"
  if not path.exists():
    path = pathlib.Path(workdir) / "results.json"
  if not path.exists():
    raise ValueError(f"paired_diff: no results.json under {workdir!r} (nor its v4/)")
  return {r.name: r for r in load_results(str(path))}


def row(spec: str):
  """The ``EvalResult`` named by ``WORKDIR:ROW``."""
  workdir, sep, name = spec.partition(":")
  if not sep or not name:
    raise ValueError(f"paired_diff: {spec!r} is not WORKDIR:ROW")
  rows = _rows(workdir)
  if name not in rows:
    raise ValueError(f"paired_diff: no row {name!r} in {workdir!r}; rows: {sorted(rows)}")
  return rows[name]


def compare(a, b, metric: str) -> dict:
  """``{"domains": {d: (diff, se)}, "average": (diff, se)}`` on the 0-100 scale
  over the domains both results hold."""
  domains = [d for d in a.domains if d in b.domains]
  per = {d: paired_diff(a, b, d, metric, RESAMPLES, seed=0) for d in domains}
  avg = sum(v for v, _ in per.values()) / len(per)
  se = math.sqrt(sum(s * s for _, s in per.values())) / len(per)
  return {"domains": per, "average": (avg, se)}


def compare_pooled(pairs: Sequence[tuple], metric: str) -> dict:
  """``compare`` of the pairs ``[(A, B), ...]`` pooled: per domain, on every
  example the mean over the pairs of ``A − B`` (all pairs on the same test
  examples), with the bootstrap SE over the examples; the average over domains
  as in ``compare``. ``"spread"``: the standard deviation (ddof 1) of the
  pairs' own averages (0 for one pair)."""
  if not pairs:
    raise ValueError("paired_diff: compare_pooled needs at least one pair")
  domains = [d for d in pairs[0][0].domains if all(d in x.domains for p in pairs for x in p)]
  per = {}
  for d in domains:
    ids = pairs[0][0].domains[d].example_ids
    for a, b in pairs:
      for r in (a, b):
        if r.domains[d].example_ids != ids:
          raise ValueError(f"paired_diff: {r.name!r} was evaluated on other {d} examples than "
                           f"{pairs[0][0].name!r}")
    # [n, pairs] (greedy) or [n, pairs * N] (sampled): paired_difference's row means
    # are the per-example means over the pairs (and samples).
    x, y = (np.concatenate([np.asarray(example_rewards(p[side], d, metric), np.float64)
                            .reshape(len(ids), -1) for p in pairs], axis=1) for side in (0, 1))
    value, se = stats_lib.paired_difference(x, y, RESAMPLES, 0)
    per[d] = (100.0 * value, 100.0 * se)
  avg = sum(v for v, _ in per.values()) / len(per)
  se = math.sqrt(sum(s * s for _, s in per.values())) / len(per)
  own = [compare(a, b, metric)["average"][0] for a, b in pairs]
  spread = float(np.std(own, ddof=1)) if len(own) > 1 else 0.0
  return {"domains": per, "average": (avg, se), "spread": spread}


def main(argv: Sequence[str]) -> str:
  pooled = bool(argv) and argv[0] == "--mean"
  argv = argv[1:] if pooled else argv
  if len(argv) < 2 or len(argv) % 2:
    raise SystemExit(__doc__)
  lines = []
  for spec_a, spec_b in zip(argv[::2], argv[1::2]):
    a, b = row(spec_a), row(spec_b)
    sampled = f"mean@{a.config.num_samples}"
    g, m = compare(a, b, "reward@1"), compare(a, b, sampled)
    per = " / ".join(f"{d} {v:+.1f}" for d, (v, _) in g["domains"].items())
    lines.append(f"{spec_a} − {spec_b}: greedy {g['average'][0]:+.1f} ± {g['average'][1]:.1f} "
                 f"(95% ±{1.96 * g['average'][1]:.1f}); {sampled} {m['average'][0]:+.1f} ± "
                 f"{m['average'][1]:.1f}; greedy by domain: {per}")
  if pooled:
    pairs = [(row(a), row(b)) for a, b in zip(argv[::2], argv[1::2])]
    sampled = f"mean@{pairs[0][0].config.num_samples}"
    g, m = compare_pooled(pairs, "reward@1"), compare_pooled(pairs, sampled)
    per = " / ".join(f"{d} {v:+.1f}" for d, (v, _) in g["domains"].items())
    lines.append(f"mean of the {len(pairs)} pairs: greedy {g['average'][0]:+.1f} ± "
                 f"{g['average'][1]:.1f} (95% ±{1.96 * g['average'][1]:.1f}; std across pairs "
                 f"{g['spread']:.1f}); {sampled} {m['average'][0]:+.1f} ± {m['average'][1]:.1f}; "
                 f"greedy by domain: {per}")
  return "\n".join(lines)


if __name__ == "__main__":
  print(main(sys.argv[1:]))
