"""grm.verify.evaluation on hand-built analyses (expected values derived in the comments)."""
import numpy as np
import pytest

from grm.verify import evaluation as E
from opd.tasks.proof_task import Issue, ProofCheck

WRONG = ProofCheck((Issue(2, "wrong_step"), Issue(3, "wrong_final")), 0.0)
CLEAN = ProofCheck((), 1.0)
SKIP = ProofCheck((Issue(1, "missing_step"),), 0.5)


def test_verifier_metrics_by_hand():
  texts = ["Line 2: wrong_step\nLine 3: wrong_final\nScore: 0",  # exact: 2 stated, 2 confirmed
           "Line 1: bad_line\nScore: 0",                         # wrong issue, wrong score (0 vs 1)
           "No issues.\nScore: 1",                               # misses the skip: 1 vs 0.5
           "Score: 2"]                                           # invalid
  checks = [WRONG, CLEAN, SKIP, SKIP]
  m = E.verifier_metrics(texts, checks)
  assert m["n"] == 4 and m["format"] == 0.75
  assert m["accuracy"] == 0.25                      # only the first has s' = s
  assert m["stated_issues"] == 3 and m["faithfulness"] == pytest.approx(2 / 3)
  # R_format · R_score: 1, 1 - |0 - 1| = 0, 1 - |1 - 0.5| = 0.5, 0 (invalid); mean 0.375.
  assert m["r_score"] == pytest.approx(0.375)
  acc = np.array([1.0, 0, 0, 0])
  assert m["accuracy_se"] == pytest.approx(acc.std(ddof=1) / 2)


def test_evaluate_verifier_prompts_each_proof_once():
  prompts = []

  def fn(ps):
    prompts.extend(ps)
    return ["No issues.\nScore: 1"] * len(ps)

  m = E.evaluate_verifier(fn, ["Simplify 1+2 step by step."] * 2, ["1+2 = 3\nAnswer: 3", "x"],
                          [CLEAN, SKIP])
  assert len(prompts) == 2 and "1| 1+2 = 3" in prompts[0]
  assert m["accuracy"] == 0.5 and np.isnan(m["faithfulness"]) and m["stated_issues"] == 0
  with pytest.raises(ValueError, match="returned 1 texts"):
    E.evaluate_verifier(lambda ps: ["Score: 1"], ["a", "b"], ["y", "z"], [CLEAN, CLEAN])


def test_correctness_by_hand():
  c = E.correctness([1.0, 0.5, 0.0, 1.0])
  assert c["mean_score"] == 0.625 and c["correct"] == 0.5 and c["n"] == 4
  assert c["correct_se"] == pytest.approx(np.std([1, 0, 0, 1], ddof=1) / 2)
  with pytest.raises(ValueError, match="non-empty"):
    E.correctness([])
