"""The expression and equation grammar of the proof domain (docs/DESIGN.md §7, §9).

One definition, read by ``parse_expr`` and written by ``render``: integers,
``x``, ``+ - * /`` (left-associative, ``* /`` binding tighter) and
parentheses; a ``-`` right before a number makes it negative (rendered as
``(-3)`` except in the leftmost position). ``render`` writes the fewest
parentheses that keep the tree, so ``parse_expr(render(t)) == t``. A tree is
``("n", Fraction)``, ``("x",)`` or ``(op, left, right)``; an equation is a
pair of trees. Values are exact (``fractions.Fraction``): an expression is
read as ``a*x + b`` (``linear``), an equation by its unique solution.

``parse_expr`` raises ``ParseError`` (a ``ValueError``) on text outside the
grammar, on lines over ``MAX_LINE_CHARS``, numbers over ``MAX_DIGITS`` digits
or nesting deeper than ``MAX_DEPTH``; the step checker catches it.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Union

from opd.text import parsers

MAX_LINE_CHARS = 160
MAX_DIGITS = 12
MAX_DEPTH = 12

# An expression tree: ("n", Fraction) a number, ("x",) the unknown, (op, left, right).
Tree = tuple
Eq = tuple  # (left tree, right tree)
State = Union[Tree, Eq]
X: Tree = ("x",)
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(x)|([-+*/()]))")


def num(v) -> Tree:
  return ("n", Fraction(v))


class ParseError(ValueError):
  """A line that is not an expression/equation of the grammar (internal)."""


def parse_expr(text: str) -> Tree:
  """The tree of ``text``; raises ``ParseError`` (the checker catches it)."""
  if len(text) > MAX_LINE_CHARS:
    raise ParseError("line too long")
  toks, pos = [], 0
  text = text.rstrip()
  while pos < len(text):
    m = _TOKEN.match(text, pos)
    if m is None:
      raise ParseError(f"unexpected {text[pos:pos + 8]!r}")
    toks.append(m.group(1) or m.group(2) or m.group(3))
    pos = m.end()
  toks.append("$")
  i = 0

  def peek():
    return toks[i]

  def take():
    nonlocal i
    i += 1
    return toks[i - 1]

  def number(tok: str) -> Tree:
    if not tok.isdigit() or len(tok) > MAX_DIGITS:
      raise ParseError(f"bad number {tok[:20]!r}")
    return num(int(tok))

  def factor(depth: int) -> Tree:
    if depth > MAX_DEPTH:
      raise ParseError("nested too deep")
    tok = take()
    if tok == "(":
      t = expr(depth + 1)
      if take() != ")":
        raise ParseError("unclosed (")
      return t
    if tok == "x":
      return X
    if tok == "-":
      return num(-number(take())[1])
    return number(tok)

  def term(depth: int) -> Tree:
    t = factor(depth)
    while peek() in ("*", "/"):
      t = (take(), t, factor(depth))
    return t

  def expr(depth: int) -> Tree:
    t = term(depth)
    while peek() in ("+", "-"):
      t = (take(), t, term(depth))
    return t

  tree = expr(0)
  if peek() != "$":
    raise ParseError(f"unexpected {peek()!r}")
  return tree


def render(t: Tree) -> str:
  """``t`` in the grammar with the fewest parentheses (``parse_expr`` inverts it)."""
  return _render(t, leftmost=True)


def _render(t: Tree, leftmost: bool) -> str:
  if t[0] == "x":
    return "x"
  if t[0] == "n":
    s = parsers.format_number(t[1])
    if t[1].denominator != 1:
      raise ValueError(f"render: tree leaf {s} is not an integer")
    return s if t[1] >= 0 or leftmost else f"({s})"
  op, left, right = t
  ls = _render(left, leftmost)
  if left[0] in _PREC and _PREC[left[0]] < _PREC[op]:
    ls = f"({_render(left, True)})"
  rs = _render(right, False)
  if right[0] in _PREC and _PREC[right[0]] <= _PREC[op]:  # keeps the tree: a-(b-c), a*(b/c)
    rs = f"({_render(right, True)})"
  return f"{ls}{op}{rs}"


def ops(t: Tree) -> int:
  """Number of binary operators in ``t``."""
  return 0 if t[0] in ("n", "x") else 1 + ops(t[1]) + ops(t[2])


def linear(t: Tree) -> tuple[Fraction, Fraction]:
  """``(a, b)`` with ``t = a*x + b``; ``ParseError`` when not linear or dividing by 0."""
  if t[0] == "n":
    return Fraction(0), t[1]
  if t[0] == "x":
    return Fraction(1), Fraction(0)
  op, (a1, b1), (a2, b2) = t[0], linear(t[1]), linear(t[2])
  if op == "+":
    return a1 + a2, b1 + b2
  if op == "-":
    return a1 - a2, b1 - b2
  if op == "*":
    if a1 and a2:
      raise ParseError("not linear in x")
    return a1 * b2 + a2 * b1, b1 * b2
  if a2 or b2 == 0:
    raise ParseError("division by x" if a2 else "division by zero")
  return a1 / b2, b1 / b2


def solution(eq: Eq) -> Fraction | None:
  """The unique x solving ``left = right``, or None."""
  (a1, b1), (a2, b2) = linear(eq[0]), linear(eq[1])
  return None if a1 == a2 else (b2 - b1) / (a1 - a2)


def value(state: State, kind: str) -> Fraction | None:
  """An expression's value (x-free) or an equation's solution; None when undefined."""
  try:
    if kind == "equation":
      return solution(state)
    a, b = linear(state)
    return None if a else b
  except ParseError:
    return None


def size(state: State, kind: str) -> int:
  return ops(state[0]) + ops(state[1]) if kind == "equation" else ops(state)


def parse_equation(text: str) -> Eq:
  parts = text.split("=")
  if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
    raise ParseError("an equation line is 'left = right'")
  return parse_expr(parts[0]), parse_expr(parts[1])


def render_state(state: State, kind: str) -> str:
  return f"{render(state[0])} = {render(state[1])}" if kind == "equation" else render(state)
