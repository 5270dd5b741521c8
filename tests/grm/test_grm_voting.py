"""grm.voting: sums, meta-RM top-k and weighted votes against numpy references, shuffles undone."""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from grm.format import permutation, unshuffle
from grm.voting import (NO_WINNER, meta_vote, random_winners, select_top, unique_argmax, vote,
                        vote_correct, weighted_vote)


def _shuffled_samples(rng, k, n):
  """k samples of n scores, each judged in its own shown order; returns
  the shown-order rows, their orders, and the original-order truth."""
  truth = rng.integers(1, 11, size=(k, n))
  orders = [permutation(n, (3, j)) for j in range(k)]
  shown = [truth[j][list(o)] for j, o in enumerate(orders)]  # shown[p] = truth[order[p]]
  return shown, orders, truth


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 2 ** 32 - 1))
def test_vote_sums_unshuffled_valid_samples(k, n, seed):
  rng = np.random.default_rng(seed)
  shown, orders, truth = _shuffled_samples(rng, k, n)
  valid = rng.random(k) < 0.7
  scores = np.stack([np.asarray(unshuffle(tuple(s), o)) for s, o in zip(shown, orders)])
  # Garbage in invalid rows must not count.
  scores = np.where(valid[:, None], scores, 99)
  result = vote(scores, valid)
  # Reference: undo each shuffle with an inverse permutation (argsort), sum valid rows.
  ref_rows = np.stack([s[np.argsort(o)] for s, o in zip(shown, orders)])
  np.testing.assert_array_equal(ref_rows, truth)
  expected = ref_rows[valid].sum(0) if valid.any() else np.zeros(n)
  np.testing.assert_array_equal(result.totals, expected)
  assert result.num_valid == valid.sum() and result.num_invalid == (~valid).sum()
  assert result.used == tuple(np.flatnonzero(valid))
  top = expected.max()
  ref_winner = int(np.argmax(expected)) if valid.any() and (expected == top).sum() == 1 else -1
  assert result.winner == ref_winner


def test_tie_rule_no_winner():
  assert unique_argmax(np.array([3, 5, 5])) == NO_WINNER
  assert unique_argmax(np.array([3, 5, 4])) == 1
  tied = vote(np.array([[7, 3], [3, 7]]), np.array([True, True]))
  assert tied.winner == NO_WINNER and not vote_correct(tied, (1.0, 0.0))
  nobody = vote(np.array([[7, 3]]), np.array([False]))
  assert nobody.winner == NO_WINNER and nobody.num_valid == 0
  assert not vote_correct(nobody, (1.0, 0.0))
  single = vote(np.array([[7], [9]]), np.array([True, True]))
  assert single.winner == 0  # n = 1: the one response is the unique argmax


def test_vote_correct_n1_rounds_the_mean():
  # mean of (6, 7) = 6.5 rounds half to even -> 6; (7, 8) = 7.5 -> 8.
  assert vote_correct(vote(np.array([[6], [7]]), np.array([True, True])), (6,))
  assert not vote_correct(vote(np.array([[6], [7]]), np.array([True, True])), (7,))
  assert vote_correct(vote(np.array([[7], [8], [1]]), np.array([True, True, False])), (8,))
  w = weighted_vote(np.array([[2], [8]]), np.array([True, True]), np.array([1.0, 3.0]))
  np.testing.assert_allclose(w.mean_scores, [6.5])  # (2 + 24) / 4
  assert vote_correct(w, (6,)) and not vote_correct(w, (7,))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10), st.integers(2, 4), st.integers(1, 12), st.integers(0, 2 ** 32 - 1))
def test_meta_vote_keeps_the_top_k_meta_valid_samples(k, n, k_meta, seed):
  rng = np.random.default_rng(seed)
  scores = rng.integers(1, 11, size=(k, n))
  valid = rng.random(k) < 0.8
  meta = rng.integers(0, 4, size=k).astype(float)  # few values: ties in the meta score occur
  # Reference: valid indices sorted by (-meta, index), first k_meta.
  ranked = sorted(np.flatnonzero(valid), key=lambda i: (-meta[i], i))[:k_meta]
  chosen = sorted(int(i) for i in ranked)
  assert list(select_top(meta, valid, k_meta)) == chosen
  result = meta_vote(scores, valid, meta, k_meta)
  assert result.used == tuple(chosen)
  expected = scores[chosen].sum(0) if chosen else np.zeros(n)
  np.testing.assert_array_equal(result.totals, expected)
  # k_meta >= number of valid samples: plain voting.
  np.testing.assert_array_equal(meta_vote(scores, valid, meta, k).totals, vote(scores, valid).totals)


