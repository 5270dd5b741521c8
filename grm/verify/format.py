r"""Prompts and the one grammar of each DeepSeekMath-V2 role (docs/DESIGN.md §7).

Four roles read one problem of the proof domain (``opd.tasks.proof_task``);
a proof is shown with its non-empty lines numbered (``1| 3*4+5 = 12+5``), the
numbers the issues refer to.

**Verifier** (``verifier_prompt``: problem + proof) writes an *analysis*::

  Line 2: wrong_step - 12+5 is not 16
  Line 3: wrong_final
  Score: 0

one line per issue, ``Line <k>: <kind>`` with k >= 1 and a kind of
``ISSUE_KINDS`` (the checker's), optionally `` - <message>``; or the single
line ``No issues.``; then the last line ``Score: <s>``, s one of ``0``,
``0.5``, ``1``.

**Meta-verifier** (``meta_prompt``: problem + proof + analysis) judges each
stated issue in order, ``Issue <i>: real`` or ``Issue <i>: not real``
(i = 1, 2, ...), or writes ``No issues stated.``; then ``Score: <s>``, its
score of the analysis.

**Generator** (``generator_prompt``: problem) writes a proof Y (its last
line ``Answer: <number>``), a line ``Self-evaluation:``, then a
self-evaluation Z in the verifier's grammar. **Refinement**
(``refine_prompt``: problem + previous proof + its analysis) answers in the
generator's grammar too.

Parsers (``parse_analysis``, ``parse_meta``, ``parse_generation``) never raise
on model text: a result has ``valid`` and a ``reason`` (None when valid, else
one of ``REASONS``). Blank lines and blanks around a line are ignored.

Rule-written texts for the cold start come from the checker:
``write_analysis`` (its issues, optionally with noise), ``write_meta``
(each stated issue confirmed iff the checker has an issue of that line and
kind; score ``rule_meta_score``) and ``write_generation``.
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Sequence

from grm.format import plain
from opd.tasks.proof_task import ISSUE_KINDS, SCORES, Issue, ProofCheck, proof_lines, score_of
from opd.text import parsers

SCORE_PREFIX = "Score:"
NO_ISSUES = "No issues."
NO_ISSUES_STATED = "No issues stated."
SELF_EVAL = "Self-evaluation:"
REAL, NOT_REAL = "real", "not real"
MAX_CHARS = parsers.MAX_RESPONSE_CHARS
REASONS = ("not_text", "too_long", "empty", "no_score_line", "bad_score", "bad_line",
           "no_issue_section", "mixed_issue_section", "wrong_count", "no_self_evaluation",
           "bad_proof", "bad_thinking")
SCORE_TEXT = {0.0: "0", 0.5: "0.5", 1.0: "1"}
# Constrained decoding of any role's output (opd.rollout.constraint): free
# text, then the last line "Score: s" with s one of SCORE_TEXT's values.
_SCORE_LINE = (re.escape(SCORE_PREFIX) + " ("
               + "|".join(re.escape(t) for t in SCORE_TEXT.values()) + ")")
SCORE_PATTERN = r"([^\n]*\n)*" + _SCORE_LINE
_SCORE_VALUE = {v: k for k, v in SCORE_TEXT.items()}
# The whole output of a role in its grammar, for constrained decoding: every
# finished sample parses valid. ANALYSIS_PATTERN: "No issues." or one or more
# "Line k: kind" lines (k in 1..9999 without a leading zero; no message, as the
# rule-written SFT targets), then the score line (parse_analysis).
# META_PATTERN: "No issues stated." or "Issue 1: real|not real", "Issue 2: ...",
# numbered in order, up to MAX_META_VERDICTS, then the score line (parse_meta
# without n_issues; a count unlike the analysis's stays wrong_count).
MAX_META_VERDICTS = 9
_ISSUE_LINE = r"Line [1-9][0-9]{0,3}: (" + "|".join(ISSUE_KINDS) + ")"
ANALYSIS_PATTERN = (f"({re.escape(NO_ISSUES)}|{_ISSUE_LINE}(\\n{_ISSUE_LINE})*)"
                    f"\\n{_SCORE_LINE}")


def _verdicts_pattern(first: int, last: int) -> str:
  """``Issue first: v``, optionally followed by a newline and the verdicts first+1..last."""
  head = f"Issue {first}: ({REAL}|{NOT_REAL})"
  return head if first == last else f"{head}(\\n{_verdicts_pattern(first + 1, last)})?"


META_PATTERN = (f"({re.escape(NO_ISSUES_STATED)}|{_verdicts_pattern(1, MAX_META_VERDICTS)})"
                f"\\n{_SCORE_LINE}")

_ISSUE = re.compile(r"Line ([0-9]{1,4}): ([a-z_]+)(?: - (.*))?", re.ASCII)
_VERDICT = re.compile(r"Issue ([0-9]{1,4}): (real|not real)", re.ASCII)
_SCORE = re.compile(re.escape(SCORE_PREFIX) + r"[ \t]*(\S*)[ \t]*")

# Short instructions: the tiny byte-level models read every prompt byte at every step.
_VERIFIER_INSTRUCTION = ("Verify the proof: each issue as \"Line k: kind\", or \"No issues.\"; "
                         "then \"Score: s\" (1, 0.5 or 0).")
_META_INSTRUCTION = ("Check the analysis: \"Issue i: real\" or \"Issue i: not real\" per issue, "
                     "or \"No issues stated.\"; then \"Score: s\".")
_GENERATOR_INSTRUCTION = ("Derive it one step per line, then \"Self-evaluation:\" as a "
                          "verifier would.")
_REFINE_INSTRUCTION = "Fix this derivation, then \"Self-evaluation:\" as a verifier would."


# ----------------------------------------------------------------------------- prompts
def numbered(proof: str) -> str:
  """The proof's non-empty lines as ``k| line`` (k 1-based), chat markers bracketed."""
  if not isinstance(proof, str):
    raise ValueError(f"proof must be a str, got {type(proof).__name__}")
  lines = proof_lines(plain(proof))
  return "\n".join(f"{k}| {line}" for k, line in enumerate(lines, 1)) if lines else "(empty)"


