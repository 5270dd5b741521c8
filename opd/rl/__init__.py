"""Reinforcement learning: GRPO as a rollout source plus a loss on the shared training loop.

``config`` (GRPOConfig), ``advantages`` (group-normalised, host numpy),
``scoring`` (episodes -> rewards and their metrics, host), ``loss`` (the
jitted clipped objective), ``rollout_source`` (GRPO's batches, on ``opd.rollout.batches``)
``grpo`` (``train_grpo``, their composition into ``opd.training.loop``) and
``sequential`` (GRPO on one domain after another, a baseline).
"""
from opd.rl import advantages, config, grpo, loss, rollout_source, scoring, sequential
from opd.rl.advantages import group_advantages
from opd.rl.config import LOSS_AGGREGATIONS, LOSS_FIELDS, GRPOConfig
from opd.rl.grpo import GRPOExtras, GRPORun, train_grpo
from opd.rl.loss import check_batch, make_grpo_loss, policy_loss, token_entropy
from opd.rl.rollout_source import GRPOSource, make_reference_fn, reference_logprobs
from opd.rl.scoring import RewardFn, Score, count_reason, reward_metrics, score_episodes
from opd.rl.sequential import SequentialRun, train_sequential_grpo
