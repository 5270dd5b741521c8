"""Job ``grpo``: GRPO on task domains with the rule verifiers as rewards.

Starts from ``config.init`` (usually an SFT checkpoint), which is also the
frozen KL reference. Prompts are train-split examples of
``config.data.domains``; rewards come from the task verifiers (agent: the
layered reward of docs/DESIGN.md §8 with the weights in ``config.agent_reward``). See
``opd.rl.grpo.train_grpo`` for the metrics it logs.
"""
from __future__ import annotations

import logging
import pathlib

import numpy as np

from experiments import common
from opd.rl import grpo as grpo_lib
from opd.training.checkpoints import load_params
from opd.config.fields import from_group
from opd.config.overrides import config_to_dict
from opd.models import to_model_config
from opd.rl import GRPOConfig
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.metrics_writer import MetricWriter, read_metrics
from opd.tasks import AgentRewardConfig

from opd.tasks import domain_examples

log = logging.getLogger(__name__)


def grpo_config(group, where: str = "config.grpo") -> GRPOConfig:
  return from_group(GRPOConfig, group, where)


def agent_reward_config(group, where: str = "config.agent_reward") -> AgentRewardConfig:
  return from_group(AgentRewardConfig, group, where)


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  model_cfg = to_model_config(config.model)
  tok = common.tokenizer_for(model_cfg, workdir)
  mesh, rules = common.mesh_and_rules(config)
  if not config.init:
    raise ValueError("config.init must name a checkpoint directory to start GRPO from "
                     "(e.g. an SFT run's WORKDIR/checkpoints)")
  params = load_params(config.init, model_cfg, mesh=mesh, rules=rules)
  cfg = grpo_config(config.grpo)
  prompts = domain_examples(tuple(config.data.domains), "train", config.data.num_prompts,
                            config.seed, tuple(config.data.difficulties))
  workdir = pathlib.Path(workdir)
  with MetricWriter(workdir) as writer:
    out = grpo_lib.train_grpo(
        model_cfg, common.lora_student(params, config.get("lora"), "config.lora",
                                       base_checkpoint=config.init),
        params if cfg.kl_coef > 0 else None, prompts, cfg,
        common.optim_config(config.optim),
        LoopConfig(config.train.steps, save_every=config.train.save_every,
                   keep_checkpoints=config.train.keep_checkpoints),
        RunIO(writer=writer, checkpoint_dir=workdir / "checkpoints",
              config={"experiment": config_to_dict(config)}),
        runtime=Runtime(mesh, rules, seed=config.seed, tokenizer=tok),
        extras=grpo_lib.GRPOExtras(agent_config=agent_reward_config(config.agent_reward)))
  # The whole run's rewards from its metrics.jsonl: on a resume the loop cuts
  # the log back to the checkpoint and continues it, so it holds each step once,
  # as an uninterrupted run's does; out.history holds only this launch's steps
  # (it is the fallback on a process that writes no log).
  log_rows = read_metrics(writer.jsonl_path) if writer.jsonl_path.exists() else out.history
  rewards = [m["reward/mean"] for m in log_rows if "reward/mean" in m]
  k = max(1, min(5, len(rewards) // 3))
  plot = common.plot_curves(workdir, keys=("reward/mean",), title="GRPO reward",
                            filename="reward.png")
  return {"steps": config.train.steps, "updates": int(out.state.step), "reward_first": float(np.mean(rewards[:k])),
          "reward_last": float(np.mean(rewards[-k:])), "wall_s": timer.seconds,
          "plot": str(plot or "")}