def _check_text(name: str, text: Any) -> str:
  if not isinstance(text, str):
    raise ValueError(f"{name} must be a str, got {type(text).__name__}")
  return plain(text.strip())


def verifier_prompt(problem: str, proof: str) -> str:
  """The verifier's user turn: instruction, problem, numbered proof."""
  return "\n".join([_VERIFIER_INSTRUCTION, "Problem: " + _check_text("problem", problem),
                    "Proof:", numbered(proof)])


def meta_prompt(problem: str, proof: str, analysis: str) -> str:
  """The meta-verifier's user turn: problem, numbered proof, the analysis."""
  return "\n".join([_META_INSTRUCTION, "Problem: " + _check_text("problem", problem), "Proof:",
                    numbered(proof), "Analysis:", _check_text("analysis", analysis)])


def generator_prompt(problem: str) -> str:
  """The generator's user turn: the problem and the two-part output it asks for."""
  return "\n".join([_check_text("problem", problem), _GENERATOR_INSTRUCTION])


def refine_prompt(problem: str, proof: str, analysis: str) -> str:
  """Refinement's user turn: the problem, the previous proof and its analysis."""
  return "\n".join([_check_text("problem", problem), _REFINE_INSTRUCTION, "Previous derivation:",
                    _check_text("proof", proof), "Verification:",
                    _check_text("analysis", analysis)])


# ----------------------------------------------------------------------------- renderers
def format_score(score: float) -> str:
  if score not in SCORE_TEXT:
    raise ValueError(f"score={score!r} must be one of {SCORES}")
  return f"{SCORE_PREFIX} {SCORE_TEXT[float(score)]}"


def format_analysis(issues: Sequence[Issue], score: float) -> str:
  """An analysis in the verifier's grammar (issues with messages as ``Line k: kind - message``)."""
  lines = []
  for i in issues:
    if i.kind not in ISSUE_KINDS or isinstance(i.line, bool) or not isinstance(i.line, int) or \
        not 1 <= i.line <= 9999:
      raise ValueError(f"issue {i!r}: line must be an int in [1, 9999] and kind one of "
                       f"{ISSUE_KINDS}")
    msg = " ".join(i.message.split())
    lines.append(f"Line {i.line}: {i.kind}" + (f" - {msg}" if msg else ""))
  return "\n".join((lines or [NO_ISSUES]) + [format_score(score)])


def format_meta(verdicts: Sequence[bool], score: float) -> str:
  """A meta-verification: one ``Issue i: real|not real`` per stated issue, then the score."""
  lines = [f"Issue {i}: {REAL if v else NOT_REAL}" for i, v in enumerate(verdicts, 1)]
  return "\n".join((lines or [NO_ISSUES_STATED]) + [format_score(score)])


