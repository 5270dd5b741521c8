"""Job-start checks: every config group a job will read, validated before any work.

``experiments.launch`` calls ``experiments.jobs.validate(config)`` before it
records the config and starts the job, and that runs the check registered for
``config.job`` here. A pipeline's check covers the configs of all its stages,
so a bad value of a late stage (OPD's loss options after the specialists, the
GRM benchmark's ``ks`` after every GRM stage) fails at the start, not after
hours of earlier stages. Each check builds the same typed configs the job will
build (``from_group``: their ``__post_init__`` validation) and checks the
training batches against the mesh's batch shards
(``opd.parallel.sharding.check_batch_divisible``), naming the config field.
"""
from __future__ import annotations

import pathlib

from experiments import common
from opd.config.fields import from_group
from opd.parallel import sharding


def _batch(batch_size, config, field: str) -> None:
  """``batch_size`` (a global training batch) against ``config.mesh``'s batch shards."""
  mesh, rules = common.mesh_and_rules(config)
  sharding.check_batch_divisible(batch_size, mesh, rules, field=field)


def check_lm(config, where: str = "config") -> None:
  """Pre-training and SFT: the optimizer and ``train.batch_size`` against the mesh."""
  common.optim_config(config.optim, f"{where}.optim")
  _batch(config.train.batch_size, config, f"{where}.train.batch_size")


def check_grpo(config, where: str = "config", group: str = "grpo",
               optim: str = "optim") -> None:
  """GRPO: its config, optimizer and episode batch (prompts_per_step x group_size)."""
  from experiments.grpo import grpo_config  # noqa: PLC0415
  cfg = grpo_config(config[group], f"{where}.{group}")
  common.optim_config(config[optim], f"{where}.{optim}")
  _batch(cfg.batch_size, config, f"{where}.{group}.prompts_per_step * {where}.{group}.group_size "
         f"(= {cfg.prompts_per_step} * {cfg.group_size})")


def check_opd(config, where: str = "config", optim: str = "config.optim") -> None:
  """OPD: ``OPDConfig`` and its loss options, the optimizer, the episode batch.
  ``optim`` names the field the stage's optimizer group came from."""
  from opd.distill import OPDConfig  # noqa: PLC0415
  cfg = from_group(OPDConfig, config.opd, f"{where}.opd")
  cfg.loss_config()
  common.optim_config(config.optim, optim)
  _batch(cfg.batch_size, config, f"{where}.opd.prompts_per_step * {where}.opd.group_size "
         f"(= {cfg.prompts_per_step} * {cfg.group_size})")


def check_cold_start(config, where: str = "config", optim: str = "config.optim") -> None:
  """The cold start's SFT: its optimizer and ``cold_start.batch_size`` against the mesh."""
  common.optim_config(config.optim, optim)
  _batch(config.cold_start.batch_size, config, f"{where}.cold_start.batch_size")


def check_specialists(config, where: str = "config") -> None:
  """Base pre-training, every domain's SFT and GRPO."""
  from experiments import specialists  # noqa: PLC0415
  specialists.check_per_domain(config)
  common.optim_config(config.base.optim, f"{where}.base.optim")
  _batch(config.base.train.batch_size, config, f"{where}.base.train.batch_size")
  common.optim_config(config.sft.optim, f"{where}.sft.optim")
  _batch(config.sft.train.batch_size, config, f"{where}.sft.train.batch_size")
  check_grpo(config, where, "grpo", "grpo_optim")


def check_baselines(config, where: str = "config") -> None:
  """The chosen baselines' groups: off-policy KD's config (its batch against the
  mesh) and optimizer, the RL baselines' GRPO config and optimizer."""
  from experiments import baselines  # noqa: PLC0415
  from opd.distill.offpolicy import OffPolicyConfig  # noqa: PLC0415
  chosen = tuple(config.baselines) if config.job == "baselines" else (config.job,)
  bad = [b for b in chosen if b not in baselines.RUNS]
  if not chosen or bad:
    raise ValueError(f"{where}.baselines={chosen!r}: expected some of {tuple(baselines.RUNS)}")
  if "offpolicy_kd" in chosen:
    cfg = from_group(OffPolicyConfig, config.offpolicy, f"{where}.offpolicy")
    common.optim_config(config.kd_optim, f"{where}.kd_optim")
    _batch(cfg.batch_size, config, f"{where}.offpolicy.batch_size")
  if {"mixed_rl", "sequential_rl"} & set(chosen):
    check_grpo(config, where, "grpo", "rl_optim")


def check_compat(config) -> None:
  """Both bases, the teachers' SFT and GRPO, the student's SFT and both OPD arms."""
  from experiments import compat  # noqa: PLC0415
  for group in ("base", "sft", "student_sft"):
    common.optim_config(config[group].optim, f"config.{group}.optim")
    _batch(config[group].train.batch_size, config, f"config.{group}.train.batch_size")
  check_grpo(config, "config", "grpo", "grpo_optim")
  check_opd(compat.opd_config(config, pathlib.Path("<workdir>"), compat.ARMS[0]), "config",
            "config.opd_optim")


def check_v4(config) -> None:
  """The specialists, every student stage's config as v4 will build it, the baselines."""
  from experiments import v4  # noqa: PLC0415
  check_specialists(config.specialists, "config.specialists")
  dirs = {d: "<specialist>" for d in config.specialists.domains}
  for stage in v4.STUDENT_STAGES:
    cfg = v4.student_stage_config(config, stage, dirs, "<init>", config.student_seeds[0])
    optim = {"cold_start": "config.cold_start_optim", "opd": "config.opd_optim"}.get(
        stage, "config.anneal_optim")
    (check_cold_start if stage == "cold_start" else check_opd)(cfg, "config", optim)
  check_baselines(config.baselines, "config.baselines")


def check_grm(config) -> None:
  """The GRM pipeline: the benchmark's voting k's (its last stage)."""
  from experiments import grm  # noqa: PLC0415
  grm.check_benchmark(config)
