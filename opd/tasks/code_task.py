"""Code: write a short Python function, checked by running it in the sandbox.

The language is Python, restricted to what a tiny model can learn: a single
``def f(...): return <expression>`` line (any valid Python function is
accepted; the top level may hold only function definitions). The prompt
describes the function in words; the verifier runs the response together
with the sandbox's function harness (``opd.tasks.sandbox.harness``) in ONE
``opd.tasks.sandbox.api`` run that calls ``f`` on every hidden input (embedded as a
literal; results printed as one literal line) and compares the results with the
hidden expected outputs, which the generator computed with its own Python
callables, never from the reference text. A result that equals nothing (an
exception, a non-plain value, ``nan``) fails its own test only.

Reward: the fraction of hidden tests passed (so near-misses such as a
conditional with one right branch get partial credit). Format reward: 1 iff
the response parses and defines ``f`` with the right number of parameters.

Difficulty:
  1. ``f(x)``: linear / modular / squared expressions of one integer
     (``Write f(x) that returns x times 3 plus 2.`` -> ``def f(x): return x*3+2``).
  2. ``f(x, y)`` arithmetic, min/max, and conditionals on parity or a threshold.
  3. ``f(xs)`` over a list of integers: sums, counts, filters, maps, slices.
"""
from __future__ import annotations

import concurrent.futures
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

from opd.text import parsers
from opd.tasks.sandbox.api import (KERNEL_ISOLATION, IsolationUnavailable, Sandbox,
                                   SandboxLimits, SandboxResult)
from opd.tasks.sandbox.batch import run_python_batch
from opd.tasks.sandbox.harness import function_program, literal, read_results
from opd.tasks.base import Draft, Example, Reward, Task, check_batch, malformed

N_TESTS = 6
_RESULT_MARK = "@@RESULTS@@"


class SandboxFailure(RuntimeError):
  """The sandbox itself failed (not the program): an infrastructure error."""


