"""The agent's full layered reward: a GRM layer and a rule-based user simulator (docs/DESIGN.md §8, §6).

``opd.tasks.agent_task.layered_reward`` already combines the rule layers
(format, execution, step, final answer) with ``grm`` and ``user`` scores the
caller supplies. This module supplies them, since ``opd`` never imports
``grm``:

  grm   a GRM's pointwise judgement of the episode's assistant turns, in
        [0, 1] (``grm.reward.GRMReward``, one batched call per GRPO batch);
  user  ``user_satisfaction``: a rule-based user who knows the answer and
        weighs it against the effort the episode cost::

          user = 0.5 · correct + 0.3 · efficiency + 0.2 · clean

        correct     1 iff the episode ended with the expected answer;
        efficiency  min(1, needed / assistant turns) once answered (0
                    otherwise), needed = required steps + 1 (the answer);
        clean       share of tool calls that did not fail (1 with no call)
                    once answered, 0 otherwise.

``SEED_WEIGHTS`` are the seed's weights 30/25/20/15/10 (format, execution,
step, GRM, user; the final answer counts through the user and the GRM).
``AgentLayeredReward`` is a GRPO ``reward_fn`` that replays each agent
episode in a fresh environment and scores it with those layers.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from opd.rollout.episodes import Episode
from opd.tasks import AgentRewardConfig, Reward, get_task
from opd.tasks.agent_task import AgentTask, Trajectory, layered_reward

__all__ = ["SEED_WEIGHTS", "USER_WEIGHTS", "AgentLayeredReward", "replay", "user_satisfaction"]

SEED_WEIGHTS = AgentRewardConfig(format=0.30, execution=0.25, step=0.20, final_answer=0.0,
                                 grm=0.15, user=0.10)
USER_WEIGHTS = {"correct": 0.5, "efficiency": 0.3, "clean": 0.2}


def user_satisfaction(traj: Trajectory) -> float:
  """The simulated user's satisfaction in [0, 1] (module docstring)."""
  answered = traj.end_reason == "answered" and traj.answer is not None
  correct = float(answered and layered_reward(traj, AgentRewardConfig()).components[
      "final_answer"] == 1.0)
  needed = len(traj.example.meta["steps"]) + 1
  efficiency = min(1.0, needed / len(traj.turns)) if answered else 0.0
  calls = traj.tool_records
  clean = (sum(c.ok for c in calls) / len(calls) if calls else 1.0) if answered else 0.0
  w = USER_WEIGHTS
  return w["correct"] * correct + w["efficiency"] * efficiency + w["clean"] * clean


def replay(example, turns: Sequence[str], config: AgentRewardConfig) -> Trajectory:
  """The trajectory of ``turns`` (assistant texts) replayed in a fresh
  ``AgentEnv`` (turns after the episode ends are ignored)."""
  env = AgentTask(config).make_env()
  env.reset(example)
  for text in turns:
    env.step(text)
    if env.trajectory.done:
      break
  return env.trajectory


class AgentLayeredReward:
  """GRPO ``reward_fn`` for agent episodes: the rule layers, the GRM and the user.

  Args:
    grm_fn: ``grm_fn(episodes) -> [B]`` scores in [0, 1] (e.g.
      ``lambda eps: [r.reward for r in GRMReward(...)(eps)]``), called once
      per batch; None only when ``config.grm == 0``.
    config: the layer weights (default ``SEED_WEIGHTS``).
  """

  def __init__(self, grm_fn: Callable[[Sequence[Episode]], Sequence[float]] | None,
               config: AgentRewardConfig = SEED_WEIGHTS):
    if not isinstance(config, AgentRewardConfig):
      raise ValueError(f"config must be an AgentRewardConfig, got {type(config).__name__}")
    if grm_fn is None and config.grm > 0:
      raise ValueError(f"AgentRewardConfig.grm={config.grm} > 0 needs a grm_fn")
    self.grm_fn, self.config = grm_fn, config

  def __call__(self, episodes: Sequence[Episode]) -> list[Reward]:
    episodes = list(episodes)
    for i, ep in enumerate(episodes):
      if not isinstance(get_task(ep.example.domain), AgentTask):
        raise ValueError(f"episodes[{i}] is a {ep.example.domain!r} episode, not an agent one")
    grm = None
    if self.grm_fn is not None:
      grm = np.asarray(self.grm_fn(episodes), np.float64)
      if grm.shape != (len(episodes),):
        raise ValueError(f"grm_fn returned shape {grm.shape}, expected ({len(episodes)},)")
    out = []
    for i, ep in enumerate(episodes):
      traj = replay(ep.example, ep.turns, self.config)
      out.append(layered_reward(traj, self.config, grm=None if grm is None else float(grm[i]),
                                user=user_satisfaction(traj)))
    return out
