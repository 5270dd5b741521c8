"""Proof: short derivations, one step per line, checked step by step (docs/DESIGN.md §7, §9).

The toy proof domain of DeepSeekMath-V2 (arXiv 2511.22570) at byte-model
scale. Three problem kinds, each at difficulty 1..3:

  simplify   "Simplify 3*4+5 step by step."             (2, 3, 4 operations)
  equation   "Solve for x step by step: 3*x+4 = 19."     (x+b=c, a*x+b=c, a*(x+b)=c)
  identity   "Compute 7*8+7*2 by factoring."             (factoring, regrouping a sum
                                                          or a product)

**Derivation format** (what the reference writes and ``check_proof`` reads).
Non-empty lines, numbered 1, 2, ... (blank lines are ignored); the last one
is ``Answer: <number>``. Expression problems (simplify, identity) chain
expressions: a line is ``A = B`` or ``= B``; equation problems write one
equation in x per line::

  3*4+5 = 12+5          3*x = 19-4
  = 17                  3*x = 15
  Answer: 17            x = 15/3
                        x = 5
                        Answer: 5

Expressions use integers, ``x``, ``+ - * /`` and parentheses; a ``-`` right
before a number makes it negative (the grammar: ``opd.tasks.proof_expr``). A **step** goes from the current state
(initially the problem's expression or equation) to the next expression on a
line (both ``A`` and ``B`` of ``A = B``) or equation. It is *correct* when it
keeps the value (expression) or the unique solution (equation), and *one
step* when it removes at most one operation (binary operators, counted over
both sides of an equation); a rewrite that keeps the count (moving a term,
factoring) is one step.

**Checker** (the oracle). ``check_proof(example, text)`` returns the issues,
at most one per line, each ``(line, kind, message)`` with ``line`` 1-based:

  wrong_step    a step that changes the value / solution, or an equation
                line without a unique solution
  missing_step  a correct step that removes two or more operations (a
                skipped but correct step): the one *minor* kind
  wrong_final   the answer differs from the problem's true answer
  bad_line      a line that does not parse in the problem's format
  no_answer     the last line is not ``Answer: <number>`` (or the text
                has an unreadable thinking block); an answer line before
                the last line is a ``bad_line``

The answer line is itself a step from the last state: a wrong value is
``wrong_final``; a right value that does not follow from the last line is
``wrong_step``; a right one after a line that is not yet the final value (a
number, or ``x = <number>``) is ``missing_step``. Score 1 with
no issue, 0.5 when every issue is minor, else 0; ``verify`` returns it as the
reward (format 0 without a readable answer line).

**Corruptions** (``corrupt``) make proofs with known labels from a reference:
``wrong_step`` (an arithmetic slip at one step, carried through consistently:
issues wrong_step + wrong_final), ``missing_step`` (a line dropped where that
skips two operations, or the line before the answer: one missing_step, score
0.5), ``wrong_final`` (only the answer changed).
"""
from __future__ import annotations

import dataclasses
import random
from fractions import Fraction
from typing import Any

from opd.text import parsers
from opd.tasks.base import Draft, Example, Reward, Task, malformed
from opd.tasks.proof_expr import (X, Eq, ParseError, State, Tree, linear, num, parse_equation,
                                  parse_expr, render, render_state, size, value)

KINDS = ("simplify", "equation", "identity")
ISSUE_KINDS = ("wrong_step", "missing_step", "wrong_final", "bad_line", "no_answer")
MINOR_KINDS = ("missing_step",)
CORRUPTIONS = ("wrong_step", "missing_step", "wrong_final")
SCORES = (0.0, 0.5, 1.0)
ANSWER_PREFIX = parsers.ANSWER_PREFIX


# ----------------------------------------------------------------------------- reference steps
def _reduce_one(t: Tree) -> tuple[Tree, tuple[int, ...]] | None:
  """Evaluates the first operator (post-order) whose operands are numbers;
  returns the new tree and the path of the new leaf, or None for a leaf."""
  if t[0] in ("n", "x"):
    return None
  op, left, right = t
  if left[0] == "n" and right[0] == "n":
    _, v = linear(t)
    return num(v), ()
  for side, child in ((1, left), (2, right)):
    r = _reduce_one(child)
    if r is not None:
      new = list(t)
      new[side] = r[0]
      return tuple(new), (side,) + r[1]
  return None


def _add_at(t: Tree, path: tuple[int, ...], delta: int) -> Tree:
  if not path:
    return num(t[1] + delta)
  new = list(t)
  new[path[0]] = _add_at(t[path[0]], path[1:], delta)
  return tuple(new)


