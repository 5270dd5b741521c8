"""Math verifier against answers recomputed here from the prompt text alone."""
import re
from fractions import Fraction

import pytest

from opd.tasks import DIFFICULTIES, get_task

_PATTERNS = [
    (r"What is (\d+) \+ (\d+)\?", lambda a, b: Fraction(a) + b),
    (r"What is (\d+) - (\d+)\?", lambda a, b: Fraction(a) - b),
    (r"What is (\d+) \* (\d+)\?", lambda a, b: Fraction(a) * b),
    (r"What is (\d+) / (\d+)\?", lambda a, b: Fraction(a, b)),
    (r"\w+ has (\d+) \w+ and gets (\d+) more\. How many \w+ now\?", lambda a, b: Fraction(a) + b),
    (r"\w+ has (\d+) \w+ and gives away (\d+)\. How many are left\?", lambda a, b: Fraction(a) - b),
    (r"\w+ has (\d+) \w+, gets (\d+), then gives away (\d+)\. How many now\?",
     lambda a, b, c: Fraction(a) + b - c),
    (r"Solve for x: (\d+)x ([+-]) (\d+) = (-?\d+)\.",
     lambda a, s, b, c: (Fraction(c) - (b if s == "+" else -b)) / a),
    (r"What is (\d+)/(\d+) ([+-]) (\d+)/(\d+)\?",
     lambda p, q, s, r, t: Fraction(p, q) + (1 if s == "+" else -1) * Fraction(r, t)),
    (r"What is (\d+)/(\d+) of (\d+)\?", lambda p, q, n: Fraction(p, q) * n),
]


def solve(prompt: str) -> Fraction:
  for pattern, fn in _PATTERNS:
    m = re.fullmatch(pattern, prompt)
    if m:
      return fn(*(g if g in "+-" else int(g) for g in m.groups()))
  raise AssertionError(f"no pattern for prompt {prompt!r}")


def as_text(value: Fraction) -> str:
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_verifier_matches_independent_answers(difficulty):
  task = get_task("math")
  for example in task.examples("test", 60, seed=2, difficulty=difficulty):
    answer = solve(example.prompt)
    right = task.verify(example, f"Answer: {as_text(answer)}")
    assert (right.reward, right.format, right.reason) == (1.0, 1.0, "ok"), example.prompt
    # An unreduced but equal fraction, with thinking and working, is still right.
    doubled = f"{answer.numerator * 2}/{answer.denominator * 2}"
    assert task.verify(example, f"<think>work</think>So:\nAnswer: {doubled}").reward == 1.0
    wrong = task.verify(example, f"Answer: {as_text(answer + 1)}")
    assert (wrong.reward, wrong.format, wrong.reason) == (0.0, 1.0, "wrong_answer")
    assert task.verify(example, example.reference_text).reward == 1.0


def test_malformed_answers_get_zero_format():
  task = get_task("math")
  example = task.examples("train", 1)[0]
  answer = as_text(solve(example.prompt))
  for response in (answer, f"The answer is {answer}", f"Answer: {answer}\nAnswer: {answer}",
                   f"<think>Answer: {answer}", "", f"Answer: {answer}<|end|>"):
    r = task.verify(example, response)
    assert (r.reward, r.format) == (0.0, 0.0) and r.category == "malformed", response
