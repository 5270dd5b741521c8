"""Job-start checks: every config group a job will read, validated before any work.

``experiments.launch`` calls ``experiments.jobs.validate(config)`` before it
records the config and starts the job, and that runs the check registered for
``config.job`` here. A pipeline's check covers the configs of all its stages,
so a bad value of a late stage (OPD's loss options after the specialists, the
GRM benchmark's ``ks`` after every GRM stage) fails at the start, not after
hours of earlier stages. Each check builds the same typed configs the job will
build (``from_group``: their ``__post_init__`` validation) and checks the
training batches against the mesh's batch shards
(``opd.parallel.sharding.check_batch_divisible``), naming the config field,
and every trainer's learning-rate schedule against the steps it will run
(``check_schedule``: warmup <= steps; a decaying schedule's decay ends by the
last step), with the step count the job will use (per-domain overrides,
sequential RL's per-stage split).
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


def check_schedule(optim, steps: int, optim_field: str, steps_field: str, *,
                   decay: bool = True) -> None:
  """``optim`` (an ``OptimConfig``) against the ``steps`` its trainer will run.

  Args:
    optim: the stage's optimizer settings.
    steps: the optimizer updates the stage runs.
    optim_field, steps_field: the config fields they came from, for the errors.
    decay: also check that a decaying schedule (``cosine``/``linear``) ends by
      the last step. False where the stage borrows a schedule sized for another
      stage's steps (the distillation job's cold start runs ``config.optim``,
      OPD's schedule); only the warmup is checked there.

  Raises:
    ValueError: ``warmup_steps > steps`` (the run would end before the rate
      reaches ``lr``), or ``warmup_steps + decay_steps > steps`` with
      ``decay`` (the run would end before the rate reaches
      ``lr * end_lr_ratio``), naming both fields and their values.
  """
  warm = optim.warmup_steps
  if warm > steps:
    raise ValueError(f"{optim_field}.warmup_steps={warm} exceeds {steps_field}={steps}: the "
                     f"run would end before the warmup does (the rate never reaches "
                     f"{optim_field}.lr={optim.lr})")
  if decay and optim.schedule != "constant" and warm + optim.decay_steps > steps:
    raise ValueError(f"{optim_field}.warmup_steps + {optim_field}.decay_steps (= {warm} + "
                     f"{optim.decay_steps}) exceeds {steps_field}={steps}: the run would end "
                     f"before its {optim.schedule} decay does (set {optim_field}.decay_steps "
                     f"<= {steps - warm})")


def _fits(config, batch: int, seq: int, field: str, model=None) -> None:
  """The stage's per-device memory (``opd.parallel.memory.estimate_memory`` of
  its trained model at ``batch`` x ``seq`` on ``config.mesh``) against one
  device's memory (``memory.device_bytes``): a run that cannot fit is refused
  before it compiles, naming ``field``, the total and its largest terms."""
  from opd.models import to_model_config  # noqa: PLC0415
  from opd.parallel import memory  # noqa: PLC0415
  group = model if model is not None else config.get("model")
  if group is None:
    return
  mesh, _ = common.mesh_and_rules(config)
  cfg = to_model_config(group)
  try:
    axes = dict(mesh.shape)  # the expert axis splits weights as fsdp does
    shape = (axes.get("data", 1), axes.get("fsdp", 1) * axes.get("expert", 1),
             axes.get("tensor", 1))
    memory.check_fits(cfg, shape, batch, seq, memory.device_bytes(), remat=cfg.remat)
  except memory.DoesNotFitError as e:
    raise memory.DoesNotFitError(f"{field}: {e}") from None


def check_lm(config, where: str = "config") -> None:
  """Pre-training and SFT: the optimizer against ``train.steps``, and
  ``train.batch_size`` against the mesh."""
  _lm_stage(config, config, where)


def _lm_stage(group, config, field: str) -> None:
  """A ``train_lm`` stage's ``group`` (``optim``, ``train``) of a job's ``config``."""
  optim = common.optim_config(group.optim, f"{field}.optim")
  check_schedule(optim, group.train.steps, f"{field}.optim", f"{field}.train.steps")
  _batch(group.train.batch_size, config, f"{field}.train.batch_size")
  _fits(config, group.train.batch_size, group.train.seq_len,
        f"{field}.train.batch_size x {field}.train.seq_len")


def _build_teachers(group, field: str) -> None:
  """A job's teacher-building SFT, where it has one (``group.sft_steps`` > 0
  SFTs each teacher whose ``init`` is empty with ``group.optim``)."""
  if group is not None and group.sft_steps:
    optim = common.optim_config(group.optim, f"{field}.optim")
    check_schedule(optim, group.sft_steps, f"{field}.optim", f"{field}.sft_steps")


def check_grpo(config, where: str = "config", group: str = "grpo", optim: str = "optim",
               steps: tuple[tuple[int, str], ...] | None = None) -> None:
  """GRPO: its config, optimizer and episode batch (prompts_per_step x group_size).
  ``steps``: ``(steps, field)`` of each run of this optimizer (default: the
  ``grpo`` job's ``config.train.steps``)."""
  from experiments.grpo import grpo_config  # noqa: PLC0415
  cfg = grpo_config(config[group], f"{where}.{group}")
  optim_cfg = common.optim_config(config[optim], f"{where}.{optim}")
  for n, field in steps or ((config.train.steps, f"{where}.train.steps"),):
    check_schedule(optim_cfg, n, f"{where}.{optim}", field)
  _batch(cfg.batch_size, config, f"{where}.{group}.prompts_per_step * {where}.{group}.group_size "
         f"(= {cfg.prompts_per_step} * {cfg.group_size})")
  _fits(config, cfg.batch_size, cfg.seq_len, f"{where}.{group} (batch x seq_len)")


def check_opd(config, where: str = "config", optim: str = "config.optim",
              steps: str = "config.train.steps") -> None:
  """OPD (and annealing): ``OPDConfig`` and its loss options, the optimizer
  against ``train.steps``, the episode batch, the teachers' SFT if built.
  ``optim`` and ``steps`` name the fields the stage's optimizer group and
  step count came from."""
  from opd.distill import OPDConfig  # noqa: PLC0415
  ro = from_group(OPDConfig, config.opd, f"{where}.opd").rollout
  check_schedule(common.optim_config(config.optim, optim), config.train.steps, optim, steps)
  _build_teachers(config.get("build_teachers"), f"{where}.build_teachers")
  _batch(ro.batch_size, config, f"{where}.opd.rollout.prompts_per_step * "
         f"{where}.opd.rollout.group_size (= {ro.prompts_per_step} * {ro.group_size})")
  _fits(config, ro.batch_size, ro.seq_len, f"{where}.opd.rollout (batch x seq_len)",
        model=config.student.model if "student" in config else None)


def check_cold_start(config, where: str = "config", optim: str = "config.optim",
                     own_schedule: bool = False) -> None:
  """The cold start's SFT: its optimizer against ``cold_start.steps`` (only the
  warmup unless ``own_schedule``: the distillation job's cold start runs OPD's
  ``config.optim``, whose decay is sized for ``config.train.steps``),
  ``cold_start.batch_size`` against the mesh, the teachers' SFT if built."""
  check_schedule(common.optim_config(config.optim, optim), config.cold_start.steps, optim,
                 f"{where}.cold_start.steps", decay=own_schedule)
  _build_teachers(config.get("build_teachers"), f"{where}.build_teachers")
  _batch(config.cold_start.batch_size, config, f"{where}.cold_start.batch_size")


def check_specialists(config, where: str = "config") -> None:
  """Base pre-training, every domain's SFT and GRPO."""
  from experiments import specialists  # noqa: PLC0415
  specialists.check_per_domain(config)
  _lm_stage(config.base, config, f"{where}.base")
  # Each domain's SFT and GRPO steps: ``per_domain.<d>.sft_steps/grpo_steps``
  # where set (> 0), and a decaying SFT schedule re-fit to them as the job
  # does (``decay_steps = steps - warmup_steps``).
  sft_optim = common.optim_config(config.sft.optim, f"{where}.sft.optim")
  grpo_steps = []
  for d in config.domains:
    own = config.get("per_domain", {}).get(d, {})
    n, field, optim = config.sft.train.steps, f"{where}.sft.train.steps", sft_optim
    if own.get("sft_steps"):
      n, field = own.sft_steps, f"{where}.per_domain.{d}.sft_steps"
      if optim.schedule != "constant":
        optim = optim.replace(decay_steps=max(1, n - optim.warmup_steps))
    check_schedule(optim, n, f"{where}.sft.optim", field)
    grpo_steps.append((own.get("grpo_steps"), f"{where}.per_domain.{d}.grpo_steps")
                      if own.get("grpo_steps") else
                      (config.grpo_train.steps, f"{where}.grpo_train.steps"))
  _batch(config.sft.train.batch_size, config, f"{where}.sft.train.batch_size")
  check_grpo(config, where, "grpo", "grpo_optim", tuple(grpo_steps))


def check_baselines(config, where: str = "config") -> None:
  """The chosen baselines' groups: off-policy KD's config (its batch against the
  mesh) and optimizer, the RL baselines' GRPO config and optimizer (against
  each run's steps), the teachers' SFT if built."""
  from experiments import baselines  # noqa: PLC0415
  from opd.distill.offpolicy import OffPolicyConfig  # noqa: PLC0415
  chosen = tuple(config.baselines) if config.job == "baselines" else (config.job,)
  bad = [b for b in chosen if b not in baselines.RUNS]
  if not chosen or bad:
    raise ValueError(f"{where}.baselines={chosen!r}: expected some of {tuple(baselines.RUNS)}")
  if "offpolicy_kd" in chosen:
    cfg = from_group(OffPolicyConfig, config.offpolicy, f"{where}.offpolicy")
    check_schedule(common.optim_config(config.kd_optim, f"{where}.kd_optim"), config.kd.steps,
                   f"{where}.kd_optim", f"{where}.kd.steps")
    _batch(cfg.batch_size, config, f"{where}.offpolicy.batch_size")
  rl_steps = []
  if "mixed_rl" in chosen:
    rl_steps.append((config.rl_train.steps, f"{where}.rl_train.steps"))
  order = tuple(config.sequential.order)
  if "sequential_rl" in chosen and order:
    if config.rl_train.steps < len(order):
      raise ValueError(f"{where}.rl_train.steps={config.rl_train.steps} is fewer than the "
                       f"{len(order)} stages of {where}.sequential.order={order!r}")
    # rl_train.steps split evenly over the order, each stage a fresh optimizer:
    # the shortest stage has steps // len(order).
    rl_steps.append((config.rl_train.steps // len(order),
                     f"{where}.rl_train.steps // len({where}.sequential.order) (= "
                     f"{config.rl_train.steps} // {len(order)}, sequential RL's shortest stage)"))
  if rl_steps:
    check_grpo(config, where, "grpo", "rl_optim", tuple(rl_steps))
  _build_teachers(config.get("build"), f"{where}.build")


def check_compat(config) -> None:
  """Both bases, the teachers' SFT and GRPO, the student's SFT and both OPD arms."""
  from experiments import compat  # noqa: PLC0415
  for group in ("base", "sft", "student_sft"):
    _lm_stage(config[group], config, f"config.{group}")
  check_grpo(config, "config", "grpo", "grpo_optim",
             ((config.grpo_train.steps, "config.grpo_train.steps"),))
  check_opd(compat.opd_config(config, pathlib.Path("<workdir>"), compat.ARMS[0]), "config",
            "config.opd_optim", "config.opd_train.steps")


def check_v4(config) -> None:
  """The specialists, every student stage's config as v4 will build it, the baselines."""
  from experiments import v4  # noqa: PLC0415
  check_specialists(config.specialists, "config.specialists")
  dirs = {d: "<specialist>" for d in config.specialists.domains}
  for stage in v4.STUDENT_STAGES:
    cfg = v4.student_stage_config(config, stage, dirs, "<init>", config.student_seeds[0])
    if stage == "cold_start":
      check_cold_start(cfg, "config", "config.cold_start_optim", own_schedule=True)
    else:
      optim, steps = (("config.opd_optim", "config.opd_train.steps") if stage == "opd" else
                      ("config.anneal_optim", "config.anneal.steps"))
      check_opd(cfg, "config", optim, steps)
  check_baselines(config.baselines, "config.baselines")


def check_grm(config) -> None:
  """The GRM pipeline: the benchmark's voting k's (its last stage)."""
  from experiments import grm  # noqa: PLC0415
  grm.check_benchmark(config)
