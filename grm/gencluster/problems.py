"""GENCLUSTER problems: one code-domain function spec, three subtasks of growing input range.

docs/DESIGN.md §7 (GENCLUSTER), §9 (code domain). A code-domain example asks
for ``f`` of one integer, two integers, or one list of integers. The problem
built from it keeps the prompt and splits the hidden tests into subtasks of
increasing difficulty, the way an olympiad problem's subtasks widen the
constraints:

  level 1 "small":  integers in [0, 9];        lists of 1-3 items in [0, 9]
  level 2 "task":   integers in [-20, 20];     lists of 1-6 items in [-9, 9]
                    (the code domain's own range)
  level 3 "wide":   integers in [-1000, 1000]; lists of 1-12 items in [-100, 100],
                    hidden tests always include the edge values (bounds, 0, -1, 1)

A program that is only right for non-negative inputs (``x%4`` for
"x mod 4" is, ``abs(x)%4`` is not) solves level 1 and fails level 2; one
right only near zero fails level 3. The hidden tests' expected outputs are
the reference program's outputs, run in the sandbox with the candidates;
``check_reference`` first checks that the reference reproduces the
generator's own expected outputs (``example.meta["tests"]``), so the
oracle rests on the task's callables, not on the reference text alone.

Also here: the subtask constraints as a rule-based validator
(``rule_accepts``), the seeded random input generator built from the
problem's signature (the fallback when the model's generators fail), and
the prompts that ask the policy for a candidate, a generator or a validator.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from opd.tasks.base import Example

# (int_lo, int_hi, len_lo, len_hi, item_lo, item_hi) per level.
LEVELS = ((0, 9, 1, 3, 0, 9), (-20, 20, 1, 6, -9, 9), (-1000, 1000, 1, 12, -100, 100))
LEVEL_NAMES = ("small", "task", "wide")
_NAMES = {1: ("x",), 2: ("x", "y")}


@dataclasses.dataclass(frozen=True)
class Subtask:
  """One subtask: ``level`` 1 (easiest) to 3; ``hidden`` argument lists."""
  level: int
  kinds: tuple[str, ...]          # "int" or "list" per argument
  hidden: tuple[tuple, ...]       # hidden test inputs, each a tuple of arguments

  @property
  def bounds(self) -> tuple[int, ...]:
    return LEVELS[self.level - 1]

  @property
  def constraints(self) -> str:
    """The constraints in words (the generator and validator prompts)."""
    lo, hi, n_lo, n_hi, i_lo, i_hi = self.bounds
    names = arg_names(self.kinds)
    return "; ".join(
        f"{n} is a list of {n_lo} to {n_hi} integers from {i_lo} to {i_hi}" if k == "list"
        else f"{n} is an integer from {lo} to {hi}" for n, k in zip(names, self.kinds))


@dataclasses.dataclass(frozen=True)
class Problem:
  """A function spec with subtasks (``subtasks[0]`` easiest). ``reference``: the task's text."""
  id: str
  prompt: str
  difficulty: int
  kinds: tuple[str, ...]
  reference: str
  tests: tuple[tuple, ...]        # the code task's own (args, expected) pairs
  subtasks: tuple[Subtask, ...]

  @property
  def n_args(self) -> int:
    return len(self.kinds)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "Problem":
    subs = tuple(Subtask(s["level"], tuple(s["kinds"]), tuple(_tuple_args(a) for a in s["hidden"]))
                 for s in d["subtasks"])
    return cls(d["id"], d["prompt"], d["difficulty"], tuple(d["kinds"]), d["reference"],
               tuple((_tuple_args(a), e) for a, e in d["tests"]), subs)


def _tuple_args(args) -> tuple:
  return tuple(args)


def arg_names(kinds: Sequence[str]) -> tuple[str, ...]:
  return ("xs",) if tuple(kinds) == ("list",) else _NAMES[len(kinds)]


def _kinds(example: Example) -> tuple[str, ...]:
  args = example.meta["tests"][0][0]
  return tuple("list" if isinstance(a, list) else "int" for a in args)


def random_args(kinds: Sequence[str], level: int, rng: random.Random) -> tuple:
  """One input of the subtask's constraints, drawn from ``rng``."""
  lo, hi, n_lo, n_hi, i_lo, i_hi = LEVELS[level - 1]
  return tuple([rng.randint(i_lo, i_hi) for _ in range(rng.randint(n_lo, n_hi))] if k == "list"
               else rng.randint(lo, hi) for k in kinds)