_INVERSE = {"+": "-", "-": "+"}


def _equation_step(eq: Eq) -> Eq | None:
  """The next reference step of the equation shapes this domain draws."""
  left, right = eq
  if right[0] != "n":
    return left, _reduce_one(right)[0]
  if left == X:
    return None
  op = left[0]
  if op in "+-" and left[1] == X:                       # x+b = c  ->  x = c-b
    return X, (_INVERSE[op], right, left[2])
  if op in "+-" and left[1][0] == "*":                  # a*x+b = c  ->  a*x = c-b
    return left[1], (_INVERSE[op], right, left[2])
  if op == "*" and left[2] == X:                        # a*x = c  ->  x = c/a
    return X, ("/", right, left[1])
  if op == "*":                                         # a*(x+b) = c  ->  x+b = c/a
    return left[2], ("/", right, left[1])
  raise ValueError(f"no reference step for {render_state(eq, 'equation')}")


def derive(kind: str, start: State, *, rewrite: State | None = None, slip_at: int | None = None,
           slip: int = 0) -> list[State]:
  """The reference states ``[start, s_1, ..., s_n]`` (``s_n`` a number or ``x = v``).

  ``rewrite`` is the identity problems' first step; ``slip_at=k`` adds
  ``slip`` (times the coefficient of x, for equations) to the number that
  step k computes, and the derivation carries on from the slipped state.
  """
  states = [start] + ([rewrite] if rewrite is not None else [])
  while True:
    cur = states[-1]
    k = len(states)
    if kind == "equation":
      nxt = _equation_step(cur)
      if nxt is None:
        return states
      if k == slip_at:
        if nxt[1][0] != "n":
          raise ValueError(f"step {k} computes no number")
        nxt = (nxt[0], num(nxt[1][1] + slip * linear(nxt[0])[0]))
    else:
      r = _reduce_one(cur)
      if r is None:
        return states
      nxt = r[0] if k != slip_at else _add_at(r[0], r[1], slip)
    states.append(nxt)


def _render_lines(kind: str, states: list[State]) -> list[str]:
  if kind == "equation":
    lines = [render_state(s, kind) for s in states[1:]]
  else:
    lines = [f"{render(states[0])} = {render(states[1])}"] + [f"= {render(s)}"
                                                                for s in states[2:]]
  return lines + [parsers.format_answer(value(states[-1], kind))]


def _integral(states: list[State], kind: str) -> bool:
  """Every number in every state a non-negative (expression) or any (equation) integer."""
  def ok(t):
    if t[0] == "n":
      return t[1].denominator == 1 and (kind == "equation" or t[1] >= 0) and abs(t[1]) < 1000
    return t[0] == "x" or (ok(t[1]) and ok(t[2]))
  return all(ok(s[0]) and ok(s[1]) if kind == "equation" else ok(s) for s in states)


# ----------------------------------------------------------------------------- checker
@dataclasses.dataclass(frozen=True)
class Issue:
  """One issue: ``line`` 1-based over the proof's non-empty lines."""
  line: int
  kind: str
  message: str = ""


@dataclasses.dataclass(frozen=True)
class ProofCheck:
  issues: tuple[Issue, ...]
  score: float

  @property
  def kinds(self) -> tuple[str, ...]:
    return tuple(i.kind for i in self.issues)


def proof_lines(text: str) -> list[str]:
  """The proof's non-empty lines, stripped (line k of an issue is ``proof_lines[k-1]``)."""
  return [line.strip() for line in text.split("\n") if line.strip()]


def score_of(issues) -> float:
  """1 with no issue, 0.5 when all issues are minor, else 0."""
  kinds = {i.kind for i in issues}
  return 1.0 if not kinds else 0.5 if kinds <= set(MINOR_KINDS) else 0.0


