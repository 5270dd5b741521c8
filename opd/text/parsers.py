"""Robust parsers for model responses: thinking, final answers, tool calls, code.

Every parser here takes any string and never raises: malformed input comes
back as a result whose ``ok`` is False with a short ``reason`` (which the
verifiers turn into format reward 0 and count). Inputs longer than
``MAX_RESPONSE_CHARS`` are rejected up front so that no parser does
unbounded work on a runaway generation.

Formats (the chat conventions of docs/DEVELOPING.md):

* An optional leading ``<think>...</think>`` block, then the visible body.
* Final answer: the last non-empty line of the body is ``Answer: <number>``
  and ``Answer:`` occurs exactly once. Numbers are ASCII: an integer
  (``-12``), a fraction (``5/6``, denominator > 0) or a decimal (``0.25``),
  at most ``MAX_NUMBER_DIGITS`` digits per part; values compare exactly as
  ``fractions.Fraction``.
* Tool call: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``
  in the one grammar of ``opd.text.tool_calls`` (shared with the chat
  template). A well-formed tool-call turn holds exactly one call and nothing
  else besides the optional thinking and whitespace.
* Code: a Python function definition, either the whole body or the first
  fenced block (```` ```python ... ``` ````).
"""
from __future__ import annotations

import ast
import dataclasses
import re
import warnings
from fractions import Fraction
from typing import Any

from opd.text import tokenizers
from opd.text.tokenizers import THINK_CLOSE, THINK_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from opd.text.tool_calls import ToolCall, scan_tool_calls

MAX_RESPONSE_CHARS = 4096
MAX_NUMBER_DIGITS = 30
ANSWER_PREFIX = "Answer:"
# Chat-template markers a response must never contain: emitting one means the
# model tried to forge a turn boundary (thinking and tool-call tags are parsed).
SPECIAL_TOKENS = tuple(t for t in tokenizers.SPECIAL_TOKENS
                       if t not in (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE))

_NUMBER_RE = re.compile(
    rf"[+-]?(?:[0-9]{{1,{MAX_NUMBER_DIGITS}}}(?:/[0-9]{{1,{MAX_NUMBER_DIGITS}}})?"
    rf"|[0-9]{{1,{MAX_NUMBER_DIGITS}}}\.[0-9]{{1,{MAX_NUMBER_DIGITS}}})")
_ANSWER_LINE_RE = re.compile(r"Answer: ?(\S+)")
_FENCE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Thinking:
  """A response split into its optional thinking block and visible body."""
  thinking: str | None
  body: str
  ok: bool
  reason: str


@dataclasses.dataclass(frozen=True)
class ParsedAnswer:
  """``value`` is the exact answer when ``ok``; ``reason`` says why not."""
  value: Fraction | None
  text: str | None
  ok: bool
  reason: str


@dataclasses.dataclass(frozen=True)
class ParsedToolCalls:
  """All ``<tool_call>`` blocks of a text.

  Attributes:
    calls: the well-formed calls, in order.
    errors: one reason per malformed block (bad JSON, wrong schema, unclosed).
    outside: the text outside the blocks, stripped.
  """
  calls: tuple[ToolCall, ...]
  errors: tuple[str, ...]
  outside: str


@dataclasses.dataclass(frozen=True)
class AssistantTurn:
  """One assistant turn classified for an agent environment.

  ``kind`` is ``"tool_call"`` (exactly one well-formed call and nothing
  else), ``"answer"`` (a well-formed final answer, no call) or
  ``"malformed"`` (``reason`` says why).
  """
  kind: str
  thinking: str | None
  call: ToolCall | None
  answer: ParsedAnswer | None
  reason: str


@dataclasses.dataclass(frozen=True)
class ParsedCode:
  """``source`` is the validated program when ``ok``."""
  source: str | None
  ok: bool
  reason: str


def _precheck(text: Any) -> str | None:
  """Reason to reject ``text`` before parsing, or None."""
  if not isinstance(text, str):
    return f"not_a_string:{type(text).__name__}"
  if len(text) > MAX_RESPONSE_CHARS:
    return "too_long"
  if "\x00" in text:
    return "nul_byte"
  return None


def split_thinking(text: Any) -> Thinking:
  """Separates a leading ``<think>...</think>`` block from the body.

  Thinking is optional; a stray ``<think>``/``</think>`` anywhere else, an
  unclosed block or a second block is malformed.
  """
  if (bad := _precheck(text)) is not None:
    return Thinking(None, "", False, bad)
  stripped = text.lstrip()
  thinking = None
  if stripped.startswith(THINK_OPEN):
    end = stripped.find(THINK_CLOSE)
    if end < 0:
      return Thinking(None, "", False, "unclosed_think")
    thinking = stripped[len(THINK_OPEN):end]
    body = stripped[end + len(THINK_CLOSE):]
    if THINK_OPEN in thinking:
      return Thinking(None, "", False, "nested_think")
  else:
    body = text
  if THINK_OPEN in body or THINK_CLOSE in body:
    return Thinking(None, "", False, "stray_think_tag")
  if any(tok in text for tok in SPECIAL_TOKENS):
    return Thinking(None, "", False, "special_token")
  return Thinking(thinking, body, True, "ok")


