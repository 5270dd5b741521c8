"""Rollouts: the KV-cache sampler and episodes (single-turn and multi-turn) with their verification."""
from opd.rollout import episodes, sampler
from opd.rollout.episodes import (Completion, Episode, batch_episodes, prompt_ids, rollout,
                                  rollout_agent, sample, sampling_for_chat)
from opd.rollout.sampler import SampleOutput, SamplingConfig, filter_logits, generate, left_align
