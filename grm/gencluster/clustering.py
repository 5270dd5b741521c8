"""Behavioural clustering of candidates (docs/DESIGN.md §7, GENCLUSTER).

Candidates that return the same outputs on every test input are, as far as
the tests can tell, the same program: they form a cluster, keyed by the
sha256 of their outputs. A cluster is dropped when a member's run failed as
a whole (a limit, a signal, a guard denial: the sandbox's failure reasons)
or when any output is an error or empty (``execution.EMPTY``); since members
share their outputs, that is a property of the cluster. Inside a cluster
the members are ordered by reasoning length, longest first (ties: lower
candidate index first).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from grm.gencluster.execution import EMPTY, Outputs


@dataclasses.dataclass(frozen=True)
class Cluster:
  """``members``: candidate indices, longest reasoning first; ``key``: the outputs' hash."""
  key: str
  members: tuple[int, ...]

  @property
  def size(self) -> int:
    return len(self.members)


def output_hash(outputs: Outputs) -> str:
  """sha256 of the per-input outputs (or of the failure reason)."""
  text = repr(outputs.values) if outputs.ok else f"failed:{outputs.failure}"
  return hashlib.sha256(text.encode()).hexdigest()


def is_bad(outputs: Outputs) -> bool:
  """A failed run, or an error or empty output on some input."""
  return not outputs.ok or any(v == EMPTY or v.startswith("error:") for v in outputs.values)


def cluster(outputs: Sequence[Outputs | None], reasoning_lengths: Sequence[int]
            ) -> tuple[list[Cluster], dict[str, int]]:
  """Clusters candidates by output hash and drops the bad clusters.

  Args:
    outputs: per candidate, its outputs, or None for a candidate that did not
      parse or compile (never run, in no cluster).
    reasoning_lengths: per candidate, the length of its reasoning.

  Returns:
    ``(clusters, counts)``: the kept clusters, largest first (size ties: the
    one holding the lowest candidate index, i.e. the one whose first
    candidate comes first in ``outputs``; the reasoning lengths order the
    members inside a cluster only), and counts
    ``clusters_all``, ``clusters_dropped``, ``candidates_dropped`` (in dropped
    clusters), ``candidates_failed_run``.
  """
  if len(outputs) != len(reasoning_lengths):
    raise ValueError(f"{len(outputs)} outputs but {len(reasoning_lengths)} reasoning lengths")
  groups: dict[str, list[int]] = {}
  bad: dict[str, bool] = {}
  failed = 0
  for i, out in enumerate(outputs):
    if out is None:
      continue
    failed += not out.ok
    key = output_hash(out)
    groups.setdefault(key, []).append(i)
    bad[key] = bad.get(key, False) or is_bad(out)
  kept = [Cluster(k, tuple(sorted(m, key=lambda i: (-reasoning_lengths[i], i))))
          for k, m in groups.items() if not bad[k]]
  kept.sort(key=lambda c: (-c.size, min(c.members)))
  dropped = [k for k in groups if bad[k]]
  return kept, {"clusters_all": len(groups), "clusters_dropped": len(dropped),
                "candidates_dropped": sum(len(groups[k]) for k in dropped),
                "candidates_failed_run": failed}
