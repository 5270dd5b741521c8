"""grm.data: preference groups from the task suite and the rule-based judge."""
import collections

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from grm.correctness import is_correct
from grm.data import (PRINCIPLES, Candidate, PreferenceGroup, build_groups, rating_from_reward,
                      rule_judgement, sample_candidates, split_groups, truth_scores)
from grm.format import unshuffle
from grm.parse import parse_judgement
from opd import tasks
from opd.models import ModelConfig, init_params
from opd.text.tokenizers import ByteTokenizer


def _writing_candidates(examples):
  """Verified candidates of graded quality, scored by the writing rubric."""
  task = tasks.get_task("writing")
  out = []
  for e in examples:
    texts = [e.reference_text, e.reference_text.lower(), "the the the", "Bad", "Bad"]
    out.append([Candidate(t, task.verify(e, t)) for t in texts])
  return out


def test_groups_keep_a_unique_best_or_a_rating_and_count_the_rest():
  task = tasks.get_task("writing")
  examples = task.examples("train", 24, seed=0) + task.examples("test", 8, seed=0)
  cands = _writing_candidates(examples)
  groups, counts = build_groups(examples, cands, seed=3)
  assert counts["kept"] == len(groups) and counts["kept"] + counts.get("no_unique_best", 0) == 32
  assert {g.n for g in groups} > {1}
  by_text = [{c.text: c.reward for c in cs} for cs in cands]
  ids = [e.id for e in examples]
  for g in groups:
    truth = by_text[ids.index(g.example_id)]
    assert 1 <= g.n <= 4 and len(set(g.responses)) == g.n  # duplicates ("Bad") count once
    if g.n == 1:
      assert g.ratings == (rating_from_reward(truth[g.responses[0]].reward),)
    else:
      rewards = [truth[r].reward for r in g.responses]
      assert list(g.ratings) == rewards and rewards.count(max(rewards)) == 1
    assert g.reasons == tuple(truth[r].reason for r in g.responses)
  again, _ = build_groups(examples, cands, seed=3)
  assert again == groups
  splits = split_groups(groups)
  assert set(splits) <= {"train", "test"}
  train_q = {g.query for g in splits.get("train", [])}
  assert not train_q & {g.query for g in splits.get("test", [])}


def test_ties_at_the_top_are_dropped_and_split_leaks_raise():
  task = tasks.get_task("math")
  [e] = task.examples("train", 1, seed=0)
  wrong = [Candidate(t, task.verify(e, t)) for t in ("Answer: 1000", "Answer: 1001")]
  groups, counts = build_groups([e], [wrong], seed=0, sizes=(2,))
  assert groups == [] and counts == {"no_unique_best": 1}
  g = PreferenceGroup("math", "x", "train", "q", ("a",), (3.0,), ("ok",))
  with pytest.raises(ValueError, match="splits"):
    split_groups([g, PreferenceGroup("math", "y", "test", "q", ("b",), (3.0,), ("ok",))])


def test_rating_from_reward():
  rewards = (0.0, 0.05, 0.5, 0.95, 1.0)
  # Reference: Python's round (nearest, ties to even), e.g. 9 * 0.95 = 8.55 -> 9.
  assert [rating_from_reward(r) for r in rewards] == [1 + round(9 * r) for r in rewards]
  assert rating_from_reward(0.95) == 10
  with pytest.raises(ValueError, match="reward=1.5"):
    rating_from_reward(1.5)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(
    st.floats(0, 1), min_size=n, max_size=n).filter(
        lambda r: n == 1 or r.count(max(r)) == 1)),
       st.sampled_from(sorted(PRINCIPLES)), st.floats(0, 1), st.integers(0, 2 ** 16))
def test_rule_judge_writes_valid_correct_judgements(rewards, domain, noise, seed):
  ratings = tuple(rewards) if len(rewards) > 1 else (float(rating_from_reward(rewards[0])),)
  group = PreferenceGroup(domain, "id", "train", "Query?",
                          tuple(f"response {i}" for i in range(len(rewards))), ratings,
                          tuple("ok" if r == max(rewards) else "wrong_answer" for r in rewards))
  prompt, text = rule_judgement(group, seed=seed, noise=noise, shuffle_seed=seed)
  j = parse_judgement(text, group.n)
  assert j.valid
  assert is_correct(unshuffle(j.scores, prompt.order), group.ratings)
  assert len(j.principles) == 2 and sum(p.weight for p in j.principles) == 100
  assert all(p.text in PRINCIPLES[domain] for p in j.principles)
  assert j.critique.count("Response ") == group.n


