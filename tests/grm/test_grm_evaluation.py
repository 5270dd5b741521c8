"""grm.evaluation: the benchmark's per-group correctness against brute-force numpy references."""
import itertools
import math

import numpy as np
import pytest

from grm import evaluation as ev
from grm.data import PreferenceGroup
from grm_groups import random_groups as _groups
from grm.format import GRMPrompt, permutation
from grm.judge import SampledJudgement
from grm.parse import REASONS, Judgement


def _samples(rng, n, k, group):
  """k judgements of n responses, each shown in its own order; returns them and the
  original-order truth ``[k, n]`` and validity ``[k]``."""
  truth = rng.integers(1, 4, size=(k, n))  # a narrow range: ties at the top are common
  valid = rng.random(k) < 0.75
  out = []
  for j in range(k):
    order = permutation(n, (group, j))
    shown = tuple(int(truth[j][o]) for o in order)  # shown[p] = truth[order[p]]
    judgement = (Judgement(scores=shown, reason=None) if valid[j]
                 else Judgement(scores=None, reason=REASONS[j % len(REASONS)]))
    out.append(SampledJudgement(prompt=GRMPrompt(text="", order=order), text="",
                                judgement=judgement, finished=True))
  return out, truth, valid


def _winner(totals):
  top = totals.max()
  return int(np.argmax(totals)) if (totals == top).sum() == 1 else -1


def _vote_ok(rows, ratings):
  """Brute force: sum the voting rows; n >= 2 wants the unique best, n == 1 the
  rounded mean equal to the rating."""
  r = np.asarray(ratings, np.float64)
  if len(rows) == 0:
    return False
  totals = np.sum(rows, axis=0).astype(np.float64)
  if r.size >= 2:
    return _winner(totals) == int(np.argmax(r))
  return bool(np.rint(totals[0] / len(rows)) == r[0])


def test_voting_correctness_matches_brute_force():
  rng = np.random.default_rng(0)
  groups = _groups(rng, 40)
  ks = (1, 2, 3, 5)
  k_max = max(ks)
  greedy, many, truths, valids = [], [], [], []
  for e, g in enumerate(groups):
    greedy.append(_samples(rng, g.n, 1, (e, 99))[0])
    row, truth, valid = _samples(rng, g.n, k_max + 1, e)  # one extra sample never votes
    many.append(row)
    truths.append(truth)
    valids.append(valid)
  meta = rng.integers(0, 3, size=(len(groups), k_max + 1)).astype(np.float64)  # many ties
  got = ev.voting_correctness(groups, greedy, many, meta, ks)
  assert set(got) == {"greedy"} | {f"{kind}@{k}" for k in ks for kind in ("vote", "meta")}
  for e, g in enumerate(groups):
    r = np.asarray(g.ratings, np.float64)
    s = greedy[e][0].scores
    if s is None:
      want = False
    elif r.size == 1:
      want = s[0] == r[0]
    else:  # the best response strictly above every other
      best = int(np.argmax(r))
      want = all(s[best] > s[i] for i in range(g.n) if i != best)
    assert got["greedy"][e] == want
    for k in ks:
      used = [j for j in range(k) if valids[e][j]]
      assert got[f"vote@{k}"][e] == _vote_ok(truths[e][used], g.ratings), (e, k)
      # Meta: the ceil(v/2) of the v valid samples with the highest meta score (ties
      # to the lower index); k_meta counts valid samples only (was ceil(k/2)).
      top = sorted(used, key=lambda j: (-meta[e, j], j))[:max(1, math.ceil(len(used) / 2))]
      assert got[f"meta@{k}"][e] == _vote_ok(truths[e][top], g.ratings), (e, k)
  # The reference is not trivially all-true or all-false.
  assert 0 < sum(got["meta@5"]) < len(groups)


def test_voting_correctness_rejects_misshapen_inputs():
  rng = np.random.default_rng(1)
  groups = _groups(rng, 2)
  rows = [_samples(rng, g.n, 2, e)[0] for e, g in enumerate(groups)]
  with pytest.raises(ValueError, match="meta"):
    ev.voting_correctness(groups, rows, rows, np.zeros((2, 1)), (2,))
  with pytest.raises(ValueError, match="fewer than max"):
    ev.voting_correctness(groups, rows, rows, np.zeros((2, 3)), (3,))
  with pytest.raises(ValueError, match="ks"):
    ev.voting_correctness(groups, rows, rows, np.zeros((2, 2)), (0,))
  with pytest.raises(ValueError, match="one row per"):
    ev.voting_correctness(groups, rows[:1], rows, np.zeros((2, 2)), (1,))


