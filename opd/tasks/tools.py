"""Tools of the agent environment: a safe calculator and a key-value lookup.

Both are pure functions of their arguments (and the example's table), so a
trajectory can be replayed exactly. Neither uses ``eval``: the calculator is
a recursive-descent parser over ``+ - * / ( )``, integers and decimals, with
exact ``Fraction`` arithmetic and bounds on input length, nesting depth and
magnitude, so no input can make it slow or huge.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from opd.text import parsers

MAX_EXPRESSION_CHARS = 64
MAX_DEPTH = 16
MAX_MAGNITUDE = 10**12
_TOKEN_RE = re.compile(r"\s*(?:([0-9]{1,12}(?:\.[0-9]{1,6})?)|(.))", re.DOTALL)


class ToolError(ValueError):
  """A tool call that cannot execute; the message is shown to the policy."""


class _Parser:
  def __init__(self, text: str):
    self.tokens = []
    for match in _TOKEN_RE.finditer(text):
      number, op = match.groups()
      if number is not None:
        self.tokens.append(Fraction(number))
      elif op is not None and not op.isspace():
        if op not in "+-*/()":
          raise ToolError(f"unexpected character {op!r}")
        self.tokens.append(op)
    self.pos = 0

  def peek(self):
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self):
    tok = self.peek()
    self.pos += 1
    return tok

  def expression(self, depth: int) -> Fraction:
    value = self.term(depth)
    while self.peek() in ("+", "-"):
      value = _bounded(value + self.term(depth) if self.take() == "+" else value - self.term(depth))
    return value

  def term(self, depth: int) -> Fraction:
    value = self.factor(depth)
    while self.peek() in ("*", "/"):
      if self.take() == "*":
        value = _bounded(value * self.factor(depth))
      else:
        divisor = self.factor(depth)
        if divisor == 0:
          raise ToolError("division by zero")
        value = _bounded(value / divisor)
    return value

  def factor(self, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
      raise ToolError("expression nested too deeply")
    tok = self.take()
    if tok == "-":
      return -self.factor(depth + 1)
    if tok == "(":
      value = self.expression(depth + 1)
      if self.take() != ")":
        raise ToolError("missing ')'")
      return value
    if isinstance(tok, Fraction):
      return tok
    raise ToolError("expected a number" if tok is None else f"unexpected {tok!r}")


def _bounded(value: Fraction) -> Fraction:
  if abs(value.numerator) > MAX_MAGNITUDE * value.denominator or value.denominator > MAX_MAGNITUDE:
    raise ToolError("number too large")
  return value


def calculate(expression: Any) -> Fraction:
  """Exact value of an arithmetic expression such as ``"(7+5)*3/4"``.

  Raises:
    ToolError: not a string, too long, unparseable, division by zero, or a
      result out of bounds.
  """
  if not isinstance(expression, str):
    raise ToolError(f"expression must be a string, got {type(expression).__name__}")
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  parser = _Parser(expression)
  if not parser.tokens:
    raise ToolError("empty expression")
  value = parser.expression(0)
  if parser.peek() is not None:
    raise ToolError(f"unexpected {parser.peek()!r}")
  return value


def lookup(table: Mapping[str, Any], key: Any) -> str:
  """The value stored under ``key``. Raises ToolError for an unknown key."""
  if not isinstance(key, str):
    raise ToolError(f"key must be a string, got {type(key).__name__}")
  if key not in table:
    raise ToolError(f"unknown key {key[:32]!r}")
  return str(table[key])


TOOL_ARGUMENTS = {"calculator": "expression", "lookup": "key"}


def run_tool(name: str, arguments: Mapping[str, Any], table: Mapping[str, Any]) -> str:
  """Executes one call; returns the result text. Raises ToolError."""
  if name not in TOOL_ARGUMENTS:
    raise ToolError(f"unknown tool {name[:32]!r}; tools: {sorted(TOOL_ARGUMENTS)}")
  expected = TOOL_ARGUMENTS[name]
  if set(arguments) != {expected}:
    raise ToolError(f"{name} takes exactly one argument {expected!r}")
  if name == "calculator":
    return parsers.format_number(calculate(arguments[expected]))
  return lookup(table, arguments[expected])
