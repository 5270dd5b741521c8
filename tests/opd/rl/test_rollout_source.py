"""GRPO's batch source (opd/rl/rollout_source.py): the resumable prompt stream
and the bucketed training length."""
import numpy as np
import pytest

from opd.rl.config import GRPOConfig
from opd.rl.rollout_source import PromptStream, training_length
from opd.rollout.episodes import Episode
from opd.tasks import get_task


def test_prompt_stream_resumes_its_order():
  a = PromptStream(list(range(5)), seed=4)
  first = [next(a) for _ in range(7)]
  state = a.get_state()
  rest = [next(a) for _ in range(6)]
  b = PromptStream(list(range(5)), seed=4)
  b.set_state(state)
  assert [next(b) for _ in range(6)] == rest
  assert sorted(first[:5]) == list(range(5)) and first[:5] != list(range(5))
  with pytest.raises(ValueError, match="saved for 5 prompts, this stream has 3"):
    PromptStream([1, 2, 3]).set_state(state)


def test_training_length_buckets_to_the_longest_episode():
  ex = get_task("math").examples("train", 1)[0]

  def ep(p, r):
    return Episode(ex, np.zeros(p, np.int32), np.zeros(r, np.int32), np.ones(r, bool),
                   np.zeros(r, np.float32), ["x"], False)

  cfg = GRPOConfig(seq_len=192, max_new_tokens=48, length_bucket=32)
  assert training_length([ep(40, 10), ep(50, 20)], cfg) == 96    # 69 targets -> 96
  assert training_length([ep(60, 5)], cfg) == 64                  # 64 targets exactly
  assert training_length([ep(150, 48)], cfg) == 192               # capped at seq_len
  assert training_length([ep(40, 10)], cfg.replace(length_bucket=0)) == 192