def test_truth_scores_noise_moves_only_non_best_scores():
  ratings = (0.2, 0.9, 0.4, 0.1)
  clean = truth_scores(ratings, np.random.default_rng(0), 0.0)
  assert clean == tuple(rating_from_reward(r) for r in ratings)
  moved = [truth_scores(ratings, np.random.default_rng(s), 1.0) for s in range(20)]
  assert all(m[1] == clean[1] for m in moved)
  assert any(m != clean for m in moved)
  tight = truth_scores((1.0, 0.99), np.random.default_rng(0), 0.0)  # both round to 10
  assert tight == (10, 9)


def test_sample_candidates_runs_each_model_and_temperature_through_rollout():
  tok = ByteTokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                    d_ff=64)
  params = init_params(cfg, jax.random.key(0))
  examples = tasks.get_task("writing").examples("train", 2, seed=0)
  cands = sample_candidates([(cfg, params)], tok, examples, temperatures=(0.0, 1.0),
                            max_new_tokens=6, seed=0)
  assert [len(c) for c in cands] == [2, 2]
  task = tasks.get_task("writing")
  for e, cs in zip(examples, cands):
    for c in cs:
      assert c.reward == task.verify(e, c.text)
  groups, counts = build_groups(examples, cands, seed=0)
  assert counts.get("kept", 0) == len(groups)


def _fixed_candidates(rewards):
  return [Candidate(f"r{i}", tasks.Reward(r, 1.0, {}, "ok" if r == 1 else "wrong"))
          for i, r in enumerate(rewards)]


def test_redrawing_samples_subsets_conditioned_on_a_unique_best():
  task = tasks.get_task("math")
  examples = task.examples("train", 1, seed=0) * 3000
  cands = [_fixed_candidates((1.0, 0.5, 0.5, 0.0))] * len(examples)
  groups, counts = build_groups(examples, cands, seed=1, sizes=(2,), max_draws=64)
  assert counts["kept"] == len(examples) and "no_unique_best" not in counts
  # Reference: of the C(4, 2) = 6 pairs all but {r1, r2} (tied at 0.5) have a
  # unique best, so each of those 5 is drawn with probability 1/5.
  pairs = collections.Counter(tuple(sorted(g.responses)) for g in groups)
  assert set(pairs) == {("r0", "r1"), ("r0", "r2"), ("r0", "r3"), ("r1", "r3"), ("r2", "r3")}
  se = np.sqrt(0.2 * 0.8 / len(groups))
  for c in pairs.values():
    assert abs(c / len(groups) - 0.2) < 5 * se
  # One draw (the default) drops the tied pair instead: about 1/6 of the examples.
  _, once = build_groups(examples, cands, seed=1, sizes=(2,))
  assert abs(once["no_unique_best"] / len(examples) - 1 / 6) < 5 * np.sqrt(5 / 36 / 3000)


def test_redrawing_lowers_the_size_and_drops_only_all_equal_candidates():
  task = tasks.get_task("math")
  examples = task.examples("train", 2, seed=0)
  cands = [_fixed_candidates((1.0, 1.0, 1.0, 0.0)), _fixed_candidates((0.0, 0.0, 0.0))]
  groups, counts = build_groups(examples, cands, seed=0, sizes=(4,), max_draws=8)
  # Example 0: a group of 4 would hold three tied 1.0s; one response is below the top, so
  # the largest size with a unique best is 2: one 1.0 and the 0.0.
  [g] = groups
  assert g.n == 2 and sorted(g.ratings) == [0.0, 1.0]
  assert {k: counts[k] for k in ("kept", "kept_n2", "size_lowered", "no_unique_best")} == {
      "kept": 1, "kept_n2": 1, "size_lowered": 1, "no_unique_best": 1}
