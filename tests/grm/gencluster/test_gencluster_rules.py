"""grm.gencluster: the 75% validator rule, cluster filtering, tournament determinism,
round-robin submission under a cap (docs/DESIGN.md §7). No sandbox, no model."""
import itertools

import numpy as np
import pytest

from grm import pairwise
from grm.gencluster import clustering, submission, tournament
from grm.gencluster.execution import EMPTY, Outputs
from grm.gencluster.inputs import keep_mask


# --- the 75% rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("V", [1, 2, 3, 4, 5, 8])
def test_keep_mask_is_the_75_percent_rule(V):
  # Every accept pattern of V validators on one input, as the columns of [V, 2^V].
  accepts = np.array(list(itertools.product([False, True], repeat=V)), bool).T
  share = accepts.mean(0)  # independent reference: the accepting share, compared directly
  np.testing.assert_array_equal(keep_mask(accepts), share >= 0.75)


def test_keep_mask_hand_cases():
  # 4 validators: 3 accept = 75% -> kept; 2 accept = 50% -> removed.
  # 3 validators: 2 accept = 66.7% -> removed (the rule is not a majority vote).
  four = np.array([[1, 1], [1, 1], [1, 0], [0, 0]], bool)
  assert keep_mask(four).tolist() == [True, False]
  three = np.array([[1], [1], [0]], bool)
  assert keep_mask(three).tolist() == [False]
  with pytest.raises(ValueError, match="accepts"):
    keep_mask(np.ones((3,), bool))


# --- cluster filtering --------------------------------------------------------------------------

def _ok(*values):
  return Outputs(tuple(f"ok:{v!r}" for v in values), None)


def test_cluster_groups_by_outputs_and_drops_errors_empty_and_failed_runs():
  outs = [
      _ok(1, 2, 3),                               # 0 \ same outputs: one cluster
      None,                                       # 1   not parsed: in no cluster
      _ok(1, 2, 4),                               # 2   its own cluster
      _ok(1, 2, 3),                               # 3 /
      Outputs(("ok:1", "error:ZeroDivisionError", "ok:3"), None),  # 4 error on one input
      Outputs(("ok:1", EMPTY, "ok:3"), None),     # 5 empty output on one input
      Outputs(None, "sandbox:wall_time"),         # 6 the run failed (a hang)
      Outputs(None, "sandbox:wall_time"),         # 7 same failure: clustered, dropped
  ]
  reasoning = [5, 0, 9, 20, 1, 1, 1, 1]
  kept, counts = clustering.cluster(outs, reasoning)
  # Kept: {0, 3} (size 2, longest reasoning first: 3 has 20 chars, 0 has 5) then {2}.
  assert [c.members for c in kept] == [(3, 0), (2,)]
  assert counts == {"clusters_all": 5, "clusters_dropped": 3, "candidates_dropped": 4,
                    "candidates_failed_run": 2}
  assert kept[0].key == clustering.output_hash(outs[0]) != kept[1].key


def test_cluster_order_ties_by_lowest_member():
  outs = [_ok(2), _ok(1), _ok(2), _ok(1)]
  kept, _ = clustering.cluster(outs, [0, 0, 0, 0])
  # Two clusters of size 2: {1, 3} and {0, 2}; the one holding candidate 0 comes first.
  assert [c.members for c in kept] == [(0, 2), (1, 3)]


def test_cluster_size_ties_go_by_lowest_candidate_index_not_by_the_first_listed_member():
  # {0, 3} and {1, 2}, both of size 2. Reasoning lengths list 3 first in the first cluster
  # (20 > 5) and 1 first in the second (9 > 4): ranking ties by the first-listed member
  # (3 vs 1) would put {1, 2} first; the rule is the lowest candidate index (0 vs 1).
  outs = [_ok(1), _ok(2), _ok(2), _ok(1)]
  kept, _ = clustering.cluster(outs, [5, 9, 4, 20])
  assert [c.members for c in kept] == [(3, 0), (1, 2)]
  # The larger cluster still comes first whatever its indices.
  kept, _ = clustering.cluster(outs + [_ok(2)], [5, 9, 4, 20, 0])
  assert [c.members for c in kept] == [(1, 2, 4), (3, 0)]


# --- tournament ---------------------------------------------------------------------------------

def _always_a(texts, seed):
  return ["looks fine\nBetter: A"] * len(texts)


def _fair(texts, seed):
  """Prefers the response holding "GOOD" wherever it is shown; else invalid."""
  out = []
  for t in texts:
    a = t.split("[Response A]")[1].split("[End of Response A]")[0]
    b = t.split("[Response B]")[1].split("[End of Response B]")[0]
    out.append("Better: A" if "GOOD" in a else "Better: B" if "GOOD" in b else "no idea")
  return out


