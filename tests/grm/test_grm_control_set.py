"""grm.control_set: the positive-control groups (n = 2, a visible cue), checked against the
task examples' own references and a hand-written case."""
import dataclasses
import re

import pytest

from grm import control_set as cs
from grm import yardstick
from opd import tasks as tasks_lib


def _number(text):
  return int(re.search(r"Answer: (-?[0-9]+)$", text).group(1))


@pytest.mark.parametrize("cue", cs.CUES)
def test_groups_hold_the_reference_and_one_wrong_answer_with_the_cue_on_the_better(cue):
  examples, groups = cs.control_groups("train", 40, cue=cue, seed=3)
  again = cs.control_groups("train", 40, cue=cue, seed=3)
  assert (examples, groups) == again  # deterministic
  by_id = {ex.id: ex for ex in examples}
  assert len(groups) == 40 and len(by_id) == 40
  assert len({g.query for g in groups}) == 40  # distinct prompts
  first_better = []
  for g in groups:
    ex = by_id[g.example_id]
    assert (g.n, g.domain, g.split, g.query) == (2, "math", "train", ex.prompt)
    right = _number(ex.reference[-1][1])
    best = g.ratings.index(1.0)
    assert sorted(g.ratings) == [0.0, 1.0]
    assert _number(g.responses[best]) == right
    wrong = _number(g.responses[1 - best])
    assert wrong != right and 1 <= abs(wrong - right) <= 9 and wrong >= 0
    assert g.reasons[best] == "ok" and g.reasons[1 - best] == "wrong_answer"
    marked = [cs.MARKER in r for r in g.responses]
    assert marked == ([i == best for i in range(2)] if cue == "marker" else [False, False])
    first_better.append(best == 0)
  # The stored order is seeded, not fixed: the better response is first in some groups
  # and second in others (40 fair coins all alike: probability 2^-39).
  assert 0 < sum(first_better) < 40


def test_splits_do_not_share_prompts_and_the_control_shifts_every_response():
  _, train = cs.control_groups("train", 30, cue="marker", seed=0)
  _, test = cs.control_groups("test", 30, cue="marker", seed=1)
  assert not {g.query for g in train} & {g.query for g in test}
  blind = yardstick.content_blind(test, seed=5)
  own = {(g.example_id, r) for g in test for r in g.responses}
  for g, b in zip(test, blind):
    assert b.ratings == g.ratings and b.query == g.query
    # Every shown response is another group's (texts may coincide by accident, so
    # compare by owner: no response of b is g's own text unless another group has it too).
    for r in b.responses:
      owners = {e for e, t in own if t == r}
      assert owners - {g.example_id}


def test_bad_inputs_name_the_field():
  ex = tasks_lib.domain_examples(("math",), "train", 1, 0, (1,))[0]
  with pytest.raises(ValueError, match="cue='loud'"):
    cs.control_group(ex, cue="loud", seed=0)
  other = tasks_lib.domain_examples(("code",), "train", 1, 0, (1,))[0]
  with pytest.raises(ValueError, match="domain='code'"):
    cs.control_group(other, cue="marker", seed=0)
  odd = dataclasses.replace(ex, reference=(("assistant", "nine"),))
  with pytest.raises(ValueError, match="is not 'Answer: <integer>'"):
    cs.control_group(odd, cue="marker", seed=0)
  with pytest.raises(ValueError, match="n=0"):
    cs.control_groups("train", 0, cue="marker", seed=0)


def test_hand_computed_case():
  ex = tasks_lib.domain_examples(("math",), "train", 1, 0, (1,))[0]
  assert ex.prompt == "Ann has 2 cups and gets 7 more. How many cups now?"  # 2 + 7 = 9
  g = cs.control_group(ex, cue="marker", seed=0)
  best = g.ratings.index(1.0)
  assert g.responses[best] == "Checked.\nAnswer: 9"
  assert re.fullmatch(r"Answer: [0-9]+", g.responses[1 - best]) and g.responses[1 - best] != \
      "Answer: 9"
