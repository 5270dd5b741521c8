"""The GRM's positive-control preference set: n = 2 groups with a cue the model can see
(docs/DESIGN.md §6 "Yardstick, controls and constrained decoding").

A GRM that fails the real benchmark may fail for format, for content or for
capacity. This set removes the content difficulty: each group is a math
prompt of the toy task suite (``opd.tasks``, difficulty 1) with two
responses, the reference answer and a wrong one, so the better response is
fixed by construction and checked by the task's verifier (ratings are its
rewards, 1 and 0; reasons ``ok`` and ``wrong_answer``). ``cue`` sets what
tells them apart on the page:

  marker  the better response opens with the line ``MARKER`` (``Checked.``)
          before its ``Answer: <n>`` line; the worse one is ``Answer: <m>``
          alone. Seeing the marker line suffices (no arithmetic).
  answer  no marker: ``Answer: <n>`` against ``Answer: <m>``; the judge must
          do the sum to tell them apart.

The wrong answer is the right one plus a seeded offset in ±1..±9 (kept
non-negative), so it looks like an answer. Each group's two responses are
stored in a seeded order (the GRM prompt shuffles them again). Everything is
a function of ``seed``: the same call gives the same groups.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from grm.data import PreferenceGroup
from opd import tasks as tasks_lib
from opd.tasks import Example

CUES = ("marker", "answer")
MARKER = "Checked."
_ANSWER = re.compile(r"Answer: (-?[0-9]+)")


def _wrong_answer(right: int, rng: np.random.Generator) -> int:
  """``right`` plus an offset in ±1..±9 (upwards when the result would be negative)."""
  offset = int(rng.integers(1, 10))
  return right - offset if right - offset >= 0 and rng.random() < 0.5 else right + offset


def control_group(example: Example, *, cue: str, seed) -> PreferenceGroup:
  """One n = 2 group of ``example`` (a single-turn math example; module docstring).

  Args:
    example: a math ``Example`` whose reference ends ``Answer: <integer>``.
    cue: one of ``CUES``.
    seed: ``np.random.default_rng`` seed of the wrong answer and the order.

  Raises:
    ValueError: another domain or reference, an unknown cue, or a response the
      task's verifier does not rate as built (1 for the better, 0 for the other).
  """
  if cue not in CUES:
    raise ValueError(f"cue={cue!r} must be one of {CUES}")
  if example.domain != "math":
    raise ValueError(f"example {example.id}: domain={example.domain!r}, the control set is "
                     "built from math examples")
  m = _ANSWER.fullmatch(example.reference[-1][1].strip())
  if m is None:
    raise ValueError(f"example {example.id}: reference {example.reference[-1][1]!r} is not "
                     "'Answer: <integer>'")
  rng = np.random.default_rng(seed)
  right = int(m.group(1))
  better = f"Answer: {right}" if cue == "answer" else f"{MARKER}\nAnswer: {right}"
  worse = f"Answer: {_wrong_answer(right, rng)}"
  task = tasks_lib.get_task("math")
  verdicts = [task.verify(example, t) for t in (better, worse)]
  if [v.reward for v in verdicts] != [1.0, 0.0]:
    raise ValueError(f"example {example.id}: the verifier rates {better!r} / {worse!r} as "
                     f"{[v.reward for v in verdicts]}, not [1.0, 0.0]")
  order = (0, 1) if rng.random() < 0.5 else (1, 0)
  texts = (better, worse)
  return PreferenceGroup("math", example.id, example.split, example.prompt,
                         tuple(texts[i] for i in order),
                         tuple(float(verdicts[i].reward) for i in order),
                         tuple(verdicts[i].reason for i in order))


def control_groups(split: str, n: int, *, cue: str, seed: int, difficulties: Sequence[int] = (1,)
                   ) -> tuple[list[Example], list[PreferenceGroup]]:
  """``(examples, groups)``: ``n`` distinct ``split`` math prompts
  (``opd.tasks.domain_examples`` with ``seed``) and one group each, group i
  drawn from seed ``(seed, i)``."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"n={n!r} must be an int >= 1")
  examples = tasks_lib.domain_examples(("math",), split, n, seed, tuple(difficulties),
                                       unique=True)
  return examples, [control_group(ex, cue=cue, seed=(int(seed), i))
                    for i, ex in enumerate(examples)]