def _edges(kinds: Sequence[str], level: int) -> list[tuple]:
  """Edge inputs: every argument at a bound or at -1, 0, 1 (those in range)."""
  lo, hi, n_lo, n_hi, i_lo, i_hi = LEVELS[level - 1]
  ints = [v for v in (lo, hi, 0, -1, 1) if lo <= v <= hi]
  lists = [[i_lo] * n_lo, [i_hi] * n_hi, [0] * n_lo, [i_lo, i_hi][:max(n_lo, min(2, n_hi))]]
  values = {"int": ints, "list": lists}
  return [tuple(values[k][j % len(values[k])] for k in kinds)
          for j in range(max(len(values[k]) for k in kinds))]


def make_problem(example: Example, *, n_hidden: int, seed: int) -> Problem:
  """The three-subtask problem of a code-domain example (module docstring).

  Args:
    example: a ``code`` example (``meta["tests"]`` gives the signature).
    n_hidden: random hidden inputs per subtask (level 3 adds the edge inputs).
    seed: seeds the hidden inputs (with the example id).
  """
  if example.domain != "code":
    raise ValueError(f"example.domain={example.domain!r}: GENCLUSTER problems come from 'code'")
  if isinstance(n_hidden, bool) or not isinstance(n_hidden, int) or n_hidden < 1:
    raise ValueError(f"n_hidden={n_hidden!r} must be an int >= 1")
  kinds = _kinds(example)
  subtasks = []
  for level in (1, 2, 3):
    rng = random.Random(f"gencluster/hidden/{seed}/{example.id}/{level}")
    hidden = [random_args(kinds, level, rng) for _ in range(n_hidden)]
    if level == 3:
      hidden = _edges(kinds, level) + hidden
    subtasks.append(Subtask(level, kinds, tuple(_dedup(hidden))))
  return Problem(example.id, example.prompt, example.difficulty, kinds,
                 example.reference[-1][1], tuple((tuple(a), e) for a, e in example.meta["tests"]),
                 tuple(subtasks))


def _dedup(inputs: Sequence[tuple]) -> list[tuple]:
  seen, out = set(), []
  for args in inputs:
    key = repr(args)
    if key not in seen:
      seen.add(key)
      out.append(args)
  return out


def fallback_inputs(subtask: Subtask, n: int, seed) -> list[tuple]:
  """The seeded random generator from the problem's signature: ``n`` inputs."""
  rng = random.Random(f"gencluster/fallback/{seed}")
  return [random_args(subtask.kinds, subtask.level, rng) for _ in range(n)]


def _is_int(v: Any) -> bool:
  return type(v) is int  # bool is not an int input


def rule_accepts(subtask: Subtask, args: Any) -> bool:
  """The rule-based validator: ``args`` is a tuple/list of the subtask's
  argument kinds, each inside the subtask's bounds."""
  lo, hi, n_lo, n_hi, i_lo, i_hi = subtask.bounds
  if not isinstance(args, (tuple, list)) or len(args) != len(subtask.kinds):
    return False
  for v, k in zip(args, subtask.kinds):
    if k == "int" and not (_is_int(v) and lo <= v <= hi):
      return False
    if k == "list" and not (type(v) is list and n_lo <= len(v) <= n_hi
                            and all(_is_int(x) and i_lo <= x <= i_hi for x in v)):
      return False
  return True


def as_args(value: Any, n_args: int) -> tuple:
  """A generator's value as an argument tuple: the value itself for one
  argument, else the value's items when it is a list/tuple of ``n_args``
  (anything else is kept as one argument; validators reject the wrong arity)."""
  if n_args > 1 and isinstance(value, (list, tuple)) and len(value) == n_args:
    return tuple(value)
  return (value,)


def candidate_prompt(problem: Problem) -> str:
  """The candidate prompt is the code task's prompt (what the policy was trained on)."""
  return problem.prompt


def generator_prompt(problem: Problem, subtask: Subtask) -> str:
  """Asks for ``f(i)`` returning test input number ``i`` (a list when f takes several)."""
  sig = ", ".join(arg_names(problem.kinds))
  what = "the input" if problem.n_args == 1 else f"the inputs as a list [{sig}]"
  return (f"Write f(i) that returns {what} of test number i for this task: {problem.prompt} "
          f"Constraints: {subtask.constraints}.")


def validator_prompt(problem: Problem, subtask: Subtask) -> str:
  """Asks for ``f(<args>)`` returning True iff the input meets the constraints."""
  sig = ", ".join(arg_names(problem.kinds))
  return (f"Write f({sig}) that returns True if the input is valid and False otherwise, for "
          f"this task: {problem.prompt} Constraints: {subtask.constraints}.")
