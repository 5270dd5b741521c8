"""Paired differences between evaluated models, across workdirs (docs/RESULTS.md).

  python -m experiments.paired_diff "workdirs/v4_strong:student: OPD#0" \
      "workdirs/v4_strong:student: cold start#0" [A2 B2 ...]

Each argument is ``WORKDIR:ROW``: a row of ``WORKDIR/v4/results.json`` (or of
``WORKDIR/results.json``). For each pair ``A − B`` (both evaluated on the same
test examples) it prints, per domain, the mean per-example difference of
greedy ``reward@1`` and of ``mean@N`` with the bootstrap SE of the
differences (``experiments.compat.paired_diff``), and the average over
domains with the quadrature mean of the domains' SEs and its 95% half-width.
"""
from __future__ import annotations

import functools
import math
import pathlib
import sys
from typing import Sequence

from experiments.compat import paired_diff
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


def main(argv: Sequence[str]) -> str:
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
  return "\n".join(lines)


if __name__ == "__main__":
  print(main(sys.argv[1:]))
