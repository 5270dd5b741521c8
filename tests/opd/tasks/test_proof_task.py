"""opd.tasks.proof_task: the step checker on hand-built derivations, references and corruptions."""
import random
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from opd.tasks import ALL_DOMAINS, DIFFICULTIES, EXTRA_DOMAINS, Example, get_task, split_of
from opd.tasks.proof_expr import num, parse_expr, render
from opd.tasks.proof_task import (CORRUPTIONS, ISSUE_KINDS, check_derivation, check_proof,
                                  corrupt, proof_lines)

TASK = get_task("proof")


def _example(kind, start, answer):
  return Example("proof", "hand", "train", 1, "p", (("assistant", ""),),
                 {"kind": kind, "start": start, "answer": answer, "rewrite": ""})


def _issues(check):
  return [(i.line, i.kind) for i in check.issues]


SIMPLIFY = _example("simplify", "3*4+5", "17")
EQUATION = _example("equation", "3*x+4 = 19", "5")

# Each case: proof text, expected (line, kind) issues and score, with why.
CASES = [
    # The reference shape: one operation per line, the answer restates the last value.
    (SIMPLIFY, "3*4+5 = 12+5\n= 17\nAnswer: 17", [], 1.0),
    # Blank lines are ignored (line numbers count non-empty lines); thinking is allowed.
    (SIMPLIFY, "<think>12 first</think>3*4+5 = 12+5\n\n= 17\n\nAnswer: 17", [], 1.0),
    # 12+5 -> 18 changes the value; the answer 18 is not 17.
    (SIMPLIFY, "3*4+5 = 12+5\n= 18\nAnswer: 18", [(2, "wrong_step"), (3, "wrong_final")], 0.0),
    # 3*4+5 (2 operations) -> 17 (0) in one line: skipped but correct, the minor kind.
    (SIMPLIFY, "3*4+5 = 17\nAnswer: 17", [(1, "missing_step")], 0.5),
    # The answer follows 12+5, not yet the final value: a skipped step.
    (SIMPLIFY, "3*4+5 = 12+5\nAnswer: 17", [(2, "missing_step")], 0.5),
    # A bare answer skips everything.
    (SIMPLIFY, "Answer: 17", [(1, "missing_step")], 0.5),
    # Only the answer is wrong.
    (SIMPLIFY, "3*4+5 = 12+5\n= 17\nAnswer: 16", [(3, "wrong_final")], 0.0),
    # The right answer after a wrong line does not follow from it.
    (SIMPLIFY, "3*4+5 = 12+5\n= 18\nAnswer: 17", [(2, "wrong_step"), (3, "wrong_step")], 0.0),
    # Restating the problem wrongly (3*4+6 is 18) is a wrong step; then consistent.
    (SIMPLIFY, "3*4+6 = 12+6\n= 18\nAnswer: 18", [(1, "wrong_step"), (3, "wrong_final")], 0.0),
    # A line that does not parse; the next line steps from the state before it.
    (SIMPLIFY, "3*4+5 = 12+5\n= twelve\n= 17\nAnswer: 17", [(2, "bad_line")], 0.0),
    (SIMPLIFY, "3*4+5 = 12+5\n= 17 = 17\nAnswer: 17", [(2, "bad_line"), (3, "missing_step")], 0.0),
    # No answer line; an answer line before the last line.
    (SIMPLIFY, "3*4+5 = 12+5\n= 17", [(2, "no_answer")], 0.0),
    (SIMPLIFY, "Answer: 17\n3*4+5 = 12+5\n= 17", [(1, "bad_line"), (3, "no_answer")], 0.0),
    (SIMPLIFY, "", [(1, "no_answer")], 0.0),
    (SIMPLIFY, "<think>never closed", [(1, "no_answer")], 0.0),
    # Equations: same solution and at most one operation removed per line.
    (EQUATION, "3*x = 19-4\n3*x = 15\nx = 15/3\nx = 5\nAnswer: 5", [], 1.0),
    (EQUATION, "3*x = 15\nx = 5\nAnswer: 5", [], 1.0),  # each line removes one operation
    (EQUATION, "x = 5\nAnswer: 5", [(1, "missing_step")], 0.5),  # 2 operations at once
    # 19+4 is a sign slip (x = 23/3), carried through to a wrong answer.
    (EQUATION, "3*x = 19+4\n3*x = 23\nx = 23/3\nAnswer: 23/3",
     [(1, "wrong_step"), (4, "wrong_final")], 0.0),
    # No unique solution, a non-linear line and an expression line in an equation proof.
    (EQUATION, "0*x = 0\nx = 5\nAnswer: 5", [(1, "wrong_step"), (2, "wrong_step")], 0.0),
    (EQUATION, "x*x = 25\nx = 5\nAnswer: 5", [(1, "wrong_step"), (2, "wrong_step")], 0.0),
    (EQUATION, "3*x = 15\n= 15\nx = 5\nAnswer: 5", [(2, "bad_line")], 0.0),
    (EQUATION, "3*x = 15\nx = 5/0\nAnswer: 5", [(2, "wrong_step"), (3, "wrong_step")], 0.0),
]


