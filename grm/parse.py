r"""Reading a GRM judgement back; never raises on model text (docs/DESIGN.md §6).

``parse_judgement(text, n)`` reads the grammar of ``grm.format``: the last
line must be ``Scores: \boxed{s_1, ..., s_n}`` with n integers in 1..10.
Anything else is an *invalid* sample with one reason code (``REASONS``),
which callers count (``invalid_counts``) and report; a run never crashes on
what a model wrote. Checks, in order:

  not_text          the input is not a ``str``
  empty             nothing but whitespace
  scores_not_last   a ``Scores:`` line exists, but other text follows it
  no_scores_line    no line starts with ``Scores:``
  malformed_scores  the last line starts with ``Scores:`` but is not
                    ``\boxed{`` comma-separated integers ``}``
  wrong_count       not exactly n scores
  out_of_range      a score outside 1..10 (integers of 4+ digits included)

Principles and critique are read on a best-effort basis for reports; they do
not decide validity. Scores come back in the **shown** order.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Iterable

from grm.format import (CRITIQUE_HEADER, MAX_SCORE, MIN_SCORE, PRINCIPLES_HEADER, SCORES_PREFIX,
                        Principle, check_n)

REASONS = ("not_text", "empty", "scores_not_last", "no_scores_line", "malformed_scores",
           "wrong_count", "out_of_range")

_INT = r"[+-]?[0-9]+"
_SCORES_LINE = re.compile(
    re.escape(SCORES_PREFIX) + r"[ \t]*\\boxed\{[ \t]*(" + _INT + r"(?:[ \t]*,[ \t]*" + _INT
    + r")*)[ \t]*\}[ \t]*", re.ASCII)
_PRINCIPLE = re.compile(r"Principle [0-9]{1,4}(?: \(weight ([0-9]{1,3})%\))?: (.+)", re.ASCII)
_MAX_DIGITS = 3  # "010" is 10; longer strings are never in range (and never hit int()'s limit)


@dataclasses.dataclass(frozen=True)
class Judgement:
  """One parsed GRM output.

  Attributes:
    scores: n ints in 1..10 in the shown order, or None when invalid.
    reason: None when valid, else one of ``REASONS``.
    principles: the principle lines that parsed (best effort).
    critique: the critique text (best effort; "" when absent).
  """
  scores: tuple[int, ...] | None
  reason: str | None
  principles: tuple[Principle, ...] = ()
  critique: str = ""

  @property
  def valid(self) -> bool:
    return self.reason is None


def _invalid(reason: str, principles=(), critique="") -> Judgement:
  return Judgement(scores=None, reason=reason, principles=principles, critique=critique)


def _sections(lines: list[str]) -> tuple[tuple[Principle, ...], str]:
  """Principles and critique from the lines before the scores line."""
  stripped = [line.rstrip() for line in lines]
  try:
    start = stripped.index(PRINCIPLES_HEADER) + 1
  except ValueError:
    start = None
  try:
    crit = stripped.index(CRITIQUE_HEADER, start or 0)
  except ValueError:
    crit = None
  principles = []
  if start is not None:
    for line in stripped[start:crit if crit is not None else len(stripped)]:
      m = _PRINCIPLE.fullmatch(line)
      if m:
        weight = int(m.group(1)) if m.group(1) is not None else None
        principles.append(Principle(text=m.group(2).strip(), weight=weight))
  critique = "\n".join(lines[crit + 1:]).strip() if crit is not None else ""
  return tuple(principles), critique


def parse_judgement(text, n: int) -> Judgement:
  """Parses a GRM output for n responses; never raises on ``text``.

  Args:
    text: what the model wrote (the assistant turn, stop token excluded).
    n: the number of responses the prompt showed (an int >= 1; a caller bug
      raises ``ValueError``).

  Returns:
    A ``Judgement``: valid with n scores in the shown order, or invalid
    with a reason code (module docstring).
  """
  n = check_n(n)
  if not isinstance(text, str):
    return _invalid("not_text")
  if not text.strip():
    return _invalid("empty")
  lines = text.rstrip().split("\n")
  last = lines[-1].strip()
  principles, critique = _sections(lines[:-1])
  if not last.startswith(SCORES_PREFIX):
    has_scores = any(line.strip().startswith(SCORES_PREFIX) for line in lines[:-1])
    return _invalid("scores_not_last" if has_scores else "no_scores_line", principles, critique)
  m = _SCORES_LINE.fullmatch(last)
  if m is None:
    return _invalid("malformed_scores", principles, critique)
  tokens = [t.strip() for t in m.group(1).split(",")]
  if len(tokens) != n:
    return _invalid("wrong_count", principles, critique)
  if any(len(t.lstrip("+-")) > _MAX_DIGITS for t in tokens):
    return _invalid("out_of_range", principles, critique)
  scores = tuple(int(t) for t in tokens)
  if any(not MIN_SCORE <= s <= MAX_SCORE for s in scores):
    return _invalid("out_of_range", principles, critique)
  return Judgement(scores=scores, reason=None, principles=principles, critique=critique)


def invalid_counts(judgements: Iterable[Judgement]) -> dict[str, int]:
  """``{reason: count}`` over the invalid judgements (every reason present, 0 if none).

  Parse-level reasons only: a text cannot show that the sampler cut it. For
  sampled judgements, whose counts include ``truncated``, use
  ``grm.judge.invalid_sample_counts``.
  """
  counts = collections.Counter(j.reason for j in judgements if j.reason is not None)
  return {r: int(counts.get(r, 0)) for r in REASONS}
