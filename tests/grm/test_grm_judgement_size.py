"""The cold-start judgement's size (principles, critique) and the rating-1 downsampling
(grm.data.rule_judgement, grm.data.downsample_rating1; docs/DESIGN.md §6)."""
import dataclasses

import numpy as np
import pytest

from grm.data import PRINCIPLES, downsample_rating1, rule_judgement, truth_scores
from grm.format import Principle, build_prompt, format_judgement, shuffle
from grm.parse import parse_judgement
from grm_groups import random_groups  # tests/grm/grm_groups.py


def _old_rule_judgement(group, *, seed, noise, shuffle_seed):
  """The rule judge as it was before the judgement could be sized: two principles,
  the first weight a multiple of 10 in 10..90, the reason critique."""
  rng = np.random.default_rng(seed)
  prompt = build_prompt(group.query, group.responses, seed=shuffle_seed)
  pool = PRINCIPLES[group.domain]
  chosen = [pool[i] for i in sorted(rng.choice(len(pool), size=2, replace=False))]
  first = int(rng.integers(1, 10)) * 10
  principles = [Principle(chosen[0], first), Principle(chosen[1], 100 - first)]
  scores = truth_scores(group.ratings, rng, noise)
  reasons = shuffle(group.reasons, prompt.order)
  critique = "\n".join(f"Response {p + 1}: {r}." for p, r in enumerate(reasons))
  return prompt, format_judgement(principles, critique, shuffle(scores, prompt.order))


def test_the_default_size_writes_the_old_judgements():
  rng = np.random.default_rng(0)
  for e, g in enumerate(random_groups(rng, 60)):
    g = dataclasses.replace(g, reasons=tuple(f"why{i}" for i in range(g.n)))
    args = dict(seed=(3, e, 0), noise=0.3, shuffle_seed=(3, e, 1))
    assert rule_judgement(g, **args) == _old_rule_judgement(g, **args)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_k_principles_from_the_pool_weights_summing_to_100_scores_unchanged(k):
  rng = np.random.default_rng(k)
  pool = PRINCIPLES["math"]
  for e, g in enumerate(random_groups(rng, 40)):
    g = dataclasses.replace(g, reasons=tuple(f"why{i}" for i in range(g.n)))
    prompt, text = rule_judgement(g, seed=(1, e), noise=0.0, shuffle_seed=(2, e), principles=k)
    j = parse_judgement(text, g.n)
    assert j.valid and len(j.principles) == k
    assert [p.text for p in j.principles] == [t for t in pool if t in {p.text for p in j.principles}]
    if k:
      assert sum(p.weight for p in j.principles) == 100 and min(p.weight for p in j.principles) >= 10
      assert all(p.weight % 10 == 0 for p in j.principles)
    # noise 0: the scores are the truth's, whatever the number of principles
    _, ref = rule_judgement(g, seed=(1, e), noise=0.0, shuffle_seed=(2, e))
    assert j.scores == parse_judgement(ref, g.n).scores
    assert j.critique == "\n".join(f"Response {p + 1}: why{i}." for p, i in enumerate(prompt.order))


def test_no_critique_goes_from_the_principles_to_the_scores():
  rng = np.random.default_rng(5)
  for e, g in enumerate(random_groups(rng, 30)):
    _, on = rule_judgement(g, seed=e, shuffle_seed=e)
    _, off = rule_judgement(g, seed=e, shuffle_seed=e, critique=False)
    a, b = parse_judgement(on, g.n), parse_judgement(off, g.n)
    assert b.critique == "" and b.scores == a.scores and b.principles == a.principles
    assert off.splitlines()[-2] == "Critique:"


def test_bad_principle_counts_name_the_argument():
  g = random_groups(np.random.default_rng(0), 1)[0]
  for bad in (-1, 4, 1.5, True):
    with pytest.raises(ValueError, match=r"principles=.* must be an int in \[0, 3\]"):
      rule_judgement(g, seed=0, principles=bad)


@pytest.mark.parametrize("keep", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_downsampling_keeps_round_keep_m_rating1_singles_and_everything_else(keep):
  rng = np.random.default_rng(int(keep * 100))
  groups = random_groups(rng, 300)
  # ratings 1..10 uniform: bias some more singles to rating 1, as the real data has
  groups = [dataclasses.replace(g, ratings=(1,)) if g.n == 1 and rng.random() < 0.5
            else g for g in groups]
  is_one = np.array([g.n == 1 and g.ratings[0] == 1 for g in groups])
  m = int(is_one.sum())
  out = downsample_rating1(groups, keep, seed=7)
  out_ids = [g.example_id for g in out]
  assert sum(g.n == 1 and g.ratings[0] == 1 for g in out) == int(np.rint(keep * m))
  others = [g.example_id for g, one in zip(groups, is_one) if not one]
  assert [i for i in out_ids if i in set(others)] == others  # every other group, in order
  order = [g.example_id for g in groups]
  assert out_ids == sorted(out_ids, key=order.index)  # the original order
  assert downsample_rating1(groups, keep, seed=7) == out  # seeded
  if 0 < keep < 1:
    assert downsample_rating1(groups, keep, seed=8) != out


def test_downsampling_bad_fraction_names_keep():
  for bad in (-0.1, 1.5, True, "0.5"):
    with pytest.raises(ValueError, match="keep=.* must be a fraction in"):
      downsample_rating1([], bad, seed=0)
