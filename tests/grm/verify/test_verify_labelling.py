"""grm.verify.labelling: the majority meta-check rule on constructed analyses, hand-derived labels."""
import collections

import numpy as np
import pytest

from grm.verify.labelling import agreement_table, auto_labels, label_proofs


def test_rule_on_constructed_arrays():
  T, F = True, False
  # Proof 0: analysis 1 (score 0) is confirmed by 1 of 3 meta-checks: not valid;
  #   analysis 2 (score 0.5) by 2 of 3: valid -> label 0.5. Analysis 0 reports nothing.
  # Proof 1: nothing reported -> 1, even though analysis 0 says 0 (it is not meta-checked).
  # Proof 2: analysis 0 (score 0) confirmed 3/3 -> valid -> 0, below analysis 2's valid 0.5.
  scores = [[1, 0, 0.5], [0, 1, 1], [0, 1, 0.5]]
  reports = [[F, T, T], [F, F, F], [T, F, T]]
  confirms = [[[F, F, F], [T, F, F], [T, T, F]],
              [[T, T, T], [T, T, T], [T, T, T]],
              [[T, T, T], [F, F, F], [F, T, T]]]
  np.testing.assert_array_equal(auto_labels(scores, reports, confirms), [0.5, 1.0, 0.0])
  # m = 4: 2 confirmations of 4 is a tie, not a majority -> not valid -> label 1; 3 of 4 is.
  np.testing.assert_array_equal(
      auto_labels([[0.0], [0.0]], [[T], [T]], [[[T, T, F, F]], [[T, T, T, F]]]), [1.0, 0.0])
  with pytest.raises(ValueError, match="confirms"):
    auto_labels(scores, reports, [[T]])


PROOFS = ["a = 1\nAnswer: 1", "b = 2\nAnswer: 2"]
ANALYSES = {"a = 1": ["Line 2: wrong_step\nScore: 0", "No issues.\nScore: 1"],
            "b = 2": ["Line 1: bad_line\nScore: 0", "Line 2: missing_step\nScore: 0.5"]}
# The j-th meta-check of an analysis (by the kind it states).
META = {"wrong_step": ["real"] * 3, "bad_line": ["real", "not real", "not real"],
        "missing_step": ["not real", "real", "real"]}


def _scripted():
  calls = []

  def verify_fn(prompts):
    calls.append(("verify", len(prompts)))
    seen = collections.Counter()
    out = []
    for p in prompts:
      key = next(k for k in ANALYSES if f"1| {k}" in p)
      out.append(ANALYSES[key][seen[key]])
      seen[key] += 1
    return out

  def meta_fn(prompts):
    calls.append(("meta", len(prompts)))
    seen = collections.Counter()
    out = []
    for p in prompts:
      kind = next(k for k in META if f": {k}\nScore" in p.split("Analysis:")[1])
      out.append(f"Issue 1: {META[kind][seen[kind]]}\nScore: 1")
      seen[kind] += 1
    return out

  return verify_fn, meta_fn, calls


def test_label_proofs_and_agreement_table():
  verify_fn, meta_fn, calls = _scripted()
  lab = label_proofs(["q0", "q1"], PROOFS, verify_fn, meta_fn, n=2, m=3)
  # 2 proofs x 2 analyses; 3 of them report issues, 3 meta-checks each.
  assert calls == [("verify", 4), ("meta", 9)]
  assert [len(x) for x in lab.metas[0]] == [3, 0]
  # Proof 0: its wrong_step analysis (score 0) is always confirmed -> 0 for every n, m.
  # Proof 1: bad_line (score 0) is confirmed by its first meta-check only: valid at m = 1,
  #   not at m = 3 (1 of 3); missing_step (0.5) is rejected by its first: valid only at m = 3.
  #   (n, m) = (1, 1): 0; (1, 3): 1; (2, 1): 0; (2, 3): 0.5.
  assert lab.labels(1, 1).tolist() == [0.0, 0.0]
  assert lab.labels(1, 3).tolist() == [0.0, 1.0]
  assert lab.labels(2, 1).tolist() == [0.0, 0.0]
  assert lab.labels().tolist() == [0.0, 0.5]
  rows = agreement_table(lab, [0.0, 0.5], ns=[1, 2], ms=[1, 3])
  assert [(r["n"], r["m"], r["agreement"], r["mae"]) for r in rows] == [
      (1, 1, 0.5, 0.25), (1, 3, 0.5, 0.25), (2, 1, 0.5, 0.25), (2, 3, 1.0, 0.0)]
  with pytest.raises(ValueError, match="outside"):
    agreement_table(lab, [0.0, 0.5], ns=[3], ms=[1])


def test_no_proofs_no_labels():
  lab = label_proofs([], [], lambda ps: list(ps), lambda ps: list(ps), n=2, m=1)
  assert lab.labels().shape == (0,)


def test_label_proofs_checks_its_callables():
  with pytest.raises(ValueError, match="verify_fn returned 1"):
    label_proofs(["q"], ["p"], lambda ps: ["x"], lambda ps: [], n=2, m=1)
  with pytest.raises(ValueError, match="m=0"):
    label_proofs(["q"], ["p"], lambda ps: ps, lambda ps: ps, n=1, m=0)
