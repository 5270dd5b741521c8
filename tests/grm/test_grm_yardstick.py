"""grm.yardstick: chance, chance credit, records and the content-blind control against numpy."""
import json
import math

import numpy as np
import pytest

from grm import evaluation as ev
from grm import meta_rm as meta_lib
from grm import yardstick as ys
from grm.data import PreferenceGroup
from grm_groups import random_groups as _groups
from grm.format import GRMPrompt, permutation
from grm.judge import SampledJudgement
from grm.parse import Judgement


def _samples(rng, g, k, e):
  """k judgements (truth in 1..3: ties common; ~30% invalid), each in its own order."""
  truth = rng.integers(1, 4, size=(k, g.n))
  if g.n == 1:
    truth = rng.integers(1, 11, size=(k, 1))
  valid = rng.random(k) < 0.7
  out = []
  for j in range(k):
    order = permutation(g.n, (e, j))
    shown = tuple(int(truth[j][o]) for o in order)
    judgement = (Judgement(scores=shown, reason=None) if valid[j]
                 else Judgement(scores=None, reason="wrong_count"))
    out.append(SampledJudgement(prompt=GRMPrompt(text="", order=order), text="",
                                judgement=judgement, finished=True))
  return out, truth, valid


def _reference(truth, valid, ratings):
  """numpy: (strict, credit, tie) of summing the valid rows; credit is the expected
  correctness of a uniform tie-break among the top (1/n, or 1/10 for n == 1, with no
  valid row)."""
  r = np.asarray(ratings, np.float64)
  rows = truth[valid]
  if len(rows) == 0:
    return 0.0, 1.0 / (10 if r.size == 1 else r.size), 0.0
  if r.size == 1:
    ok = float(np.rint(rows.mean()) == r[0])
    return ok, ok, 0.0
  totals = rows.sum(0)
  top = [i for i in range(r.size) if totals[i] == totals.max()]
  best = int(np.argmax(r))
  return float(top == [best]), float(np.mean([t == best for t in top])), float(len(top) > 1)


@pytest.fixture(scope="module")
def bench():
  rng = np.random.default_rng(0)
  groups = _groups(rng, 60)
  k = 6
  greedy, many, truths, valids = [], [], [], []
  for e, g in enumerate(groups):
    greedy.append(_samples(rng, g, 1, (e, 9))[0])
    row, truth, valid = _samples(rng, g, k, e)
    many.append(row)
    truths.append(truth)
    valids.append(valid)
  meta = rng.normal(size=(len(groups), k))
  records = [ys.group_record("chat" if e % 2 else "code", g, greedy[e], many[e], meta[e])
             for e, g in enumerate(groups)]
  return groups, greedy, many, truths, valids, meta, json.loads(json.dumps(records))


def test_decisions_match_numpy_reference(bench):
  groups, _, _, truths, valids, meta, records = bench
  got = ys.record_decisions(records, (1, 3, 6))
  for e, g in enumerate(groups):
    for k in (1, 3, 6):
      strict, credit, tie = _reference(truths[e][:k], valids[e][:k], g.ratings)
      d = got[f"vote@{k}"][e]
      assert (d["strict"], d["credit"], d["tie"]) == (strict, credit, tie), (e, k)
      assert d["valid"] == valids[e][:k].mean()
      # Meta: the ceil(v/2) valid samples of highest meta score (ties: lower index).
      used = [j for j in range(k) if valids[e][j]]
      top = sorted(used, key=lambda j: (-meta[e, j], j))[:max(1, math.ceil(len(used) / 2))]
      keep = np.isin(np.arange(k), top)
      strict, credit, tie = _reference(truths[e][:k], keep, g.ratings)
      d = got[f"meta@{k}"][e]
      assert (d["strict"], d["credit"], d["tie"]) == (strict, credit, tie), (e, k)
  # Constructed so that every case occurs: ties, no valid sample, partial credit.
  credits = [d["credit"] for d in got["vote@3"]]
  assert any(0 < c < 1 for c in credits) and any(d["valid"] == 0 for d in got["vote@1"])


def test_records_recompute_the_strict_accuracy_voting_correctness_gives(bench):
  groups, greedy, many, _, _, meta, records = bench
  correct = ev.voting_correctness(groups, greedy, many, meta, (1, 3, 6))
  table = ys.recompute(records, (1, 3, 6), num_resamples=50)
  for name, values in correct.items():
    for part, keep in ((ys.MULTI, lambda n: n >= 2), (ys.SINGLE, lambda n: n == 1)):
      want = 100 * np.mean([v for v, g in zip(values, groups) if keep(g.n)])
      assert table[name][part]["strict"]["value"] == pytest.approx(want, abs=1e-9), name
  multi = [e for e, g in enumerate(groups) if g.n >= 2]
  valid_rate = np.mean([np.mean([s.judgement.valid for s in many[e][:3]]) for e in multi])
  assert table["vote@3"][ys.MULTI]["valid_rate"] == pytest.approx(valid_rate, abs=1e-12)
  assert table["vote@3"][ys.MULTI]["groups"] == len(multi)


