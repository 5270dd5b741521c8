"""grm.pairwise swap-averaging and the GENCLUSTER tournament's, against hand-computed cases;
the constrained call sites' patterns (grm.judge, grm.pairwise, grm.verify)."""
import re
import types

import numpy as np
import pytest

from grm import judge as judge_lib
from grm import pairwise as pw
from grm.format import format_judgement
from grm.gencluster import tournament as tn
from grm.verify.format import SCORE_PATTERN, parse_analysis
from opd.models import ModelConfig
from opd.rollout import Policy
from opd.rollout.episodes import Completion, sampling_for_chat
from opd.text.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def test_swap_average_hand_computed():
  first = [0, 1, 0, -1, -1, 1]
  second = [0, 0, -1, 1, -1, 1]
  # agree on 0 -> 0; disagree -> 1/2; one valid order -> its pick; none -> NaN.
  np.testing.assert_array_equal(pw.swap_average(first, second), [0, 0.5, 0, 1, np.nan, 1])
  with pytest.raises(ValueError, match="first"):
    pw.swap_average([0, 2], [0, 0])


def _always(letter):
  return lambda prompt_text: f"critique\nBetter: {letter}"


def _reads_content(prompt_text):
  """Prefers the response containing "good"; else answers A (position)."""
  a = prompt_text.split("[Response A]")[1].split("[End of Response A]")[0]
  b = prompt_text.split("[Response B]")[1].split("[End of Response B]")[0]
  return "Better: " + ("A" if "good" in a else "B" if "good" in b else "A")


def _fake_sample_rows(judge):
  def sample_rows(policy, ids, seed, sampling, **kwargs):
    return [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True,
                       judge(policy.tokenizer.decode(row))) for row in ids]
  return sample_rows


def test_judge_pairs_both_orders_cancels_a_pure_position_bias(monkeypatch):
  pairs = [("q", f"x{e}", f"y{e}") for e in range(12)]
  cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1,
                    d_ff=8)
  sampling = sampling_for_chat(TOK, max_new_tokens=8)
  monkeypatch.setattr(pw, "sample_rows", _fake_sample_rows(_always("A")))
  got = pw.judge_pairs_both_orders(Policy(cfg, None, TOK), pairs, seed=3, sampling=sampling)
  # Always "A": each order prefers what it shows first, so the verdicts split.
  np.testing.assert_array_equal(got.share, np.full(12, 0.5))
  assert got.stats == {"a_rate_before": 1.0, "a_rate_after": 0.5, "split_rate": 1.0}
  assert len(got.judgements) == 24
  # A judge that reads the content: the second response ("good") wins every pair, in
  # both orders; "A" half the time before (the mirror flips the letters), and after
  # the credit of the first-shown A is 1 exactly where the seeded order showed y first.
  pairs = [("q", f"x{e}", f"good y{e}") for e in range(12)]
  monkeypatch.setattr(pw, "sample_rows", _fake_sample_rows(_reads_content))
  got = pw.judge_pairs_both_orders(Policy(cfg, None, TOK), pairs, seed=3, sampling=sampling)
  np.testing.assert_array_equal(got.share, np.ones(12))
  swapped = [pw.build_pairwise_prompt(q, a, b, seed=(3, e)).swapped
             for e, (q, a, b) in enumerate(pairs)]
  assert 0 < sum(swapped) < 12
  assert got.stats == {"a_rate_before": 0.5, "a_rate_after": float(np.mean(swapped)),
                       "split_rate": 0.0}
  # The seeded order alone is judge_pairs' single-order verdict.
  single, _ = pw.judge_pairs(Policy(cfg, None, TOK), pairs, seed=3, sampling=sampling)
  np.testing.assert_array_equal(got.first, single)
  np.testing.assert_array_equal(got.swapped, swapped)


def test_tournament_both_orders_hand_computed():
  reps = ["good one", "bad", "worse"]
  sizes = [1, 3, 2]
  ms = tn.matches("q", reps, seed=5, both_orders=True)
  assert [(m.i, m.j, m.mirror) for m in ms] == [(0, 1, False), (0, 1, True), (0, 2, False),
                                                (0, 2, True), (1, 2, False), (1, 2, True)]
  texts = [_reads_content(m.prompt.text) for m in ms]
  r = tn.rank(sizes, ms, texts)
  # Cluster 0 wins both its games in both orders (1 each); (1, 2) is decided by
  # position only, so the orders split it: 1/2 each.
  assert r.wins == (2.0, 0.5, 0.5)
  assert r.order == (0, 1, 2)  # 1 and 2 tie on wins; size 3 before size 2
  assert (r.judged, r.valid) == (6, 6)
  bias = tn.position_bias(ms, texts)
  sw = {(m.i, m.j): m.prompt.swapped for m in ms if not m.mirror}
  # Before: (0,1) and (0,2) answer A in one of their two orders, (1,2) in both: 4 of 6.
  # After: cluster 0 gets credit 1, so the first-shown A gets 1 iff it was cluster 0.
  want_after = (float(not sw[0, 1]) + float(not sw[0, 2]) + 0.5) / 3
  assert bias == {"a_rate_before": 4 / 6, "a_rate_after": pytest.approx(want_after),
                  "split_rate": 1 / 3}
  # Two tournaments (e.g. two subtasks) with the same cluster indices: with owners
  # each keeps its own games, and the pooled stats are over both; without owners
  # their games would share keys, which is refused rather than miscounted.
  ms2 = tn.matches("q2", reps, seed=6, both_orders=True)
  texts2 = ["Better: A"] * len(ms2)
  pooled = tn.position_bias(ms + ms2, texts + texts2, owners=[0] * len(ms) + [1] * len(ms2))
  sw2 = [m.prompt.swapped for m in ms2 if not m.mirror]
  after = ([float(not sw[0, 1]), float(not sw[0, 2]), 0.5] + [0.5] * len(sw2))
  assert pooled == {"a_rate_before": (4 + len(ms2)) / 12,
                    "a_rate_after": pytest.approx(np.mean(after)), "split_rate": 4 / 6}
  with pytest.raises(ValueError, match="mix mirrored"):
    tn.position_bias(ms + ms2, texts + texts2)
  # A pure "A" judge: every game splits and size alone orders the clusters.
  always_a = tn.rank(sizes, ms, ["Better: A"] * len(ms))
  assert always_a.wins == (1.0, 1.0, 1.0) and always_a.order == (1, 2, 0)
  # One order only: the old counting (one win per valid judgement).
  single = tn.matches("q", reps, seed=5)
  one = tn.rank(sizes, single, [_reads_content(m.prompt.text) for m in single])
  assert one.wins[0] == 2.0 and one.wins[1] + one.wins[2] == 1.0


