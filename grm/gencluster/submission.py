"""Round-robin submission under a budget (docs/DESIGN.md §7, GENCLUSTER).

Per problem, subtasks are attacked hardest first. For the current subtask
(the hardest one not yet solved that still has unsubmitted candidates) the
next submission comes from its ranked clusters in round-robin: the first
member of cluster 1, of cluster 2, ..., then the second member of each
cluster that has one, and so on (members are in reasoning-length order). A
submission is judged on every subtask's hidden tests, as a contest judge
does; every subtask it passes is solved and left alone from then on. At most
``budget`` submissions per problem.

The baselines reuse this loop with other rankings: one cluster per candidate
in a seeded random order ("random candidate"), or only the largest cluster
("majority cluster").
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Submission:
  """One submission: the candidate, the subtask it was aimed at, and all subtasks solved after it."""
  candidate: int
  target: int
  solved: frozenset[int]


def round_robin(clusters: Sequence[Sequence[int]]) -> list[int]:
  """Candidates of ranked clusters in round-robin order (module docstring)."""
  out = []
  depth = max((len(c) for c in clusters), default=0)
  for r in range(depth):
    out += [c[r] for c in clusters if r < len(c)]
  return out


def submit(ranked: Sequence[Sequence[Sequence[int]]], passes: Mapping[int, frozenset[int]], *,
           budget: int) -> list[Submission]:
  """Submissions for one problem.

  Args:
    ranked: per subtask (index 0 easiest), its clusters best first, each a
      sequence of candidate ids in submission order.
    passes: candidate id -> the subtasks whose hidden tests it passes.
    budget: the most submissions (>= 1).

  Returns:
    The submissions in order (fewer than ``budget`` when every subtask is
    solved or no candidate is left).
  """
  if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
    raise ValueError(f"budget={budget!r} must be an int >= 1")
  queues = [round_robin(c) for c in ranked]
  pos = [0] * len(queues)
  solved: set[int] = set()
  used: set[int] = set()
  out: list[Submission] = []
  while len(out) < budget:
    target = next((s for s in reversed(range(len(queues)))
                   if s not in solved and pos[s] < len(queues[s])), None)
    if target is None:
      break
    cand = queues[target][pos[target]]
    pos[target] += 1
    if cand in used:
      continue
    used.add(cand)
    solved |= set(passes.get(cand, frozenset()))
    out.append(Submission(cand, target, frozenset(solved)))
  return out


def score_curve(subs: Sequence[Submission], n_subtasks: int, budget: int) -> np.ndarray:
  """``[budget]`` fraction of subtasks solved after b = 1..budget submissions."""
  curve = np.zeros(budget)
  solved = 0
  for b in range(budget):
    if b < len(subs):
      solved = len(subs[b].solved)
    curve[b] = solved / n_subtasks
  return curve


def random_ranking(candidates: Sequence[int], seed) -> list[list[int]]:
  """One single-candidate "cluster" per candidate, in a seeded random order."""
  order = np.random.default_rng(seed).permutation(len(candidates))
  return [[candidates[i]] for i in order]
