"""grm.verify.refine: the stop rule (self-score 1 or the round limit) with a scripted generator."""
import collections

import pytest

from grm.verify.refine import refine


def _gen(proof, score):
  issues = "No issues." if score == "1" else "Line 1: wrong_step"
  return f"{proof}\nAnswer: 1\nSelf-evaluation:\n{issues}\nScore: {score}"


# Per problem, what the generator writes at round 0, 1, 2, 3.
SCRIPT = {
    "qA": [_gen("a0", "1")],                                          # done at once
    "qB": [_gen("b0", "0"), _gen("b1", "0.5"), _gen("b2", "1")],      # self-score 1 at round 2
    "qC": [_gen(f"c{r}", "0") for r in range(4)],                     # never: stops at max
    "qD": ["d0 without a self-evaluation", _gen("d1", "1")],          # invalid, then done
}


def _scripted():
  calls, rounds, prompts_seen = [], collections.Counter(), collections.defaultdict(list)

  def generate_fn(prompts):
    calls.append(len(prompts))
    out = []
    for p in prompts:
      q = p.split("\n")[0]
      prompts_seen[q].append(p)
      out.append(SCRIPT[q][rounds[q]])
      rounds[q] += 1
    return out

  return generate_fn, calls, prompts_seen


def test_stop_rule_and_batched_rounds():
  generate_fn, calls, seen = _scripted()
  res = refine(list(SCRIPT), generate_fn, max_rounds=3)
  assert calls == [4, 3, 2, 1]            # A stops at 0; D at 1; B at 2; C runs all 3 rounds
  assert res.stopped == [0, 2, 3, 1]
  assert res.converged == [True, True, False, True]
  assert res.proofs[1] == ["b0\nAnswer: 1", "b1\nAnswer: 1", "b2\nAnswer: 1"]
  assert len(res.proofs[2]) == 4 and len(res.generations[0]) == 1
  # The previous proof and its self-evaluation go into the refinement prompt.
  assert "b0\nAnswer: 1" in seen["qB"][1] and seen["qB"][1].endswith("Line 1: wrong_step\nScore: 0")
  # An output without a self-evaluation: its whole text is the proof, the evaluation empty.
  assert res.proofs[3][0] == "d0 without a self-evaluation" and "Verification:\n" in seen["qD"][1]
  assert not res.generations[3][0].valid
  # proof_at: the proof in use after r rounds (the last one once stopped).
  assert [res.proof_at(1, r) for r in (0, 1, 2, 4)] == ["b0\nAnswer: 1", "b1\nAnswer: 1",
                                                         "b2\nAnswer: 1", "b2\nAnswer: 1"]


def test_max_rounds_zero_is_a_single_pass():
  generate_fn, calls, _ = _scripted()
  res = refine(["qB", "qA"], generate_fn, max_rounds=0)
  assert calls == [2] and res.stopped == [0, 0] and res.converged == [False, True]
  with pytest.raises(ValueError, match="max_rounds"):
    refine(["qA"], generate_fn, max_rounds=-1)
  with pytest.raises(ValueError, match="returned 0 texts"):
    refine(["qA"], lambda ps: [], max_rounds=1)