REPS = ["def f(x): return x", "def f(x): return x+1  # GOOD", "def f(x): return 2*x",
        "def f(x): return x-1"]
SIZES = [5, 3, 2, 1]


def test_tournament_is_deterministic_under_a_seed_and_randomises_sides():
  r1 = tournament.run_tournament("q", REPS, SIZES, _always_a, seed=7)
  r2 = tournament.run_tournament("q", REPS, SIZES, _always_a, seed=7)
  assert r1 == r2
  # A judge that always says "A" picks the side the seeded coin put first:
  # the winner of pair (i, j) is j exactly when that pair was swapped.
  ms = tournament.matches("q", REPS, seed=7)
  expect = np.zeros(len(REPS), int)
  for m in ms:
    swapped = bool(np.random.default_rng((7, m.i, m.j, 0)).integers(2))  # build_pairwise_prompt's coin
    assert m.prompt.swapped == swapped
    expect[m.j if swapped else m.i] += 1
  assert list(r1.wins) == expect.tolist() and r1.valid == r1.judged == 6
  # Across seeds the sides differ (a fixed order would give one pattern for every seed).
  patterns = {tuple(m.prompt.swapped for m in tournament.matches("q", REPS, seed=s))
              for s in range(20)}
  assert len(patterns) > 1


def test_fair_judge_ranks_the_good_cluster_first_whatever_the_sides():
  for seed in range(5):
    r = tournament.run_tournament("q", REPS, SIZES, _fair, seed=seed)
    assert r.order[0] == 1 and r.wins[1] == 3
    # The other pairs are invalid: no wins, ties broken by size (input order).
    assert r.order[1:] == (0, 2, 3) and r.valid == 3 and r.judged == 6


def test_rank_maps_the_choice_back_through_the_swap():
  # One pair shown swapped: "Better: A" then means the original second one.
  prompt = pairwise.build_pairwise_prompt("q", "first", "second", seed=None)
  swapped = pairwise.PairwisePrompt(prompt.text, swapped=True)
  r = tournament.rank([1, 1], [tournament.Match(0, 1, 0, swapped)], ["Better: A"])
  assert r.wins == (0, 1) and r.order == (1, 0)


def test_judge_accuracy_counts_only_matches_with_one_correct_side():
  # Clusters 1 and 3 are correct. Informative pairs (one side correct): (0,1), (0,3), (1,2),
  # (2,3); (0,2) and (1,3) are not. The fair judge prefers "GOOD" (cluster 1 only), so it is
  # right on (0,1) and (1,2), invalid ("no idea") on (0,3) and (2,3): 2 of 4.
  correct = [False, True, False, True]
  ms = tournament.matches("q", REPS, seed=3)
  texts = _fair([m.prompt.text for m in ms], 3)
  assert tournament.judge_accuracy(ms, texts, correct) == (4, 2)
  # A judge naming the correct side wherever it is shown is right on all 4 for any seed;
  # naming the other side, on none: the swap is undone before scoring.
  for seed in range(5):
    ms = tournament.matches("q", REPS, seed=seed)
    side = lambda m, good: "A" if (correct[m.i] == good) != m.prompt.swapped else "B"  # noqa: E731
    assert tournament.judge_accuracy(ms, [f"Better: {side(m, True)}" for m in ms],
                                     correct) == (4, 4)
    assert tournament.judge_accuracy(ms, [f"Better: {side(m, False)}" for m in ms],
                                     correct) == (4, 0)
  assert tournament.judge_accuracy(ms, ["Better: A"] * len(ms), [True] * 4) == (0, 0)
  with pytest.raises(ValueError, match="judge texts"):
    tournament.judge_accuracy(ms, [], correct)


# --- submission ---------------------------------------------------------------------------------

def test_round_robin_order():
  assert submission.round_robin([[1, 2, 3], [4], [5, 6]]) == [1, 4, 5, 2, 6, 3]