def test_chance_is_mean_inverse_n_computed():
  ns = [1, 2, 2, 3, 4, 4, 4, 1]
  got = ys.chance(ns)
  p = np.array([1 / n for n in ns if n >= 2])
  assert got[ys.MULTI]["value"] == pytest.approx(100 * p.mean(), rel=1e-12)
  # SE of a uniform picker: Bernoulli(1/n) per group, independent.
  assert got[ys.MULTI]["se"] == pytest.approx(100 * np.sqrt(np.sum(p * (1 - p))) / p.size)
  assert got[ys.SINGLE]["value"] == pytest.approx(10.0) and got[ys.SINGLE]["groups"] == 2
  # A uniform random picker's mean accuracy converges to it (Monte Carlo, 4 SE).
  rng = np.random.default_rng(1)
  hits = np.mean([[rng.integers(n) == 0 for n in ns if n >= 2] for _ in range(4000)])
  assert abs(100 * hits - got[ys.MULTI]["value"]) < 4 * 100 * np.sqrt(
      np.mean(p * (1 - p)) / (4000 * p.size))


def test_most_common_rating_baseline():
  mk = lambda r, n=1: PreferenceGroup("math", "x", "train", "q", ("a",) * n, (r,) * n, ("",) * n)
  train = [mk(1), mk(1), mk(7), mk(7), mk(3), mk(0.5, 2)]
  assert ys.most_common_rating(train) == 1  # 1 and 7 tie twice each: the lower
  test = [mk(1), mk(2), mk(1), mk(0.5, 2)]
  assert ys.most_common_accuracy(test, 1, num_resamples=20).value == pytest.approx(100 * 2 / 3)
  with pytest.raises(ValueError, match="n == 1"):
    ys.most_common_rating([mk(0.5, 2)])


def test_content_blind_control_is_a_seeded_derangement_of_the_groups():
  groups = _groups(np.random.default_rng(3), 25)
  origin = {r: e for e, g in enumerate(groups) for r in g.responses}
  ctrl = ys.content_blind(groups, seed=7)
  assert len(ctrl) == len(groups)
  for e, (g, c) in enumerate(zip(groups, ctrl)):
    assert (c.query, c.ratings, c.reasons, c.n, c.example_id) == (g.query, g.ratings,
                                                                 g.reasons, g.n, g.example_id)
    assert all(origin[r] != e for r in c.responses), e  # never the group's own
  # A permutation of all response texts: each used exactly once.
  assert sorted(r for c in ctrl for r in c.responses) == sorted(origin)
  assert ys.content_blind(groups, seed=7) == ctrl  # deterministic
  assert ys.content_blind(groups, seed=8) != ctrl  # and the seed matters
  big = next(g for g in groups if g.n == 4)
  with pytest.raises(ValueError, match="content-blind"):  # 4 + 1 slots < 2 * 4
    ys.content_blind([big, next(g for g in groups if g.n == 1)], seed=0)


def test_meta_rm_trains_on_valid_judgements_only(bench):
  groups, _, many, truths, valids, _, _ = bench
  rows = meta_lib.training_rows(groups, many)
  want = []
  for e, g in enumerate(groups):
    r = np.asarray(g.ratings, np.float64)
    for j in np.flatnonzero(valids[e]):
      t = truths[e][j]
      if r.size == 1:
        ok = t[0] == r[0]
      else:  # the best strictly above every other
        best = int(np.argmax(r))
        ok = all(t[best] > t[i] for i in range(g.n) if i != best)
      want.append((many[e][j], float(ok)))
  assert rows == want
  assert len(rows) < sum(map(len, many))  # invalid ones were there, and left out
  assert 0 < sum(y for _, y in rows) < len(rows)


def _record(n, ratings, scores, valid):
  return {"n": n, "ratings": ratings,
          "samples": {"scores": scores, "valid": valid, "meta": [0.0] * len(valid)}}


