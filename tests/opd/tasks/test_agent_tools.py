"""Agent tools: the calculator against Fraction arithmetic, and bad calls."""
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd.tasks.tools import ToolError, calculate, lookup, run_tool


def _expressions():
  """(text, exact value or None for a division by zero) pairs."""
  leaves = st.integers(0, 99).map(lambda n: (str(n), Fraction(n)))

  def combine(children):
    def apply(left, op, right, tight):
      (lt, lv), (rt, rv) = left, right
      if lv is None or rv is None:
        value = None
      elif op == "/":
        value = None if rv == 0 else lv / rv
      else:
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv}[op]
      # Parenthesised operands keep the tree's grouping whatever the precedence.
      return (f"({lt}){op}({rt})" if tight else f"( {lt} ) {op} ( {rt} )"), value
    return st.builds(apply, children, st.sampled_from("+-*/"), children, st.booleans())

  return st.recursive(leaves, combine, max_leaves=5)


@settings(max_examples=300, deadline=None)
@given(_expressions())
def test_calculator_matches_fraction_arithmetic(pair):
  text, value = pair
  if len(text) > 64:
    with pytest.raises(ToolError, match="longer"):
      calculate(text)
  elif value is None:
    with pytest.raises(ToolError, match="division by zero"):
      calculate(text)
  else:
    assert calculate(text) == value


@pytest.mark.parametrize("text,message", [
    ("__import__('os').system('true')", "unexpected character"), ("2**10", "unexpected"),
    ("1/0", "division by zero"), ("(" * 20 + "1" + ")" * 20, "nested too deeply"),
    ("999999999999*999999999999", "too large"), ("", "empty"), ("1 2", "unexpected"),
    ("1e5", "unexpected character"), ("(1+2", "missing"), ("1+", "expected a number"),
    ("x" * 65, "longer"), (5, "must be a string"),
])
def test_calculator_rejects(text, message):
  with pytest.raises(ToolError, match=message):
    calculate(text)


def test_calculator_exact_values():
  assert calculate("7*3") == 21
  assert calculate(" -(1.5 + 2) / 7 ") == Fraction(-1, 2)
  assert run_tool("calculator", {"expression": "1/3+1/6"}, {}) == "1/2"


def test_lookup_and_dispatch():
  table = {"pear": 7}
  assert lookup(table, "pear") == "7"
  assert run_tool("lookup", {"key": "pear"}, table) == "7"
  with pytest.raises(ToolError, match="unknown key"):
    lookup(table, "kiwi")
  with pytest.raises(ToolError, match="must be a string"):
    lookup(table, ["pear"])
  with pytest.raises(ToolError, match="unknown tool"):
    run_tool("search", {"key": "pear"}, table)
  with pytest.raises(ToolError, match="exactly one argument"):
    run_tool("lookup", {"name": "pear"}, table)
