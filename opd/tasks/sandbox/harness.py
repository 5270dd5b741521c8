"""Calling an untrusted function ``f`` on many inputs in one sandbox run.

The one harness of the code task (``opd.tasks.code_task``) and GENCLUSTER
(``grm.gencluster.execution``). ``function_program`` appends it to the
program's text: it calls ``f(*args)`` for each input (one ``try`` per call,
so an exception costs that input only) and prints one marker line holding,
per input, ``("ok", repr(result))`` for a plain result (int, bool, str,
float, None, nested lists; repr under ``MAX_REPR`` characters) or
``("error", name)`` (the exception's class name, ``"bad_result"`` for any
other result). Harness names start with ``_`` and builtins are reached
through ``_b``, so the program's own top-level definitions cannot shadow them.

``read_results`` reads that line back. A float result that is not finite
(``nan``, ``inf``) is the program's own output for that input, read back as
that float (``literal``); how it compares is the caller's business (``nan``
equals nothing, so a code answer returning it fails that test and no other).
"""
from __future__ import annotations

import ast
from collections.abc import Sequence

MAX_REPR = 10000  # characters of one result's repr; longer is "bad_result"
_NON_FINITE = {"nan": float("nan"), "inf": float("inf")}
_HARNESS = """

import builtins as _b
def _plain(v, depth=0):
  if depth > 20:
    return False
  if _b.type(v) in (_b.int, _b.bool, _b.str, _b.float) or v is None:
    return True
  return _b.type(v) is _b.list and _b.all(_plain(x, depth + 1) for x in v)
_out = []
for _args in {inputs!r}:
  try:
    _r = f(*_args)
    _s = _b.repr(_r) if _plain(_r) else None
    _out.append(("ok", _s) if _s is not None and _b.len(_s) < {max_repr} else ("error", "bad_result"))
  except Exception as _e:
    _out.append(("error", _b.type(_e).__name__))
_b.print("\\n{mark}" + _b.repr(_out))
"""


def function_program(source: str, inputs: Sequence[Sequence], mark: str) -> str:
  """``source`` (defining ``f``) plus the harness calling ``f(*args)`` for each input."""
  if not isinstance(mark, str) or not mark or "\n" in mark:
    raise ValueError(f"mark must be a non-empty one-line str, got {mark!r}")
  return source + _HARNESS.format(inputs=[list(a) for a in inputs], mark=mark,
                                  max_repr=MAX_REPR)


def read_results(stdout: str, n_inputs: int, mark: str) -> list[tuple[str, str]] | None:
  """The ``(kind, text)`` pair per input of the last marker line in ``stdout``
  (``kind`` is ``"ok"`` or ``"error"``), or None when there is no such line or
  it does not hold exactly ``n_inputs`` such pairs."""
  line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(mark)), None)
  if line is None:
    return None
  try:
    raw = ast.literal_eval(line[len(mark):])
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return None
  if not isinstance(raw, list) or len(raw) != n_inputs:
    return None
  for item in raw:
    if not (isinstance(item, tuple) and len(item) == 2 and item[0] in ("ok", "error")
            and isinstance(item[1], str)):
      return None
  return raw


class _NonFinite(ast.NodeTransformer):
  def visit_Name(self, node: ast.Name):
    if node.id in _NON_FINITE:
      return ast.copy_location(ast.Constant(_NON_FINITE[node.id]), node)
    return node


def literal(text: str):
  """The value of a plain result's repr (``ast.literal_eval``, plus the
  ``nan`` and ``inf`` that ``repr`` writes for non-finite floats).

  Raises:
    ValueError: ``text`` is not such a repr.
  """
  try:
    tree = ast.parse(text, mode="eval")
    return ast.literal_eval(_NonFinite().visit(tree).body)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
    raise ValueError(f"text={text[:40]!r} is not a plain value's repr ({type(e).__name__})") \
        from None