def test_constrained_patterns_accept_exactly_valid_last_lines():
  for n in (1, 2, 4):
    pattern = judge_lib.score_pattern(n)
    assert re.fullmatch(pattern, format_judgement(["p"], "c\nd", [10] * n))
    assert re.fullmatch(pattern, format_judgement(["p"], "c", list(range(1, n + 1))))
    assert not re.fullmatch(pattern, format_judgement(["p"], "c", [3] * (n + 1)))
    assert not re.fullmatch(pattern, "Critique:\nScores: \\boxed{" + ", ".join(["11"] * n) + "}")
  assert re.fullmatch(pw.SCORE_PATTERN, "it is fine\nBetter: B")
  assert not re.fullmatch(pw.SCORE_PATTERN, "Better: C")
  for text in ("No issues.\nScore: 0.5", "Line 1: wrong_final\nScore: 0",
               "No issues.\nScore: 1"):
    assert re.fullmatch(SCORE_PATTERN, text) and parse_analysis(text).score is not None
  assert not re.fullmatch(SCORE_PATTERN, "No issues.\nScore: 0.7")


def test_sample_judgements_constrained_gives_each_row_its_n(monkeypatch):
  seen = []

  def fake_sample(policy, prompts, rng, sampling, **kwargs):
    seen.append((kwargs["constraint"], list(kwargs["patterns"])))
    return [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True, "x")
            for _ in prompts]

  monkeypatch.setattr(judge_lib, "sample", fake_sample)
  cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1,
                    d_ff=8)
  groups = [("q", ("a", "b", "c")), ("q", ("a",)), ("q", ("a", "b"))]
  sampling = sampling_for_chat(TOK, max_new_tokens=8)
  judge_lib.sample_judgements(Policy(cfg, None, TOK), groups, k=2, seed=0, sampling=sampling,
                              chunking=judge_lib.Chunking(4, length_bucket=8), constrained=True)
  automaton = seen[0][0]
  assert automaton.patterns == tuple(judge_lib.score_pattern(n) for n in (1, 2, 3))
  # Chunks of 4 after the length sort: every row keeps its own group's n - 1.
  assert sorted(p for _, ps in seen for p in ps) == sorted([2, 2, 0, 0, 1, 1])
  assert all(c is automaton for c, _ in seen)


def test_other_call_sites_pass_their_pattern(monkeypatch):
  """The DeepSeekMath-V2 sampler, GENCLUSTER's judge and the GRM reward decode under
  their grammar when asked, and unconstrained by default."""
  from grm import reward as reward_lib
  from grm.gencluster import pipeline
  from grm.verify import sampling as verify_sampling
  cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1,
                    d_ff=8)
  sampling = sampling_for_chat(TOK, max_new_tokens=8)
  seen = []

  def fake_sample(policy, prompts, rng, sampling, **kwargs):
    seen.append(kwargs.get("constraint"))
    return [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True, "x")
            for _ in prompts]

  monkeypatch.setattr(verify_sampling, "sample", fake_sample)
  for constrained in (False, True):
    verify_sampling.sampler_fn(cfg, None, TOK, sampling, constrained=constrained)(["p"])
  assert seen[0] is None and seen[1].patterns == (SCORE_PATTERN,)
  assert set(seen[1].end_ids) == set(sampling.end_ids)
  monkeypatch.setattr("opd.rollout.policy.sample", fake_sample)
  for constrained in (False, True):
    pipeline.model_judge(Policy(cfg, None, TOK), sampling, batch_size=2,
                         constrained=constrained)(
        ["p"], 0)
  assert seen[2] is None and seen[3].patterns == (pw.SCORE_PATTERN,)
  flags = []

  def fake_judgements(*args, constrained, **kwargs):
    flags.append(constrained)
    raise StopIteration  # the flag is all this test reads

  monkeypatch.setattr(reward_lib, "sample_judgements", fake_judgements)
  episode = types.SimpleNamespace(example=types.SimpleNamespace(prompt="q"), turns=("a",))
  for constrained in (False, True):
    with pytest.raises(StopIteration):
      reward_lib.GRMReward(cfg, None, TOK, sampling=sampling, constrained=constrained)([episode])
  assert flags == [False, True]
