"""Host-side scoring of GRPO rollouts (opd/rl/scoring.py): every reward_fn output
form, isolated failures, and the per-batch reward metrics against numpy."""
import math

import numpy as np
import pytest

from opd import rollout as rollout_lib
from opd.rl.scoring import Score, reward_metrics, score_episodes
from opd.tasks import Example, Reward, RewardStats


def _episode(i, reward=None):
  ex = Example("bandit", f"e{i}", "train", 1, "p", (("assistant", "a"),), {})
  return rollout_lib.Episode(ex, np.array([1, 2], np.int32), np.array([97 + i], np.int32),
                             np.ones(1, bool), np.zeros(1, np.float32), ["x"], False, reward)


def test_score_episodes_isolates_failures_and_reads_every_output_form():
  eps = [_episode(i) for i in range(4)]

  def flaky(batch):
    if any(ep.example.id == "e1" for ep in batch):
      raise RuntimeError("sandbox down")
    return [np.nan if ep.example.id == "e3" else 0.5 for ep in batch]

  stats = RewardStats()
  scores = score_episodes(eps, flaky, stats=stats)
  assert [s.reward for s in scores] == [0.5, 0.0, 0.5, 0.0]
  assert scores[1].reason.startswith("verifier_error:RuntimeError: sandbox down")
  assert scores[3].reason == "verifier_error:non-finite reward"
  assert stats.total == 4 and stats.errors == 2 and stats.reasons["ok"] == 2

  named = lambda batch: {"correct": [1.0] * len(batch), "style": [0.25] * len(batch)}
  assert score_episodes(eps, named)[0] == Score(1.25, {"correct": 1.0, "style": 0.25})

  def columns(batch):
    return np.tile([[2.0, -1.0]], (len(batch), 1))
  columns.component_names = ("grm", "length_penalty")
  assert score_episodes(eps, columns)[2] == Score(1.0, {"grm": 2.0, "length_penalty": -1.0})

  verdicts = lambda batch: [Reward(0.75, 1.0, {"layer": 0.5}, "partial") for _ in batch]
  assert score_episodes(eps, verdicts)[0] == Score(0.75, {"format": 1.0, "layer": 0.5}, "partial")
  # Default: the verifier's Reward attached by rollout.
  eps[0].reward = Reward(1.0, 1.0, {}, "ok")
  with pytest.raises(ValueError, match=r"episodes \[1, 2, 3\] have no reward"):
    score_episodes(eps)
  wrong_length = lambda batch: [1.0, 2.0, 3.0]
  assert all(s.reason.startswith("verifier_error:ValueError") for s in
             score_episodes(eps[:2], wrong_length))


def test_reward_metrics_group_consecutive_rows_by_prompt():
  """Rows p*G..p*G+G-1 are one group: ``groups/zero_std_fraction`` counts
  the groups whose rewards are all equal, computed here per group."""
  G = 3
  rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 2.0, 0.0, 0.0]
  eps = [_episode(i) for i in range(len(rewards))]
  scores = [Score(r, {"c": 2 * r}) for r in rewards]
  got = reward_metrics(scores, eps, G)
  groups = np.reshape(rewards, (-1, G))
  assert got["groups/zero_std_fraction"] == np.mean([len(set(g)) == 1 for g in groups]) == 0.5
  # Rewards are multiples of 1/2 and their mean is 0.625: every sum, deviation
  # and square is exact in binary, leaving only the correctly rounded division
  # and sqrt, the same on both sides: equal exactly.
  mean = sum(rewards) / len(rewards)
  std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
  assert mean == 0.625
  assert got["reward/mean"] == got["reward/domain/bandit/mean"] == mean
  assert got["reward/std"] == std
  assert got["reward/components/c/mean"] == 2 * mean
  assert got["response/policy_tokens"] == len(rewards)
  with pytest.raises(ValueError, match="12 scores do not split into groups of 5"):
    reward_metrics(scores, eps, 5)