def parse_number(text: Any) -> Fraction | None:
  """Exact value of an ASCII integer, fraction or decimal; None otherwise."""
  if not isinstance(text, str) or not _NUMBER_RE.fullmatch(text):
    return None
  try:
    return Fraction(text)
  except (ValueError, ZeroDivisionError):
    return None


def format_number(value: Fraction | int) -> str:
  """Canonical text of a rational: ``12``, ``-3``, ``5/6`` (lowest terms)."""
  value = Fraction(value)
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def format_answer(value: Fraction | int) -> str:
  """The canonical final-answer line, e.g. ``Answer: 5/6``."""
  return f"{ANSWER_PREFIX} {format_number(value)}"


def parse_answer_body(body: str) -> ParsedAnswer:
  """The final answer of a body that has no thinking block."""
  if body.count(ANSWER_PREFIX) == 0:
    return ParsedAnswer(None, None, False, "no_answer")
  if body.count(ANSWER_PREFIX) > 1:
    return ParsedAnswer(None, None, False, "multiple_answers")
  lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
  match = _ANSWER_LINE_RE.fullmatch(lines[-1]) if lines else None
  if match is None:
    return ParsedAnswer(None, None, False, "bad_answer_line")
  value = parse_number(match.group(1))
  if value is None:
    return ParsedAnswer(None, match.group(1), False, "bad_number")
  return ParsedAnswer(value, match.group(1), True, "ok")


def parse_final_answer(text: Any) -> ParsedAnswer:
  """Parses ``[<think>...</think>]...Answer: <number>`` (see module docstring)."""
  split = split_thinking(text)
  if not split.ok:
    return ParsedAnswer(None, None, False, split.reason)
  return parse_answer_body(split.body)


def parse_tool_calls(text: Any) -> ParsedToolCalls:
  """Finds every ``<tool_call>...</tool_call>`` block of ``text``."""
  if (bad := _precheck(text)) is not None:
    return ParsedToolCalls((), (bad,), "")
  scan = scan_tool_calls(text)
  return ParsedToolCalls(scan.calls, tuple(c.reason for c in scan.invalid), scan.outside.strip())


def parse_assistant_turn(text: Any) -> AssistantTurn:
  """Classifies one agent turn as a tool call, a final answer or malformed."""
  split = split_thinking(text)
  if not split.ok:
    return AssistantTurn("malformed", None, None, None, split.reason)
  body = split.body
  if TOOL_CALL_OPEN in body or TOOL_CALL_CLOSE in body:
    parsed = parse_tool_calls(body)
    if parsed.errors:
      return AssistantTurn("malformed", split.thinking, None, None, parsed.errors[0])
    if len(parsed.calls) != 1:
      return AssistantTurn("malformed", split.thinking, None, None, "multiple_tool_calls")
    if parsed.outside:
      return AssistantTurn("malformed", split.thinking, None, None, "text_outside_tool_call")
    return AssistantTurn("tool_call", split.thinking, parsed.calls[0], None, "ok")
  answer = parse_answer_body(body)
  if not answer.ok:
    return AssistantTurn("malformed", split.thinking, None, answer, answer.reason)
  return AssistantTurn("answer", split.thinking, None, answer, "ok")


def extract_python_function(text: Any, name: str = "f", n_args: int | None = None) -> ParsedCode:
  """Validates a Python program defining function ``name``.

  The program is the first fenced block if there is one, else the whole body
  after the thinking. It must parse, and its top level may hold only
  function definitions, one of them ``name`` with ``n_args`` positional
  parameters (when given) and no ``*args``/``**kwargs``/keyword-only ones.
  Anything else at top level (imports, calls, loops) is rejected: the
  harness calls the function, nothing else should run.
  """
  split = split_thinking(text)
  if not split.ok:
    return ParsedCode(None, False, split.reason)
  fence = _FENCE_RE.search(split.body)
  source = (fence.group(1) if fence else split.body).strip("\n")
  if not source.strip():
    return ParsedCode(None, False, "empty")
  try:
    with warnings.catch_warnings():
      # Model-written code like ``1if x else 2`` parses with a SyntaxWarning
      # printed to stderr; it is the model's problem, not the user's log's.
      warnings.simplefilter("ignore", SyntaxWarning)
      tree = ast.parse(source)
  except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
    return ParsedCode(None, False, "syntax_error")
  target = None
  for node in tree.body:
    if not isinstance(node, ast.FunctionDef):
      return ParsedCode(None, False, f"top_level_{type(node).__name__}")
    if node.name == name:
      target = node
  if target is None:
    return ParsedCode(None, False, f"no_function_{name}")
  a = target.args
  if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
    return ParsedCode(None, False, "bad_signature")
  if n_args is not None and len(a.args) != n_args:
    return ParsedCode(None, False, f"wrong_arity:{len(a.args)}")
  return ParsedCode(source, True, "ok")
