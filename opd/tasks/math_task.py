"""Math: arithmetic and small algebra word problems with exact answers.

Response format: ``Answer: <number>`` as the last line (optionally after a
``<think>`` block or working lines); the number is an integer or a fraction
in any equivalent form (``6/4`` equals ``3/2``). Reward 1 iff the value is
exactly right; format reward 1 iff the answer line parses.

Difficulty:
  1. one-digit addition or subtraction, bare or as a one-step word problem
     (``Ann has 7 eggs and gets 5 more. How many eggs now?``).
  2. two-digit addition/subtraction, one-digit multiplication and exact
     division, two-step word problems.
  3. linear equations (``Solve for x: 3x - 4 = 11.``), sums and differences of
     fractions, a fraction of a number.
"""
from __future__ import annotations

import random
from fractions import Fraction

from opd.text import parsers
from opd.tasks.base import Draft, Example, Reward, Task, malformed
from opd.tasks.vocab import NAMES, OBJECTS


def _signed(b: int) -> str:
  """``+ 3`` or ``- 3`` for use after a term."""
  return f"+ {b}" if b >= 0 else f"- {-b}"


class MathTask(Task):
  domain = "math"

  def draft(self, rng: random.Random, difficulty: int) -> Draft:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    objs = obj + "s"
    kind = rng.randrange(2)
    if difficulty == 1:
      a, b = rng.randrange(10), rng.randrange(10)
      if rng.randrange(2):
        answer = a + b
        prompt = (f"What is {a} + {b}?" if kind else
                  f"{name} has {a} {objs} and gets {b} more. How many {objs} now?")
      else:
        a, b = max(a, b), min(a, b)
        answer = a - b
        prompt = (f"What is {a} - {b}?" if kind else
                  f"{name} has {a} {objs} and gives away {b}. How many are left?")
    elif difficulty == 2:
      form = rng.randrange(5)
      if form == 0:
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        answer, prompt = a + b, f"What is {a} + {b}?"
      elif form == 1:
        a, b = sorted((rng.randrange(10, 100), rng.randrange(10, 100)), reverse=True)
        answer, prompt = a - b, f"What is {a} - {b}?"
      elif form == 2:
        a, b = rng.randrange(2, 10), rng.randrange(2, 10)
        answer, prompt = a * b, f"What is {a} * {b}?"
      elif form == 3:
        q, b = rng.randrange(2, 10), rng.randrange(2, 10)
        answer, prompt = q, f"What is {q * b} / {b}?"
      else:
        a, b = rng.randrange(1, 20), rng.randrange(1, 10)
        c = rng.randrange(0, a + b + 1)
        answer = a + b - c
        prompt = f"{name} has {a} {objs}, gets {b}, then gives away {c}. How many now?"
    else:
      form = rng.randrange(3)
      if form == 0:
        a, x, b = rng.randrange(2, 10), rng.randrange(-9, 10), rng.randrange(-9, 10)
        answer = x
        prompt = f"Solve for x: {a}x {_signed(b)} = {a * x + b}."
      elif form == 1:
        p, q, r, s = (rng.randrange(1, 10), rng.randrange(2, 10), rng.randrange(1, 10),
                      rng.randrange(2, 10))
        op = rng.choice("+-")
        answer = Fraction(p, q) + Fraction(r, s) if op == "+" else Fraction(p, q) - Fraction(r, s)
        prompt = f"What is {p}/{q} {op} {r}/{s}?"
      else:
        p, q, n = rng.randrange(1, 10), rng.randrange(2, 10), rng.randrange(2, 50)
        answer = Fraction(p, q) * n
        prompt = f"What is {p}/{q} of {n}?"
    text = parsers.format_answer(answer)
    return Draft(prompt, (("assistant", text),), {"answer": parsers.format_number(answer)})

  def verify(self, example: Example, response: str) -> Reward:
    self.check_example(example)
    parsed = parsers.parse_final_answer(response)
    if not parsed.ok:
      return malformed(parsed.reason, correct=0.0)
    if parsed.value == Fraction(example.meta["answer"]):
      return Reward(1.0, 1.0, {"correct": 1.0}, "ok")
    return Reward(0.0, 1.0, {"correct": 0.0}, "wrong_answer")