def write_generation(proof: str, analysis: str) -> str:
  """Proof Y, the ``Self-evaluation:`` line, analysis Z."""
  return f"{proof.strip()}\n{SELF_EVAL}\n{analysis.strip()}"


# ----------------------------------------------------------------------------- parsers
class _Verdict:
  """What a parsed analysis and a meta-judgement share: ``valid`` iff no ``reason``."""
  reason: str | None

  @property
  def valid(self) -> bool:
    return self.reason is None


@dataclasses.dataclass(frozen=True)
class Analysis(_Verdict):
  """A parsed verifier analysis (or self-evaluation).

  Attributes:
    issues: the stated issues (``Issue(line, kind, message)``, line 1-based).
    score: in ``SCORES``, or None when invalid.
    reason: None when valid, else one of ``REASONS``.
  """
  issues: tuple[Issue, ...]
  score: float | None
  reason: str | None

  @property
  def reports_issues(self) -> bool:
    return self.valid and bool(self.issues)


@dataclasses.dataclass(frozen=True)
class MetaJudgement(_Verdict):
  """A parsed meta-verification: ``verdicts[i]`` True when stated issue i+1 is judged real."""
  verdicts: tuple[bool, ...]
  score: float | None
  reason: str | None

  @property
  def confirms(self) -> bool:
    """Valid and every stated issue judged real (a vote for the analysis's validity)."""
    return self.valid and all(self.verdicts)


@dataclasses.dataclass(frozen=True)
class Generation:
  """A parsed generator output: proof Y and self-evaluation Z.

  ``valid`` (R_format(Y, Z) = 1) needs one ``Self-evaluation:`` line, a proof
  ending with ``Answer: <number>`` and a valid Z.
  """
  proof: str | None
  analysis: Analysis
  reason: str | None

  @property
  def valid(self) -> bool:
    return self.reason is None


def _lines(text: Any) -> tuple[list[str] | None, str | None]:
  if not isinstance(text, str):
    return None, "not_text"
  if len(text) > MAX_CHARS:
    return None, "too_long"
  lines = [line.strip() for line in text.split("\n") if line.strip()]
  return (lines, None) if lines else (None, "empty")


def _score(lines: list[str]) -> tuple[float | None, str | None]:
  m = _SCORE.fullmatch(lines[-1])
  if m is None:
    return None, "bad_score" if lines[-1].startswith(SCORE_PREFIX) else "no_score_line"
  if m.group(1) not in _SCORE_VALUE:
    return None, "bad_score"
  return _SCORE_VALUE[m.group(1)], None


def parse_analysis(text: Any) -> Analysis:
  """Reads the verifier's grammar (module docstring); never raises."""
  lines, reason = _lines(text)
  if reason is None:
    score, reason = _score(lines)
  if reason is not None:
    return Analysis((), None, reason)
  body, issues = lines[:-1], []
  if body == [NO_ISSUES]:
    return Analysis((), score, None)
  for line in body:
    m = _ISSUE.fullmatch(line)
    if line == NO_ISSUES:
      return Analysis((), None, "mixed_issue_section")
    if m is None or m.group(2) not in ISSUE_KINDS or int(m.group(1)) < 1:
      return Analysis((), None, "bad_line")
    issues.append(Issue(int(m.group(1)), m.group(2), (m.group(3) or "").strip()))
  if not issues:
    return Analysis((), None, "no_issue_section")
  return Analysis(tuple(issues), score, None)


def parse_meta(text: Any, n_issues: int | None = None) -> MetaJudgement:
  """Reads the meta-verifier's grammar; with ``n_issues`` (the analysis's
  stated issue count) a different number of verdicts is ``wrong_count``.
  Verdicts must be numbered 1, 2, ... in order. Never raises on ``text``."""
  if n_issues is not None and (isinstance(n_issues, bool) or not isinstance(n_issues, int)
                               or n_issues < 0):
    raise ValueError(f"n_issues={n_issues!r} must be an int >= 0 or None")
  lines, reason = _lines(text)
  if reason is None:
    score, reason = _score(lines)
  if reason is not None:
    return MetaJudgement((), None, reason)
  body = lines[:-1]
  if body == [NO_ISSUES_STATED]:
    verdicts = []
  elif not body:
    return MetaJudgement((), None, "no_issue_section")
  else:
    verdicts = []
    for i, line in enumerate(body, 1):
      m = _VERDICT.fullmatch(line)
      if m is None or int(m.group(1)) != i:
        return MetaJudgement((), None, "mixed_issue_section" if line == NO_ISSUES_STATED
                             else "bad_line")
      verdicts.append(m.group(2) == REAL)
  if n_issues is not None and len(verdicts) != n_issues:
    return MetaJudgement((), None, "wrong_count")
  return MetaJudgement(tuple(verdicts), score, None)


