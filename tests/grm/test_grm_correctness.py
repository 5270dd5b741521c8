"""grm.correctness: the SPCT correctness rule and the rule-RL reward."""
import pytest
from hypothesis import given, settings, strategies as st

from grm.correctness import best_index, is_correct, rule_reward


@pytest.mark.parametrize("scores,ratings,correct", [
    ((7, 3), (1.0, 0.0), True),
    ((3, 7), (1.0, 0.0), False),
    ((7, 7), (1.0, 0.0), False),            # tie at the top: incorrect
    ((5, 9, 9), (0.2, 0.9, 0.1), False),    # the best ties with another
    ((5, 9, 8), (0.2, 0.9, 0.1), True),
    ((9, 9, 8), (0.2, 0.1, 0.9), False),    # tie below the best does not help it
    ((1, 2, 3, 10), (0, 0, 0, 1), True),    # equal ratings below the unique best are fine
    ((6,), (6,), True),                     # n = 1: the score must equal the rating
    ((7,), (6,), False),
    ((5,), (6,), False),
    (None, (1.0, 0.0), False),              # invalid sample
    (None, (6,), False),
])
def test_correctness_rule(scores, ratings, correct):
  assert is_correct(scores, ratings) is correct
  assert rule_reward(scores, ratings) == (1.0 if correct else -1.0)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 5).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 10), min_size=n, max_size=n),
    st.lists(st.integers(0, 3), min_size=n, max_size=n).filter(
        lambda r: r.count(max(r)) == 1))))
def test_correctness_matches_pairwise_comparisons(case):
  scores, ratings = case
  j = max(range(len(ratings)), key=ratings.__getitem__)
  expected = all(scores[j] > scores[i] for i in range(len(scores)) if i != j)
  assert is_correct(scores, ratings) is expected
  assert rule_reward(scores, ratings) == (1.0 if expected else -1.0)
  assert best_index(ratings) == j


@pytest.mark.parametrize("ratings,match", [
    ((1.0, 1.0), "unique best"),
    ((0.5, 1.0, 1.0), "unique best"),
    ((), "non-empty"),
    ((float("nan"), 1.0), "finite"),
    ((6.5,), "integer rating"),
    ((11,), "integer rating"),
])
def test_bad_ground_truth_raises(ratings, match):
  with pytest.raises(ValueError, match=match):
    is_correct(None, ratings)


def test_length_mismatch_raises():
  with pytest.raises(ValueError, match="differ in length"):
    is_correct((1, 2, 3), (0.0, 1.0))