def _templates_1(a: int, b: int) -> list[tuple[str, str, Callable]]:
  return [
      (f"x plus {a}", f"x+{a}", lambda x: x + a),
      (f"x minus {a}", f"x-{a}", lambda x: x - a),
      (f"x times {a}", f"x*{a}", lambda x: x * a),
      (f"x times {a} plus {b}", f"x*{a}+{b}", lambda x: x * a + b),
      (f"x times {a} minus {b}", f"x*{a}-{b}", lambda x: x * a - b),
      (f"x plus {a}, times {b}", f"(x+{a})*{b}", lambda x: (x + a) * b),
      (f"x squared plus {a}", f"x*x+{a}", lambda x: x * x + a),
      (f"x mod {a + 1}", f"x%{a + 1}", lambda x: x % (a + 1)),
      (f"x divided by {a + 1}, rounded down", f"x//{a + 1}", lambda x: x // (a + 1)),
  ]


def _templates_2(a: int, b: int) -> list[tuple[str, str, Callable]]:
  return [
      ("x plus y", "x+y", lambda x, y: x + y),
      ("x times y", "x*y", lambda x, y: x * y),
      (f"x minus y times {a}", f"x-y*{a}", lambda x, y: x - y * a),
      (f"x times {a} plus y", f"x*{a}+y", lambda x, y: x * a + y),
      ("the larger of x and y", "max(x,y)", lambda x, y: max(x, y)),
      ("the smaller of x and y", "min(x,y)", lambda x, y: min(x, y)),
      (f"x times {a} if x is even, else x plus {b}", f"x*{a} if x%2==0 else x+{b}",
       lambda x, y: x * a if x % 2 == 0 else x + b),
      (f"x if x is above {a}, else y", f"x if x>{a} else y", lambda x, y: x if x > a else y),
  ]


def _templates_3(a: int, b: int) -> list[tuple[str, str, Callable]]:
  return [
      ("the sum of xs", "sum(xs)", sum),
      (f"the sum of xs times {a}", f"sum(xs)*{a}", lambda xs: sum(xs) * a),
      (f"the largest item of xs plus {a}", f"max(xs)+{a}", lambda xs: max(xs) + a),
      (f"the count of items of xs above {a}", f"len([v for v in xs if v>{a}])",
       lambda xs: len([v for v in xs if v > a])),
      ("the sum of the even items of xs", "sum(v for v in xs if v%2==0)",
       lambda xs: sum(v for v in xs if v % 2 == 0)),
      (f"xs with each item times {a}", f"[v*{a} for v in xs]", lambda xs: [v * a for v in xs]),
      (f"the first {b} items of xs", f"xs[:{b}]", lambda xs: xs[:b]),
      ("xs reversed", "xs[::-1]", lambda xs: xs[::-1]),
  ]


_SIGNATURES = {1: "x", 2: "x, y", 3: "xs"}
_TEMPLATES = {1: _templates_1, 2: _templates_2, 3: _templates_3}


def _same(a: Any, b: Any) -> bool:
  """Equality that also requires equal types (``True`` is not ``1``)."""
  if type(a) is not type(b):
    return False
  if isinstance(a, list):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  return a == b


def _passes(text: str, expected: Any) -> bool:
  """Whether a result's repr reads back as ``expected`` (``_same``)."""
  try:
    return _same(literal(text), expected)
  except ValueError:
    return False


class CodeTask(Task):
  domain = "code"
  # Model-written programs need kernel-enforced file-system, network and
  # process isolation (docs/DESIGN.md §7); see opd.tasks.sandbox.api.
  required_isolation = KERNEL_ISOLATION

  def __init__(self, sandbox: Sandbox | None = None, *, workers: int = 2,
               allow_weak_isolation: bool = False):
    """Creates the task.

    Args:
      sandbox: runs the programs (default: a ``Sandbox`` created on first use,
        "auto" isolation, 1 s CPU, 2 s wall, requiring ``required_isolation``).
      workers: concurrent (batched) sandbox runs in ``verify_batch``.
      allow_weak_isolation: explicit, logged opt-in to a sandbox without
        ``required_isolation`` (e.g. "rlimits" where namespaces are missing).

    Raises:
      IsolationUnavailable: ``sandbox`` (here) or the default sandbox (on
        first use) lacks ``required_isolation`` and ``allow_weak_isolation``
        is False; the message names what is missing and how to get it.
    """
    if not isinstance(workers, int) or workers < 1:
      raise ValueError(f"workers must be a positive int, got {workers!r}")
    self.allow_weak_isolation = bool(allow_weak_isolation)
    if isinstance(sandbox, Sandbox):
      missing = [r for r in self.required_isolation if r not in sandbox.provides]
      if missing:
        message = (f"CodeTask needs kernel-enforced {', '.join(missing)} isolation, which "
                   f"isolation={sandbox.isolation!r} does not give; build the Sandbox with a "
                   "namespaces level (see opd.tasks.sandbox.api) or pass "
                   "allow_weak_isolation=True")
        if not self.allow_weak_isolation:
          raise IsolationUnavailable(message)
        logging.getLogger(__name__).warning("allow_weak_isolation=True: %s", message)
    self._sandbox = sandbox
    self.workers = workers

  @property
  def sandbox(self) -> Sandbox:
    if self._sandbox is None:
      self._sandbox = Sandbox(SandboxLimits(cpu_s=1.0, wall_s=2.0),
                              require=self.required_isolation,
                              allow_weaker=self.allow_weak_isolation)
    return self._sandbox

  def draft(self, rng: random.Random, difficulty: int) -> Draft:
    a, b = rng.randrange(1, 13), rng.randrange(1, 13)
    desc, expr, fn = rng.choice(_TEMPLATES[difficulty](a, b))
    sig = _SIGNATURES[difficulty]
    verb = rng.choice(("Write f({sig}) that returns", "Define f({sig}) to return"))
    prompt = f"{verb.format(sig=sig)} {desc}."
    tests = []
    for _ in range(N_TESTS):
      if difficulty == 1:
        args = [rng.randrange(-20, 21)]
      elif difficulty == 2:
        args = [rng.randrange(-20, 21), rng.randrange(-20, 21)]
      else:
        args = [[rng.randrange(-9, 10) for _ in range(rng.randrange(1, 7))]]
      tests.append([args, fn(*args)])
    reference = f"def f({sig}): return {expr}"
    return Draft(prompt, (("assistant", reference),), {"n_args": len(sig.split(",")),
                                                        "tests": tests})

  def _program(self, example: Example, response: str) -> str | Reward:
    """The program to run for ``response`` (its function + the harness), or
    the malformed-response reward when it defines no usable ``f``."""
    self.check_example(example)
    code = parsers.extract_python_function(response, "f", example.meta["n_args"])
    if not code.ok:
      return malformed(code.reason, passed=0.0)
    return function_program(code.source, [args for args, _ in example.meta["tests"]],
                            _RESULT_MARK)

  def _score(self, example: Example, result: SandboxResult) -> Reward:
    """The reward of one sandbox run of ``_program``'s text."""
    tests = example.meta["tests"]
    if result.infrastructure_error:
      raise SandboxFailure(result.reason)
    if not result.ok:
      return Reward(0.0, 1.0, {"passed": 0.0}, f"sandbox:{result.reason}")
    outputs = read_results(result.stdout, len(tests), _RESULT_MARK)
    if outputs is None:
      return Reward(0.0, 1.0, {"passed": 0.0}, "sandbox:unreadable_results")
    passed = sum(kind == "ok" and _passes(text, expected)
                 for (kind, text), (_, expected) in zip(outputs, tests))
    frac = passed / len(tests)
    reason = "ok" if passed == len(tests) else f"partial:{passed}/{len(tests)}"
    return Reward(frac, 1.0, {"passed": frac}, reason)

  def verify(self, example: Example, response: str) -> Reward:
    program = self._program(example, response)
    if isinstance(program, Reward):
      return program
    return self._score(example, self.sandbox.run_python(program))

  def verify_batch(self, examples: Sequence[Example], responses: Sequence[str]) -> list[Reward]:
    """``verify`` of each pair. The programs run in ``workers`` concurrent
    batched sandbox runs (``opd.tasks.sandbox.batch``: one set-up per batch,
    each program still alone in its own process, uid and work directory, and
    the result a single run would give)."""
    check_batch(examples, responses)
    programs = [self._program(e, r) for e, r in zip(examples, responses)]
    todo = [i for i, p in enumerate(programs) if not isinstance(p, Reward)]
    sandbox = self.sandbox if todo else None  # created on first use, as in verify
    if isinstance(sandbox, Sandbox):
      run = lambda idx: run_python_batch(sandbox, [programs[i] for i in idx])  # noqa: E731
    else:  # any object with run_python (tests, custom sandboxes)
      run = lambda idx: [sandbox.run_python(programs[i]) for i in idx]  # noqa: E731
    chunks = [todo[w::self.workers] for w in range(min(self.workers, len(todo)))]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(chunks))) as pool:
      for idx, results in zip(chunks, pool.map(run, chunks)):
        for i, result in zip(idx, results):
          programs[i] = result
    return [p if isinstance(p, Reward) else self._score(e, p) for e, p in zip(examples, programs)]