def check_derivation(kind: str, start: str, answer: str, text: Any) -> ProofCheck:
  """The step checker over a problem given by ``kind``, its start expression
  or equation text and its true answer (module docstring). Never raises on ``text``.

  Raises:
    ValueError: ``kind`` is not one of ``KINDS`` or ``start`` does not parse.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  true = Fraction(answer)
  state = parse_equation(start) if kind == "equation" else parse_expr(start)
  split = parsers.split_thinking(text)
  if not split.ok:
    return ProofCheck((Issue(1, "no_answer", f"unreadable: {split.reason}"),), 0.0)
  lines = proof_lines(split.body)
  if not lines:
    return ProofCheck((Issue(1, "no_answer", "empty proof"),), 0.0)
  issues = []
  last = parsers.parse_answer_body(lines[-1]) if lines[-1].startswith(ANSWER_PREFIX) else None
  body = lines if last is None else lines[:-1]
  for k, line in enumerate(body, start=1):
    try:
      if ANSWER_PREFIX in line:
        raise ParseError("an answer line before the last line")
      if kind == "equation":
        targets = [parse_equation(line)]
      else:
        sides = line.split("=")
        if len(sides) != 2 or not sides[1].strip():
          raise ParseError("an expression line is 'A = B' or '= B'")
        targets = ([parse_expr(sides[0])] if sides[0].strip() else []) + [parse_expr(sides[1])]
    except ParseError as e:
      issues.append(Issue(k, "bad_line", str(e)))
      continue
    worst = None
    for target in targets:
      before, after = value(state, kind), value(target, kind)
      if after is None or before != after:
        worst = "wrong_step"
      elif size(state, kind) - size(target, kind) >= 2 and worst is None:
        worst = "missing_step"
      state = target
    if worst is not None:
      issues.append(Issue(k, worst, _MESSAGES[worst]))
  n = len(lines)
  if last is None or not last.ok:
    issues.append(Issue(n, "no_answer", "the last line is not 'Answer: <number>'"))
  elif last.value != true:
    issues.append(Issue(n, "wrong_final", f"the answer is not {answer}"))
  elif value(state, kind) != last.value:
    issues.append(Issue(n, "wrong_step", "the answer does not follow from the last line"))
  elif size(state, kind) >= 1:
    issues.append(Issue(n, "missing_step", "the line before the answer is not the final value"))
  return ProofCheck(tuple(issues), score_of(issues))


_MESSAGES = {"wrong_step": "this step changes the value",
             "missing_step": "this step skips a step"}  # the checker's issue messages


def check_proof(example: Example, text: Any) -> ProofCheck:
  """``check_derivation`` for a proof-domain example."""
  _check_proof_example(example)
  m = example.meta
  return check_derivation(m["kind"], m["start"], m["answer"], text)


# ----------------------------------------------------------------------------- corruptions
def corrupt(example: Example, corruption: str, rng: random.Random) -> tuple[str, ProofCheck] | None:
  """A corrupted proof of ``example`` and the check it must get, or None when
  this example admits no such corruption (no slip keeps the numbers integer
  and changes the answer). See the module docstring for the three kinds."""
  if corruption not in CORRUPTIONS:
    raise ValueError(f"corruption must be one of {CORRUPTIONS}, got {corruption!r}")
  _check_proof_example(example)
  m = example.meta
  kind, start = m["kind"], _start_state(m)
  rewrite = parse_expr(m["rewrite"]) if m.get("rewrite") else None
  states = derive(kind, start, rewrite=rewrite)
  lines = _render_lines(kind, states)
  n_body = len(lines) - 1
  if corruption == "wrong_final":
    true = Fraction(m["answer"])
    wrong = true + rng.choice([d for d in range(-5, 6) if d])
    text = "\n".join(lines[:-1] + [parsers.format_answer(wrong)])
    return text, ProofCheck((Issue(n_body + 1, "wrong_final", ""),), 0.0)
  if corruption == "missing_step":
    # Line k (1-based) holds state k (and state 0 too on an expression's first line).
    # Dropping it makes the next line step from state k-1 to state k+1.
    # Dropping the last one makes the answer follow a line that is not the final value.
    cands = [k for k in range(1, n_body)
             if size(states[k - 1], kind) - size(states[k + 1], kind) >= 2] + [n_body]
    k = rng.choice(cands)
    kept = lines[:k - 1] + lines[k:]
    return "\n".join(kept), ProofCheck((Issue(k, "missing_step", ""),), 0.5)
  first = 2 if rewrite is not None else 1
  options = [(k, s) for k in range(first, len(states)) for s in (-3, -2, -1, 1, 2, 3)]
  rng.shuffle(options)
  for k, s in options:
    try:
      slipped = derive(kind, start, rewrite=rewrite, slip_at=k, slip=s)
    except ValueError:
      continue
    if (not _integral(slipped, kind) or len(slipped) != len(states)
        or value(slipped[-1], kind) == value(states[-1], kind)):
      continue
    text = "\n".join(_render_lines(kind, slipped))
    return text, ProofCheck((Issue(k, "wrong_step", ""), Issue(n_body + 1, "wrong_final", "")),
                            0.0)
  return None


def _check_proof_example(example: Any):
  if not isinstance(example, Example) or example.domain != "proof":
    raise ValueError(f"example must be a proof-domain Example, got "
                     f"{getattr(example, 'domain', type(example).__name__)!r}")


def _start_state(meta) -> State:
  return parse_equation(meta["start"]) if meta["kind"] == "equation" else parse_expr(meta["start"])


# ----------------------------------------------------------------------------- problems
def _random_tree(rng: random.Random, n_ops: int, hi: int, op_set: str) -> Tree:
  if n_ops == 0:
    return num(rng.randrange(1, hi + 1))
  left = rng.randrange(n_ops)
  return (rng.choice(op_set), _random_tree(rng, left, hi, op_set),
          _random_tree(rng, n_ops - 1 - left, hi, op_set))


def _draw(rng: random.Random, difficulty: int) -> tuple[str, str, State, State | None]:
  """``(kind, prompt, start, rewrite)`` of one problem whose reference is all integers."""
  kind = KINDS[rng.randrange(3)]
  while True:
    rewrite = None
    if kind == "simplify":
      start = _random_tree(rng, difficulty + 1, (9, 12, 12)[difficulty - 1],
                           ("+-*", "+-*/", "+-*/")[difficulty - 1])
      if difficulty == 3 and "(" not in render(start):
        continue
      prompt = f"Simplify {render(start)} step by step."
    elif kind == "equation":
      x, a, b = rng.randrange(-9, 10), rng.randrange(2, 10), rng.randrange(1, 20)
      op = rng.choice("+-")
      inner = (op, X, num(b)) if difficulty != 2 else (op, ("*", num(a), X), num(b))
      left = inner if difficulty == 1 else ("*", num(a), inner) if difficulty == 3 else inner
      start = (left, num(linear(left)[0] * x + linear(left)[1]))
      prompt = f"Solve for x step by step: {render_state(start, kind)}."
    else:
      form = rng.randrange(2) if difficulty < 3 else 2
      hi = (9, 50, 30)[difficulty - 1]
      if form == 0 or form == 2:     # a*b+a*c = a*(b+c)   (a*b-a*c at difficulty 3)
        a, b, c = rng.randrange(2, 10), rng.randrange(1, hi), rng.randrange(1, hi)
        op = "+" if form == 0 else "-"
        start = (op, ("*", num(a), num(b)), ("*", num(a), num(c)))
        rewrite = ("*", num(a), (op, num(b), num(c)))
        how = f"by factoring out {a}"
      else:                          # a+b+c = a+c+b (or a*b*c = a*c*b), a+c (a*c) round
        op = rng.choice("+*")
        if op == "+":
          a, b = rng.randrange(1, hi), rng.randrange(2, hi)
          c = 10 - a % 10
        else:
          a, b, c = rng.choice([2, 4, 6, 8]), rng.randrange(2, 10), rng.choice([5, 25])
        start = (op, (op, num(a), num(b)), num(c))
        rewrite = (op, (op, num(a), num(c)), num(b))
        how = f"by combining {a} and {c} first"
      prompt = f"Compute {render(start)} {how}."
    try:
      states = derive(kind, start, rewrite=rewrite)
    except ParseError:   # a division by zero drawn
      continue
    if _integral(states, kind) and value(states[0], kind) is not None:
      return kind, prompt, start, rewrite


class ProofTask(Task):
  """Short derivations with a rule-based step checker (module docstring)."""

  domain = "proof"

  def draft(self, rng: random.Random, difficulty: int) -> Draft:
    kind, prompt, start, rewrite = _draw(rng, difficulty)
    states = derive(kind, start, rewrite=rewrite)
    text = "\n".join(_render_lines(kind, states))
    meta = {"kind": kind, "start": render_state(start, kind),
            "answer": parsers.format_number(value(states[0], kind)),
            "rewrite": render(rewrite) if rewrite is not None else ""}
    return Draft(prompt, (("assistant", text),), meta)

  def verify(self, example: Example, response: Any) -> Reward:
    """Reward = the checker's score; format 0 without a readable answer line."""
    self.check_example(example)
    parsed = parsers.parse_final_answer(response)
    if not parsed.ok:
      return malformed(parsed.reason, score=0.0)
    check = check_proof(example, response)
    reason = "ok" if not check.issues else "issues:" + ",".join(sorted(set(check.kinds)))
    return Reward(check.score, 1.0, {"score": check.score}, reason)