def test_meta_vote_prefers_high_meta_scores():
  scores = np.array([[9, 1], [1, 9], [1, 9], [2, 8]])
  valid = np.array([True, True, True, True])
  meta = np.array([5.0, -1.0, -2.0, -3.0])
  assert vote(scores, valid).winner == 1
  assert meta_vote(scores, valid, meta, 1).winner == 0
  with pytest.raises(ValueError, match="k_meta=0"):
    meta_vote(scores, valid, meta, 0)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 2 ** 32 - 1))
def test_weighted_vote_matches_numpy_average(k, n, seed):
  rng = np.random.default_rng(seed)
  scores = rng.integers(1, 11, size=(k, n))
  valid = rng.random(k) < 0.8
  weights = rng.random(k)
  result = weighted_vote(scores, valid, weights)
  if not valid.any():
    assert result.winner == NO_WINNER
    return
  expected = np.average(scores[valid], axis=0, weights=weights[valid])
  # float64, k <= 8 terms of size <= 10: reordering moves the sum by k * eps * 10.
  np.testing.assert_allclose(result.totals, expected, rtol=0, atol=8 * np.finfo(float).eps * 10)


def test_voting_rejects_bad_shapes():
  with pytest.raises(ValueError, match="valid"):
    vote(np.ones((3, 2)), np.ones(2, bool))
  with pytest.raises(ValueError, match="scores"):
    vote(np.ones(3), np.ones(3, bool))
  with pytest.raises(ValueError, match="weights"):
    weighted_vote(np.ones((2, 2)), np.ones(2, bool), np.array([1.0, -1.0]))


def test_random_baseline_accuracy_is_chance():
  ns = np.tile([2, 3, 4], 2000)
  picks = random_winners(ns, seed=0)
  assert picks.min() == 0 and np.all(picks < ns)
  truth = np.zeros_like(ns)
  hits = (picks == truth).astype(float)
  p = 1.0 / ns
  # Bernoulli(1/n) hits: mean within 4 standard errors of mean(1/n).
  se = np.sqrt(np.sum(p * (1 - p))) / ns.size
  assert abs(hits.mean() - p.mean()) < 4 * se


_VOTERS = {"vote": lambda s, v: vote(s, v),
           "meta_vote": lambda s, v: meta_vote(s, v, np.arange(len(v), dtype=float), 2),
           "weighted_vote": lambda s, v: weighted_vote(s, v, np.ones(len(v)))}


@pytest.mark.parametrize("voter", sorted(_VOTERS))
@pytest.mark.parametrize("bad,shown", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf"),
                                       (0, "0.0"), (11, "11.0"), (-3, "-3.0"), (7.5, "7.5")])
def test_voting_refuses_a_valid_sample_with_a_score_outside_the_grammar(voter, bad, shown):
  # Sample 2 (valid), response 1 holds the bad value; sample 1 is invalid and ignored.
  scores = np.array([[5, 6], [0, 0], [4, bad]], np.float64)
  valid = np.array([True, False, True])
  with pytest.raises(ValueError, match=re.escape(f"scores[2, 1]={shown}")):
    _VOTERS[voter](scores, valid)


def test_voting_refuses_non_numeric_scores():
  with pytest.raises(ValueError, match="scores must be numbers"):
    vote(np.array([[True, False]]), np.array([True]))


@pytest.mark.parametrize("voter", sorted(_VOTERS))
def test_an_invalid_samples_row_is_ignored_whatever_it_holds(voter):
  # The documented sentinel: invalid rows may hold anything (score_arrays writes zeros).
  valid = np.array([True, False, True])
  clean = _VOTERS[voter](np.array([[5, 6], [1, 1], [4, 9]], np.float64), valid)
  for junk in (np.nan, np.inf, 0, 99, 7.5):
    got = _VOTERS[voter](np.array([[5, 6], [junk, junk], [4, 9]], np.float64), valid)
    np.testing.assert_array_equal(got.totals, clean.totals)
    assert got.winner == clean.winner and got.used == clean.used == (0, 2)
