"""Rollouts: the KV-cache sampler, episodes (single-turn, verified), the
multi-turn environment loop and the rollout batches every on-policy trainer
builds (``batches``: prompt streams, ``RolloutConfig``, training arrays)."""
from opd.rollout import agent, batches, episodes, policy, sampler
from opd.rollout.agent import rollout_multi_turn
from opd.rollout.batches import (DomainBalancedStream, PromptPosition, PromptStream,
                                 RolloutConfig, draw_prompts, fit_episode, prompt_problem,
                                 prompt_stream, sample_groups, training_arrays, training_length)
from opd.rollout.episodes import RolloutLog, batch_episodes, rollout, with_agent_config
from opd.rollout.policy import (Completion, Episode, Policy, as_key, prompt_ids, sample,
                                sampling_for_chat)
from opd.rollout.sampler import (SampleOutput, SamplingConfig, compiled_programs, filter_logits,
                                 generate, left_align)
