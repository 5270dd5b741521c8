"""The RewardBench-style test set and its accuracy (docs/DESIGN.md §6).

Built from ``grm.data`` preference groups of the **test** split only (the
GRM trains on train-split groups; ``grm.data.split_groups`` checks that no
query is in both). Each group goes to exactly one subset, like RewardBench's
sections:

  chat               writing groups, and instruct groups without a
                     forbidding rule
  constraint_safety  instruct groups whose rules forbid content (an
                     ``exclude`` constraint, "Avoid 'word'."): the judge must
                     notice a forbidden word in an otherwise fine response
  reasoning          math groups
  code               code groups
  tool_use           agent groups (multi-turn episodes)

**Sizes.** One group per test example that survives ``grm.data.build_groups``
(a unique best for n >= 2). At the job's default config
(``experiments/configs/grm.py``: 48 test examples per domain, five domains,
group sizes 1..4) a subset holds at most 48 groups (constraint_safety and
the instruct part of chat share instruct's 48; ``exclude`` is one of six
constraint kinds drawn per example, difficulty d drawing d of them, so
about d/6 of instruct examples forbid a word); ``subset_sizes`` gives the
measured sizes and the job writes them to its report.

**Accuracy.** A group is judged correct when the method's decision matches
the truth: for n >= 2 the picked response is the unique best (a tie or no
pick is wrong); for n == 1 the predicted integer rating equals the rating.
Per subset and overall (pooled over all groups) the accuracy is a mean over
groups with a bootstrap standard error (``opd.eval.stats``), on 0-100.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from grm.correctness import check_ratings
from grm.data import PreferenceGroup
from opd import tasks as tasks_lib
from opd.eval.stats import Estimate, estimate
from opd.tasks import Example

SUBSETS = ("chat", "reasoning", "code", "tool_use", "constraint_safety")
OVERALL = "overall"
_DOMAIN_SUBSET = {"writing": "chat", "instruct": "chat", "math": "reasoning", "code": "code"}


def forbids_content(example: Example) -> bool:
  """An instruct example whose rules forbid a word (an ``exclude`` constraint)."""
  return example.domain == "instruct" and any(
      c.get("kind") == "exclude" for c in example.meta.get("constraints", ()))


def subset_of(group: PreferenceGroup, example: Example) -> str:
  """The subset (``SUBSETS``) of one group, given its task example."""
  if group.example_id != example.id:
    raise ValueError(f"group.example_id={group.example_id!r} != example.id={example.id!r}")
  if tasks_lib.is_multi_turn(group.domain):
    return "tool_use"
  if forbids_content(example):
    return "constraint_safety"
  if group.domain not in _DOMAIN_SUBSET:
    raise ValueError(f"group.domain={group.domain!r} has no benchmark subset")
  return _DOMAIN_SUBSET[group.domain]


def benchmark_set(groups: Sequence[PreferenceGroup], examples: Sequence[Example]
                  ) -> dict[str, list[PreferenceGroup]]:
  """Test-split groups by subset (every key of ``SUBSETS`` present, maybe empty).

  Args:
    groups: preference groups (``grm.data.build_groups``); groups of other
      splits are left out.
    examples: task examples covering the test groups' ``example_id``s.

  Raises:
    ValueError: a test group whose example is missing.
  """
  by_id = {ex.id: ex for ex in examples}
  out: dict[str, list[PreferenceGroup]] = {s: [] for s in SUBSETS}
  for g in groups:
    if g.split != "test":
      continue
    if g.example_id not in by_id:
      raise ValueError(f"group of example_id={g.example_id!r} ({g.domain}) has no example")
    out[subset_of(g, by_id[g.example_id])].append(g)
  return out


def subset_sizes(subsets: Mapping[str, Sequence[PreferenceGroup]]) -> dict[str, dict[str, int]]:
  """``{subset: {"groups": G, "n1": ..., "n2": ..., ...}}`` plus ``overall``."""
  out = {}
  for name, gs in list(subsets.items()) + [(OVERALL, [g for v in subsets.values() for g in v])]:
    row = {"groups": len(gs)}
    for g in gs:
      row[f"n{g.n}"] = row.get(f"n{g.n}", 0) + 1
    out[name] = row
  return out


def decision_correct(ratings: Sequence[float], *, pick: int | None = None,
                     rating: int | None = None) -> bool:
  """Whether one decision matches the truth (module docstring).

  Args:
    ratings: the group's ground truth (``grm.correctness.check_ratings``).
    pick: the picked response (n >= 2); None or -1 means no pick (a tie).
    rating: the predicted integer rating (n == 1); None means none.
  """
  r = check_ratings(ratings)
  if r.size == 1:
    return rating is not None and int(rating) == int(r[0])
  return pick is not None and pick >= 0 and int(pick) == int(np.argmax(r))


def accuracy(correct: Mapping[str, Sequence[bool]], *, num_resamples: int = 1000,
             seed: int = 0) -> dict[str, Estimate]:
  """Accuracy per subset and overall, with bootstrap SEs (0-100 scale).

  Args:
    correct: ``{subset: [G] bools}``, one per group of the subset; empty
      subsets are left out of the result.
    num_resamples, seed: of ``opd.eval.stats.estimate``; each subset
      resamples with its own seed ``(seed, index)``.

  Returns:
    ``{subset: Estimate}`` and ``"overall"`` over all groups pooled.
  """
  out = {}
  pooled = []
  for i, (name, values) in enumerate(correct.items()):
    v = np.asarray(values, np.float64)
    if v.ndim != 1:
      raise ValueError(f"correct[{name!r}] must be a 1-D sequence of bools, got {v.shape=}")
    if v.size:
      out[name] = estimate(v, num_resamples, (int(seed), i))
      pooled.append(v)
  if not pooled:
    raise ValueError("correct holds no groups")
  out[OVERALL] = estimate(np.concatenate(pooled), num_resamples, (int(seed), len(correct)))
  return out