@pytest.mark.parametrize("example,text,issues,score", CASES)
def test_checker_on_hand_built_derivations(example, text, issues, score):
  check = check_proof(example, text)
  assert (_issues(check), check.score) == (issues, score), check
  reward = TASK.verify(example, text)
  assert reward.reward == score


def _solve_independently(meta) -> Fraction:
  """The true answer by Python's own arithmetic on the start text (not the task's parser)."""
  frac = lambda s: re.sub(r"(\d+)", r"Fraction(\1)", s)
  if meta["kind"] != "equation":
    return eval(frac(meta["start"]), {"Fraction": Fraction})
  left, right = meta["start"].split("=")
  f = lambda x: eval(frac(left), {"Fraction": Fraction, "x": x}) - eval(
      frac(right), {"Fraction": Fraction, "x": x})
  # f is linear: f(x) = f(0) + (f(1) - f(0)) x.
  return -f(Fraction(0)) / (f(Fraction(1)) - f(Fraction(0)))


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_references_are_clean_and_corruptions_get_their_labels(difficulty):
  examples = TASK.examples("train", 40, seed=3, difficulty=difficulty)
  kinds = set()
  for e in examples:
    kinds.add(e.meta["kind"])
    assert Fraction(e.meta["answer"]) == _solve_independently(e.meta), e.prompt
    ref = e.reference_text
    assert proof_lines(ref)[-1] == f"Answer: {e.meta['answer']}"
    assert check_proof(e, ref).issues == () and TASK.verify(e, ref).reward == 1.0
    rng = random.Random(e.id)
    for corruption in CORRUPTIONS:
      made = corrupt(e, corruption, rng)
      assert made is not None, (corruption, ref)   # every drawn problem admits all three
      text, want = made
      assert text != ref
      got = check_proof(e, text)
      assert (_issues(got), got.score) == (_issues(want), want.score), (ref, text)
      if corruption == "missing_step":   # one line fewer, same answer
        assert len(proof_lines(text)) == len(proof_lines(ref)) - 1
        assert proof_lines(text)[-1] == proof_lines(ref)[-1]
      else:                              # the written answer is not the true one
        assert proof_lines(text)[-1] != proof_lines(ref)[-1]
  assert kinds == {"simplify", "equation", "identity"}


def test_registered_outside_the_five_domains_with_leak_free_splits():
  assert "proof" in EXTRA_DOMAINS and "proof" not in ALL_DOMAINS
  for split in ("train", "test"):
    examples = TASK.examples(split, 30, seed=1, difficulty=2)
    assert all(split_of("proof", e.prompt) == split == e.split for e in examples)
  again = get_task("proof").examples("test", 30, seed=1, difficulty=2)
  assert [e.to_json() for e in again] == [e.to_json() for e in TASK.examples("test", 30, seed=1,
                                                                              difficulty=2)]


def test_verify_scores_malformed_responses_zero():
  e = TASK.examples("train", 1)[0]
  for response in ("", "no answer here", e.reference_text + "<|end|>", None):
    r = TASK.verify(e, response)
    assert (r.reward, r.format, r.category) == (0.0, 0.0, "malformed")
  math = get_task("math").examples("train", 1)[0]
  with pytest.raises(ValueError, match="math"):
    TASK.verify(math, "Answer: 1")
  with pytest.raises(ValueError, match="proof-domain Example, got 'math'"):
    check_proof(math, "Answer: 1")
  with pytest.raises(ValueError, match="corruption must be one of"):
    corrupt(e, "typo", random.Random(0))
  with pytest.raises(ValueError, match="kind must be one of"):
    check_derivation("algebra", "1+1", "2", "Answer: 2")


_trees = st.recursive(
    st.integers(-20, 99).map(num) | st.just(("x",)),
    lambda sub: st.tuples(st.sampled_from("+-*/"), sub, sub), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(_trees)
def test_render_then_parse_gives_the_same_tree(tree):
  assert parse_expr(render(tree)) == tree


FRAGMENTS = ["3", "*", "4", "+", "5", " = ", "=", "x", "(", ")", "-", "/", "0", "\n", "Answer: ",
             "Answer: 17", "17", "99999999999999999", "<think>", "</think>", " ", "1/2", "0.5",
             "((((((((((((((", "\x00", "\u0663"]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)),
       st.sampled_from([("simplify", "3*4+5", "17"), ("equation", "3*x+4 = 19", "5")]))
def test_checker_never_raises(text, problem):
  check = check_derivation(*problem, text)
  assert check.score in (0.0, 0.5, 1.0)
  assert all(i.kind in ISSUE_KINDS and i.line >= 1 for i in check.issues)
  assert (check.score == 1.0) == (not check.issues)