def test_round_robin_picks_the_unique_most_winning_response():
  rng = np.random.default_rng(2)
  groups = [g for g in _groups(rng, 30) if g.n >= 2]
  triples, owner = ev.round_robin(groups)
  want_owner = [(e, i, j) for e, g in enumerate(groups)
                for i, j in itertools.combinations(range(g.n), 2)]
  assert owner == want_owner
  assert triples == [(groups[e].query, groups[e].responses[i], groups[e].responses[j])
                     for e, i, j in want_owner]
  preferred = rng.integers(-1, 2, size=len(owner))
  got = ev.round_robin_picks(groups, owner, preferred)
  for e, g in enumerate(groups):
    # Brute force: a response's wins are the pairs it is in and was preferred in.
    wins = np.array([sum(1 for (f, i, j), p in zip(owner, preferred)
                         if f == e and p >= 0 and (i, j)[p] == r) for r in range(g.n)])
    assert got[e] == _winner(wins)
  assert any(p == -1 for p in got) and any(p >= 0 for p in got)
  with pytest.raises(ValueError, match="preferred"):
    ev.round_robin_picks(groups, owner, np.full(len(owner), 2))


def test_round_robin_picks_take_swap_averaged_credit():
  g = PreferenceGroup(domain="math", example_id="g", split="test", query="q",
                      responses=("a", "b", "c"), ratings=(0.0, 0.5, 1.0), reasons=("",) * 3)
  _, owner = ev.round_robin([g])  # (0,1), (0,2), (1,2)
  # Hand count: (0,1) split 1/2 each; (0,2) c wins; (1,2) no verdict -> a 0.5, b 0.5, c 1.
  assert ev.round_robin_picks([g], owner, [0.5, 1.0, np.nan]) == [2]
  # (0,1) b wins, (0,2) split, (1,2) split -> a 0.5, b 1.5, c 1.
  assert ev.round_robin_picks([g], owner, [1.0, 0.5, 0.5]) == [1]
  assert ev.round_robin_picks([g], owner, [0.5, 0.5, 0.5]) == [-1]  # all tied at 1
  with pytest.raises(ValueError, match="preferred"):
    ev.round_robin_picks([g], owner, [0.5, 1.5, 0.0])


def test_group_picks_split_the_flat_rewards():
  ns = [2, 3, 1, 2]
  rewards = np.array([0.5, 0.1, 0.2, 0.9, 0.9, 0.3, 0.7, 0.7])
  # Slices [0.5, 0.1] -> 0; [0.2, 0.9, 0.9] -> tie; [0.3] -> 0; [0.7, 0.7] -> tie.
  assert ev.group_picks(rewards, ns) == [0, -1, 0, -1]
  with pytest.raises(ValueError, match="rewards"):
    ev.group_picks(rewards[:-1], ns)


def test_random_correctness_matches_its_seeded_draws():
  rng = np.random.default_rng(3)
  subsets = {"chat": _groups(rng, 6), "code": [], "math": _groups(rng, 5)}
  got = ev.random_correctness(subsets, seed=7)
  draw = np.random.default_rng(7)  # one rating per group, in order, across subsets
  for i, (s, gs) in enumerate(subsets.items()):
    picks = np.random.default_rng((7, i)).integers(0, [g.n for g in gs]) if gs else []
    want = []
    for g, p in zip(gs, picks):
      rating = int(draw.integers(1, 11))
      want.append(rating == g.ratings[0] if g.n == 1 else int(p) == int(np.argmax(g.ratings)))
    assert got[s] == want


def test_invalid_rates_by_subset_and_multi_only():
  rng = np.random.default_rng(4)
  samples, _, valid = _samples(rng, 2, 12, 0)
  rates = ev.invalid_rates(samples)
  assert rates["invalid_rate"] == pytest.approx((~valid).sum() / 12)
  assert sum(v for k, v in rates.items() if k.startswith("invalid/")) == pytest.approx(
      rates["invalid_rate"])
  assert ev.by_subset(["a", "b", "a"], [1, 0, 0]) == {"a": [True, False], "b": [False]}
  with pytest.raises(ValueError, match="length"):
    ev.by_subset(["a"], [1, 0])
  groups = _groups(np.random.default_rng(5), 8)
  flags = [bool(i % 2) for i in range(8)]
  assert ev.multi_only({"s": flags}, {"s": groups}, already=False) == [
      f for f, g in zip(flags, groups) if g.n >= 2]
  assert ev.multi_only({"s": flags}, {"s": groups}, already=True) == flags
