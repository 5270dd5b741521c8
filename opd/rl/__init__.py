"""Reinforcement learning: GRPO (loss, group advantages, scoring) on the shared loop."""
from opd.rl.grpo import GRPORun, PromptStream, reference_logprobs, train_grpo
from opd.rl.loss import (LOSS_AGGREGATIONS, LOSS_FIELDS, GRPOConfig, RewardFn, Score,
                         count_reason, group_advantages, grpo_loss, policy_loss, reward_metrics,
                         score_episodes, token_entropy)
