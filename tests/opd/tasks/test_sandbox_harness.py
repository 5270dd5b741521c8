"""The function harness shared by the code task and GENCLUSTER (no sandbox run:
the harness text is executed here, in-process, on trusted functions)."""
import io
import contextlib
import math

import pytest

from opd.tasks.sandbox import harness


def run_here(source: str, inputs) -> str:
  """The harness's stdout, running ``source`` + harness in this process."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(harness.function_program(source, inputs, "@@T@@"), {"__name__": "__main__"})  # noqa: S102
  return out.getvalue()


def test_each_input_gets_its_own_verdict():
  src = ("def f(x):\n  if x == 0:\n    raise KeyError(x)\n  if x == 1:\n    return float('nan')\n"
         "  if x == 2:\n    return object()\n  if x == 3:\n    return [1, [2.5, None, 'a']]\n"
         "  if x == 4:\n    return 'y' * 20000\n  return -float('inf')\n")
  got = harness.read_results(run_here(src, [[0], [1], [2], [3], [4], [5]]), 6, "@@T@@")
  assert got == [("error", "KeyError"), ("ok", "nan"), ("error", "bad_result"),
                 ("ok", "[1, [2.5, None, 'a']]"), ("error", "bad_result"), ("ok", "-inf")]
  assert math.isnan(harness.literal("nan"))
  assert harness.literal("[1, [2.5, None, 'a']]") == [1, [2.5, None, "a"]]
  assert harness.literal("[-inf, inf]") == [-math.inf, math.inf]


def test_unreadable_lines_and_values():
  good = run_here("def f(x):\n  return x", [[1], [2]])
  assert harness.read_results(good, 2, "@@T@@") == [("ok", "1"), ("ok", "2")]
  assert harness.read_results(good, 3, "@@T@@") is None  # wrong count
  assert harness.read_results("nothing\n", 2, "@@T@@") is None
  assert harness.read_results("@@T@@[('ok', 1)]\n", 1, "@@T@@") is None  # not a repr string
  for bad in ("__import__('os')", "nan()", "x", "1 +"):
    with pytest.raises(ValueError, match="repr"):
      harness.literal(bad)
  with pytest.raises(ValueError, match="mark"):
    harness.function_program("def f(x): return x", [[1]], "two\nlines")
