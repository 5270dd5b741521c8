"""Rollouts: the KV-cache sampler, episodes (single-turn, verified) and the
multi-turn environment loop."""
from opd.rollout import agent, episodes, sampler
from opd.rollout.agent import rollout_multi_turn
from opd.rollout.episodes import (Completion, Episode, as_key, batch_episodes, prompt_ids,
                                  rollout, sample, sampling_for_chat)
from opd.rollout.sampler import (SampleOutput, SamplingConfig, compiled_programs, filter_logits,
                                 generate, left_align)
