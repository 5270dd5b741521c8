"""grm.verify.search: pool, keep, pair and refine bookkeeping with scripted callables."""
import re

import pytest

from grm.verify.search import SearchConfig, search

# Initial proof qualities g per problem; the scripted verifier scores a proof from its g.
START = {"q0": [0, 2, 1, 0], "q1": [3, 0, 0, 0], "q2": [4, 2]}
ANALYSES = {
    0: ["Line 1: wrong_step\nScore: 0", "garbage"],                          # mean 0
    1: ["Line 1: wrong_step\nScore: 0", "Line 1: missing_step\nScore: 0.5"],  # mean 0.25
    2: ["Line 1: missing_step\nScore: 0.5", "No issues.\nScore: 1"],          # mean 0.75
    4: ["No issues.\nScore: 1", "garbage"],                                    # mean 0.5
}
PERFECT = ["No issues.\nScore: 1"] * 2                                        # g >= 3: mean 1


def _scripted(improve):
  calls = {"generate": [], "verify": []}
  made = {"n": 0}

  def proof(q, g):
    made["n"] += 1
    return f"{q} g={g} t={made['n']}\nAnswer: 1"

  def generate_fn(prompts):
    calls["generate"].append(len(prompts))
    out, seen = [], {}
    for p in prompts:
      q = p.split("\n")[0]
      m = re.search(r"Previous derivation:\n\S+ g=(\d+)", p)
      if m is None:                       # a first generation
        g = START[q][seen.get(q, 0)]
        seen[q] = seen.get(q, 0) + 1
      else:                               # a refinement: one better (or not)
        g = int(m.group(1)) + improve
      out.append(f"{proof(q, g)}\nSelf-evaluation:\nNo issues.\nScore: 1")
    return out

  def verify_fn(prompts):
    calls["verify"].append(len(prompts))
    out, seen = [], {}
    for p in prompts:
      g = int(re.search(r"1\| \S+ g=(\d+)", p).group(1))
      key = re.search(r"1\| (.*)", p).group(1)
      j = seen.get(key, 0)
      seen[key] = j + 1
      out.append(ANALYSES.get(g, PERFECT)[j])
    return out

  return generate_fn, verify_fn, calls


def g_of(cand):
  return int(re.search(r"g=(\d+)", cand.proof).group(1))


def test_search_bookkeeping():
  generate_fn, verify_fn, calls = _scripted(improve=1)
  config = SearchConfig(n_candidates=4, n_analyses=2, n_keep=2, n_rounds=3)
  r0, r1 = search(["q0", "q1"], generate_fn, verify_fn, config)
  # q0, round 0: means [0, .75, .25, 0] -> keep 1 (g=2), 2 (g=1). Pairs (n_candidates //
  # n_keep = 2 per kept candidate): 1 has one issue-reporting analysis, 2 has two -> 3
  # children: 4 (parent 1, g=3), 5 and 6 (parent 2, g=2). Round 1 verifies only 4, 5, 6:
  # means 1, .75, .75 -> keep 4, then 1 (a tie at .75 goes to the older id). Best 1: stop.
  assert [c.mean for c in r0.candidates] == [0.0, 0.75, 0.25, 0.0, 1.0, 0.75, 0.75]
  assert [(c.id, c.parent, c.round, g_of(c)) for c in r0.candidates[4:]] == [
      (4, 1, 1, 3), (5, 2, 1, 2), (6, 2, 1, 2)]
  assert [(rr.round, rr.pool, rr.kept, rr.best_mean) for rr in r0.rounds] == [
      (0, (0, 1, 2, 3), (1, 2), 0.75), (1, (1, 2, 4, 5, 6), (4, 1), 1.0)]
  assert r0.best.id == 4 and r0.lineage(4) == [1, 4] and r0.lineage(0) == [0]
  # q1 has a perfect candidate at once: one round, nothing refined.
  assert [(rr.round, rr.kept, rr.best_mean) for rr in r1.rounds] == [(0, (0, 1), 1.0)]
  assert len(r1.candidates) == 4 and r1.best.id == 0
  # One batched call per stage: 8 first generations, 16 analyses, 3 refinements, 6 analyses.
  assert calls == {"generate": [8, 3], "verify": [16, 6]}
  # The analyses are kept with their candidate, verified once.
  assert r0.candidates[1].analysis_texts == ANALYSES[2]


def test_search_stops_at_the_round_limit():
  generate_fn, verify_fn, calls = _scripted(improve=0)
  config = SearchConfig(n_candidates=4, n_analyses=2, n_keep=2, n_rounds=2, n_pairs=1)
  (r0,) = search(["q0"], generate_fn, verify_fn, config)
  # No refinement helps: rounds 0, 1, 2 run; each kept candidate gets one child per round.
  assert [rr.round for rr in r0.rounds] == [0, 1, 2]
  assert calls["generate"] == [4, 2, 2] and calls["verify"] == [8, 4, 4]
  assert all(c.parent is None or r0.candidates[c.parent].round < c.round for c in r0.candidates)
  assert r0.best.mean == 0.75


def test_an_invalid_analysis_counts_zero_in_the_mean():
  generate_fn, verify_fn, _ = _scripted(improve=1)
  (r2,) = search(["q2"], generate_fn, verify_fn,
                 SearchConfig(n_candidates=2, n_analyses=2, n_keep=1, n_rounds=0))
  # g=4: (1 + 0) / 2 = 0.5 < g=2: (0.5 + 1) / 2 = 0.75; skipping the invalid one would give 1.
  assert [c.mean for c in r2.candidates] == [0.5, 0.75] and r2.best.id == 1


def test_config_is_validated():
  with pytest.raises(ValueError, match="n_keep"):
    SearchConfig(n_candidates=2, n_keep=3)
  with pytest.raises(ValueError, match="n_analyses"):
    SearchConfig(n_analyses=0)
  assert SearchConfig(n_candidates=64, n_keep=8).pairs == 8