def test_pair_agreement_against_a_hand_computed_case():
  records = [
      # n = 2, best first: the valid samples agree (5 > 3), tie (2 = 2), reverse (1 < 4): 1/2.
      _record(2, [1.0, 0.0], [[5, 3], [2, 2], [1, 4], [9, 1]], [True, True, True, False]),
      # n = 3, ratings (0.5, 0.5, 1): only the pairs with response 2 count; 3 > 1 and
      # 3 > 2 agree, the equal-rated pair (0, 1) is not a pair: 1.
      _record(3, [0.5, 0.5, 1.0], [[1, 2, 3]], [True]),
      _record(1, [4.0], [[4]], [True]),  # n = 1: no pair
      _record(2, [1.0, 0.0], [[7, 1]], [False]),  # no valid sample: left out
      _record(2, [0.5, 0.5], [[7, 1]], [True]),  # equal ratings: no pair, left out
  ]
  got = ys.pair_agreement(records, 4, num_resamples=200)
  assert got["groups"] == 2 and got["value"] == pytest.approx(100 * (0.5 + 1.0) / 2)
  # k = 1 keeps only each record's first sample: record 0 agrees (5 > 3).
  assert ys.pair_agreement(records, 1, num_resamples=200)["value"] == pytest.approx(100.0)
  # Two groups of values 0.5 and 1: the bootstrap SE of their mean is near the
  # population SD / sqrt(2) = 0.25 / sqrt(2) (x 100), within bootstrap noise.
  assert got["se"] == pytest.approx(100 * 0.25 / math.sqrt(2), rel=0.25)
  assert ys.pair_agreement(records[2:], 4) == {"value": None, "se": None, "groups": 0}
  with pytest.raises(ValueError, match="k=0"):
    ys.pair_agreement(records, 0)


def test_pair_agreement_is_half_for_scores_drawn_without_the_responses():
  """Scores drawn independently of the ratings agree on 50% of pairs in expectation;
  20,000 samples over 400 groups put the estimate within a few SE of 50."""
  rng = np.random.default_rng(0)
  records = []
  for _ in range(400):
    n = int(rng.integers(2, 5))
    ratings = rng.permutation(n).astype(float).tolist()
    records.append(_record(n, ratings, rng.integers(1, 11, (50, n)).tolist(),
                           (rng.random(50) < 0.6).tolist()))
  got = ys.pair_agreement(records, 50, num_resamples=200)
  assert got["groups"] == 400 and abs(got["value"] - 50.0) < 4 * got["se"]
  # And scores equal to the ratings' order agree everywhere.
  for r in records:
    r["samples"]["scores"] = [[int(x) + 1 for x in r["ratings"]]] * 50
  assert ys.pair_agreement(records, 50, num_resamples=200)["value"] == 100.0


def test_singles_of_and_join_singles_rebuild_each_groups_judgements_side_by_side():
  """Split judging: n >= 2 groups become n singles (each a well-formed n = 1 group whose
  rating is its reward's 1..10 rating), and the singles' records join back into one
  record per group whose sample j holds the singles' sample j, valid when all are."""
  from grm.data import rating_from_reward
  rng = np.random.default_rng(7)
  groups = _groups(rng, 30)
  singles = ys.singles_of(groups)
  multi = [e for e, g in enumerate(groups) if g.n >= 2]
  assert len(singles) == sum(groups[e].n for e in multi)
  pos = 0
  for e in multi:
    g = groups[e]
    for i in range(g.n):
      s = singles[pos + i]
      assert (s.n, s.query, s.responses) == (1, g.query, (g.responses[i],))
      assert s.ratings == (float(rating_from_reward(g.ratings[i])),)
    pos += g.n
  k = 3
  recs = [{"subset": "split", "n": 1, "ratings": list(s.ratings),
           "greedy": {"scores": [[int(rng.integers(1, 11))]], "valid": [bool(rng.random() < .8)]},
           "samples": {"scores": rng.integers(1, 11, (k, 1)).tolist(),
                       "valid": (rng.random(k) < 0.8).tolist(), "meta": rng.random(k).tolist()}}
          for s in singles]
  joined = ys.join_singles(groups, recs, subsets=[f"s{e}" for e in multi])
  assert len(joined) == len(multi)
  pos = 0
  for rec, e in zip(joined, multi):
    g, part = groups[e], recs[pos:pos + groups[e].n]
    pos += g.n
    assert (rec["n"], rec["ratings"], rec["subset"]) == (g.n, list(g.ratings), f"s{e}")
    assert rec["greedy"]["scores"] == [[p["greedy"]["scores"][0][0] for p in part]]
    assert rec["greedy"]["valid"] == [all(p["greedy"]["valid"][0] for p in part)]
    for j in range(k):
      assert rec["samples"]["scores"][j] == [p["samples"]["scores"][j][0] for p in part]
      assert rec["samples"]["valid"][j] == all(p["samples"]["valid"][j] for p in part)
      assert rec["samples"]["meta"][j] == pytest.approx(
          np.mean([p["samples"]["meta"][j] for p in part]))
  # the joined records feed the yardstick as any others do
  assert set(ys.recompute(joined, (1, k), num_resamples=50)["vote@3"]) == {ys.MULTI}
  with pytest.raises(ValueError, match="single records for"):
    ys.join_singles(groups, recs[:-1])
  with pytest.raises(ValueError, match="subset names for"):
    ys.join_singles(groups, recs, subsets=["x"])
