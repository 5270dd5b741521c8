"""grm.verify.rewards against numpy references written from the formulas of docs/DESIGN.md §7."""
import numpy as np
import pytest

from grm.verify.format import parse_analysis, parse_generation
from grm.verify.rewards import (GeneratorReward, faithfulness, generator_reward,
                                generator_reward_from_parsed, r_score, verifier_reward,
                                verifier_reward_from_parsed)
from opd.tasks.proof_task import Issue, ProofCheck

S = np.array([0.0, 0.5, 1.0])


def _batch(seed, B=64):
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 2, B).astype(float), rng.choice(S, B), rng.choice(S, B),
          rng.choice(S, B), rng.choice(S, B))


@pytest.mark.parametrize("seed", range(3))
def test_verifier_rewards_match_the_formulas(seed):
  fmt, pred, label, meta, _ = _batch(seed)
  ref = np.array([f * (1 - abs(p - l)) for f, p, l in zip(fmt, pred, label)])
  np.testing.assert_array_equal(r_score(pred, label), 1 - np.abs(pred - label))
  np.testing.assert_array_equal(verifier_reward(fmt, pred, label), ref)
  np.testing.assert_array_equal(verifier_reward(fmt, pred, label, meta), ref * meta)


@pytest.mark.parametrize("alpha,beta", [(0.76, 0.24), (0.5, 0.5), (1.0, 0.0)])
def test_generator_reward_matches_the_formula(alpha, beta):
  fmt, r_y, s_self, meta_z, label = _batch(7)
  # R = R_format (α R_Y + β R_Z), R_Z = (1 - |s' - s|) R_meta(Z); s = R_Y by default.
  want = fmt * (alpha * r_y + beta * (1 - np.abs(s_self - r_y)) * meta_z)
  got = generator_reward(fmt, r_y, s_self, meta_z, alpha=alpha, beta=beta)
  np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(np.float64).eps)
  want = fmt * (alpha * r_y + beta * (1 - np.abs(s_self - label)) * meta_z)
  got = GeneratorReward(alpha, beta)(fmt, r_y, s_self, meta_z, label)
  np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(np.float64).eps)
  assert GeneratorReward() == GeneratorReward(0.76, 0.24)


def test_invalid_samples_get_zero_not_nan_and_bad_shapes_raise():
  got = verifier_reward([0, 1], [np.nan, 1.0], [1.0, 0.5])
  np.testing.assert_array_equal(got, [0.0, 0.5])
  with pytest.raises(ValueError, match="label"):
    verifier_reward([1, 1], [1.0, 1.0], [1.0])
  with pytest.raises(ValueError, match="beta"):
    GeneratorReward(0.76, -0.1)


def test_rewards_from_parsed_texts():
  analyses = [parse_analysis(t) for t in ("No issues.\nScore: 1", "Line 2: wrong_step\nScore: 0",
                                          "garbage", "Line 1: missing_step\nScore: 0.5")]
  labels = [0.5, 0.0, 1.0, 1.0]
  # valid: 1-|1-.5| = .5, 1-|0-0| = 1, invalid 0, 1-|.5-1| = .5
  np.testing.assert_array_equal(verifier_reward_from_parsed(analyses, labels), [0.5, 1, 0, 0.5])
  np.testing.assert_array_equal(verifier_reward_from_parsed(analyses, labels, [1, 0.5, 1, 0]),
                                [0.5, 0.5, 0, 0])
  gens = [parse_generation(t) for t in ("1+1 = 2\nAnswer: 2\nSelf-evaluation:\nNo issues.\nScore: 1",
                                        "1+1 = 3\nAnswer: 3\nSelf-evaluation:\nNo issues.\nScore: 1",
                                        "Answer: 2")]
  r_y, meta_z = np.array([1.0, 0.0, 1.0]), np.array([1.0, 1.0, 1.0])
  # 1: .76*1 + .24*(1-|1-1|)*1 = 1; 2: .76*0 + .24*(1-|1-0|)*1 = 0; 3: no self-evaluation: 0.
  np.testing.assert_allclose(generator_reward_from_parsed(gens, r_y, meta_z), [1.0, 0.0, 0.0])


def test_faithfulness_counts_confirmed_stated_issues():
  checks = [ProofCheck((Issue(2, "wrong_step"), Issue(3, "wrong_final")), 0.0),
            ProofCheck((), 1.0), ProofCheck((Issue(1, "missing_step"),), 0.5)]
  analyses = [parse_analysis(t) for t in (
      "Line 2: wrong_step\nLine 3: wrong_step\nScore: 0",   # 1 of 2 (line 3 has wrong_final)
      "Line 1: bad_line\nScore: 0",                         # 0 of 1
      "Line 1: missing_step\nScore: 0.5")]                  # 1 of 1
  assert faithfulness(analyses, checks) == (2 / 4, 4)
  invalid = [parse_analysis("junk"), parse_analysis("No issues.\nScore: 1"), analyses[2]]
  assert faithfulness(invalid, checks) == (1.0, 1)
  share, stated = faithfulness([parse_analysis("No issues.\nScore: 1")], [checks[1]])
  assert np.isnan(share) and stated == 0