def parse_generation(text: Any) -> Generation:
  """Splits a generator output at its one ``Self-evaluation:`` line; never raises."""
  split = parsers.split_thinking(text)
  if not split.ok:
    reason = {"too_long": "too_long"}.get(split.reason, "not_text" if not isinstance(text, str)
                                          else "bad_thinking")
    return Generation(None, Analysis((), None, reason), reason)
  lines = split.body.split("\n")
  marks = [k for k, line in enumerate(lines) if line.strip() == SELF_EVAL]
  if len(marks) != 1:
    return Generation(None, Analysis((), None, "no_self_evaluation"), "no_self_evaluation")
  proof = "\n".join(lines[:marks[0]]).strip()
  analysis = parse_analysis("\n".join(lines[marks[0] + 1:]))
  answer = parsers.parse_answer_body(proof) if proof else None
  if answer is None or not answer.ok:
    return Generation(proof or None, analysis, "bad_proof")
  return Generation(proof, analysis, analysis.reason)


def split_generation(text: Any) -> tuple[str, str]:
  """``(proof, self-evaluation text)`` of a generator output, for the next
  prompt: the parsed proof, else the text before the first ``Self-evaluation:``
  line (the whole text without one); "" for what is missing. Never raises."""
  if not isinstance(text, str):
    return "", ""
  gen = parse_generation(text)
  head, sep, tail = text.partition(SELF_EVAL)
  return (gen.proof if gen.proof is not None else head.strip()), (tail.strip() if sep else "")


# ----------------------------------------------------------------------------- rule-written
def write_analysis(check: ProofCheck, *, n_lines: int | None = None, noise: float = 0.0,
                   rng: random.Random | None = None, messages: bool = False) -> str:
  """The checker's issues in the verifier's grammar, score ``check.score``.

  With ``noise`` p > 0 (needs ``rng`` and ``n_lines``, the proof's line
  count) each true issue is dropped with probability p and, with probability
  p, one spurious issue (a random line and kind not already stated) is added;
  the written score is then ``score_of`` the stated issues, so a noisy
  analysis is self-consistent but wrong. ``messages`` keeps the checker's
  messages.
  """
  if not 0.0 <= noise <= 1.0:
    raise ValueError(f"noise={noise!r} must be in [0, 1]")
  issues = [i if messages else Issue(i.line, i.kind) for i in check.issues]
  score = check.score
  if noise > 0:
    if rng is None or n_lines is None or n_lines < 1:
      raise ValueError(f"noise={noise} needs rng and n_lines >= 1, got {rng=}, {n_lines=}")
    issues = [i for i in issues if rng.random() >= noise]
    if rng.random() < noise:
      stated = {(i.line, i.kind) for i in issues} | {(i.line, i.kind) for i in check.issues}
      free = [(k, kind) for k in range(1, n_lines + 1) for kind in ISSUE_KINDS
              if (k, kind) not in stated]
      if free:
        issues.append(Issue(*rng.choice(free)))
        issues.sort(key=lambda i: i.line)
    score = score_of(issues)
  return format_analysis(issues, score)


def confirmed(issue: Issue, check: ProofCheck) -> bool:
  """Whether the checker has an issue on the same line of the same kind."""
  return any(i.line == issue.line and i.kind == issue.kind for i in check.issues)


def rule_meta_score(analysis: Analysis, check: ProofCheck) -> float:
  """The rule meta-verifier's score of a valid analysis: 0 if a stated issue
  is not confirmed; else 1 if its score equals the checker's, 0.5 if not
  (issues missed or severity misjudged). An invalid analysis scores 0."""
  if not analysis.valid or not all(confirmed(i, check) for i in analysis.issues):
    return 0.0
  return 1.0 if analysis.score == check.score else 0.5


def write_meta(analysis: Analysis, check: ProofCheck) -> str:
  """The rule meta-verification of a valid ``analysis`` against the checker."""
  if not analysis.valid:
    raise ValueError(f"write_meta needs a valid analysis, got reason {analysis.reason!r}")
  return format_meta([confirmed(i, check) for i in analysis.issues],
                     rule_meta_score(analysis, check))