def test_submit_hardest_first_round_robin_cap_and_skip_once_solved():
  # Three subtasks (0 easiest). Clusters per subtask, best first.
  ranked = [[[20, 21], [22]],            # subtask 0
            [[10], [11, 12]],            # subtask 1
            [[0, 1, 2], [3, 4], [5]]]    # subtask 2 (hardest)
  passes = {4: frozenset({0, 1, 2}), 12: frozenset({1}), 22: frozenset({0})}
  subs = submission.submit(ranked, passes, budget=50)
  # Subtask 2 round-robin: 0, 3, 5, 1, 4 (solves 0, 1, 2) -> everything solved, stop.
  assert [s.candidate for s in subs] == [0, 3, 5, 1, 4]
  assert {s.target for s in subs} == {2} and subs[-1].solved == {0, 1, 2}
  # Cap: at most `budget` submissions.
  assert [s.candidate for s in submission.submit(ranked, passes, budget=2)] == [0, 3]
  # Without candidate 4, subtask 2 is never solved: after its queue runs out the
  # loop moves to subtask 1 (10, 11, 12 solves it) then subtask 0 (20, 22 solves it).
  passes2 = {12: frozenset({1}), 22: frozenset({0})}
  subs2 = submission.submit(ranked, passes2, budget=50)
  assert [s.candidate for s in subs2] == [0, 3, 5, 1, 4, 2, 10, 11, 12, 20, 22]
  assert [s.target for s in subs2] == [2] * 6 + [1] * 3 + [0] * 2


def test_submit_skips_a_subtask_solved_by_a_submission_aimed_elsewhere():
  # Candidate 0 (aimed at subtask 1) also passes subtask 0: subtask 0 is never attacked.
  ranked = [[[5], [6]], [[0], [1]]]
  subs = submission.submit(ranked, {0: frozenset({0}), 1: frozenset({1})}, budget=50)
  assert [s.candidate for s in subs] == [0, 1]
  curve = submission.score_curve(subs, 2, 4)
  np.testing.assert_allclose(curve, [0.5, 1.0, 1.0, 1.0])


def test_submit_rejects_bad_budget():
  with pytest.raises(ValueError, match="budget"):
    submission.submit([], {}, budget=0)


# --- pipeline glue ------------------------------------------------------------------------------

def test_parse_candidates_drops_parse_and_compile_failures():
  from grm.gencluster import pipeline
  texts = ["def f(x): return x+1",
           "def f(x):\n  nonlocal y\n  return x",   # parses (ast) but does not compile
           "def f(x, y): return x",                 # wrong arity: a parse failure
           "print(1)"]
  srcs, counts = pipeline.parse_candidates(texts, 1)
  assert srcs == ["def f(x): return x+1", None, None, None]
  assert counts == {"parsed": 1, "dropped_parse": 2, "dropped_compile": 1}


def test_ranked_clusters_and_strategies():
  from grm.gencluster import pipeline
  cls = [clustering.Cluster(str(i), m) for i, m in enumerate([(0, 1, 2), (3, 4), (5,), (6,)])]
  r = tournament.Ranking(order=(2, 0, 1), wins=(1, 0, 2), judged=3, valid=3)
  # The tournament's 3 clusters in its order, then the rest by size.
  assert pipeline.ranked_clusters(cls, r, 3) == [[5], [0, 1, 2], [3, 4], [6]]
  assert pipeline.strategy_rankings("majority", candidates=range(7), clusters=cls,
                                    tournament_order=None, seed=0) == [[0, 1, 2]]
  rand = pipeline.strategy_rankings("random", candidates=list(range(7)), clusters=cls,
                                    tournament_order=None, seed=3)
  assert sorted(c for [c] in rand) == list(range(7))
  assert rand == pipeline.strategy_rankings("random", candidates=list(range(7)), clusters=cls,
                                            tournament_order=None, seed=3)
  with pytest.raises(ValueError, match="unknown strategy"):
    pipeline.strategy_rankings("best", candidates=[], clusters=cls, tournament_order=None, seed=0)


def test_mutate_constant_changes_one_literal():
  import random
  import re
  src = "def f(x): return x*12+3"
  for s in range(20):
    out = tournament.mutate_constant(src, random.Random(s))
    a, b = re.findall(r"\d+", src), re.findall(r"\d+", out)
    diff = [(u, v) for u, v in zip(a, b) if u != v]
    assert len(a) == len(b) and len(diff) == 1, out
    assert 1 <= abs(int(diff[0][1]) - int(diff[0][0])) <= 3 and int(diff[0][1]) >= 0
  assert tournament.mutate_constant("def f(xs): return sum(xs)", random.Random(0)) is None


def test_judge_sft_pairs_name_the_reference_side():
  from opd.tasks import get_task
  examples = get_task("code").examples("train", 12, seed=0, difficulty=1)
  pairs = tournament.judge_sft_pairs(examples, seed=0)
  assert len(pairs) == len(examples)  # every difficulty-1 reference has a literal
  sides = set()
  for ex, (text, target) in zip(examples, pairs):
    side = pairwise.parse_pairwise(target).choice
    shown = text.split(f"[Response {side}]\n")[1].split(f"\n[End of Response {side}]")[0]
    assert shown == ex.reference[-1][1]
    sides.add(side)
  assert sides == {"A", "B"}  # the coin puts the reference on both sides
