"""Sequential RL: GRPO on one domain after another (docs/DESIGN.md §3, Baselines; §5).

The "sequential specialisation" baseline against which OPD's merge of
specialists is measured: starting from one model, stage i runs
``opd.rl.grpo.train_grpo`` on the prompts of domain i only, starting from
the params stage i − 1 ended with. Each stage is a complete GRPO run (its
own optimizer state and learning-rate schedule, its own checkpoint and
metrics directory, sampling keys from ``seed + i``); its KL reference, when
``cfg.kl_coef > 0``, is the params it started from.

Resume: a stage directory with a finished checkpoint is restored (the loop
runs zero steps) and hands its params on; an interrupted stage continues
from its last checkpoint. Mixed RL, the other RL baseline, needs no driver:
``train_grpo`` on a list of every domain's prompts draws each batch from
the shuffled mix (``PromptStream``), and each prompt is scored by its own
domain's verifier.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, NamedTuple, Sequence

from opd.config.fields import check_int
from opd.models import ModelConfig
from opd.rl.config import GRPOConfig
from opd.rl.grpo import GRPOExtras, GRPORun, train_grpo
from opd.tasks import Example
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.train_step import OptimConfig, TrainState

__all__ = ["SequentialRun", "stage_name", "train_sequential_grpo"]


class SequentialRun(NamedTuple):
  """What ``train_sequential_grpo`` returns.

  Attributes:
    state: the last stage's final state.
    stages: ``(name, GRPORun)`` per stage, in training order.
  """
  state: TrainState
  stages: list[tuple[str, GRPORun]]


def stage_name(index: int, name: str) -> str:
  """The directory name of stage ``index`` (0-based): ``"1_math"``, ``"2_code"``, ..."""
  return f"{index + 1}_{name}"


def train_sequential_grpo(model_cfg: ModelConfig, params,
                          stages: Sequence[tuple[str, Sequence[Example]]], cfg: GRPOConfig,
                          optim: OptimConfig, loop: LoopConfig | Sequence[LoopConfig],
                          io: RunIO | None = None, *, runtime: Runtime,
                          extras: GRPOExtras | None = None,
                          on_stage: Callable[[int, str, GRPORun], None] | None = None
                          ) -> SequentialRun:
  """Runs GRPO stage by stage (module docstring).

  Args:
    model_cfg, params: the model and its starting params.
    stages: ``(name, prompts)`` per stage in training order, e.g.
      ``[("math", math_prompts), ("code", code_prompts)]``; names must be
      distinct identifiers-like strings (they name the stage directories).
    cfg, optim: GRPO and optimizer settings, the same for every stage.
    loop: one ``LoopConfig`` for every stage, or one per stage (its
      ``steps``: GRPO steps of that stage, >= 1).
    io: ``io.workdir``: stage i writes metrics to
      ``workdir/<stage_name(i, name)>/`` and checkpoints to its
      ``checkpoints/`` (None: nothing written, no resume); ``io.config`` (plus
      the stage's ``{"index", "name"}``), ``on_metrics`` and ``eval_fn`` go
      to every stage.
    runtime: as ``train_grpo``'s; stage i samples with seed ``runtime.seed + i``.
    extras: passed to every ``train_grpo`` call (``GRPOExtras``).
    on_stage: ``on_stage(i, name, run)`` after each stage.

  Raises:
    ValueError: no stages, a duplicate or empty stage name, empty prompts,
      ``loop`` of the wrong length or a stage of 0 steps, or an ``io`` with
      its own writer or checkpoints (each stage has its own).
  """
  stages = [(str(n), list(p)) for n, p in stages]
  if not stages:
    raise ValueError("stages=[]: sequential RL needs at least one (name, prompts) stage")
  names = [n for n, _ in stages]
  for n, p in stages:
    if not n or "/" in n or names.count(n) > 1:
      raise ValueError(f"stage name {n!r} must be non-empty, without '/', and unique; "
                       f"names: {names}")
    if not p:
      raise ValueError(f"stage {n!r} has no prompts")
  per_stage = [loop] * len(stages) if isinstance(loop, LoopConfig) else list(loop)
  if len(per_stage) != len(stages):
    raise ValueError(f"loop (steps) has {len(per_stage)} entries for {len(stages)} stages")
  for i, stage_loop in enumerate(per_stage):
    if not isinstance(stage_loop, LoopConfig):
      raise ValueError(f"loop[{i}] must be a LoopConfig, got {type(stage_loop).__name__}")
    check_int("train_sequential_grpo", f"steps[{i}]", stage_loop.steps, min_value=1)
  io = io if io is not None else RunIO()
  if io.writer is not None or io.checkpoints:
    raise ValueError("train_sequential_grpo: each stage has its own metrics and checkpoints "
                     "under io.workdir; io.writer, checkpoint_dir and checkpoint_manager must "
                     "be None")
  root = pathlib.Path(io.workdir) if io.workdir is not None else None
  done: list[tuple[str, GRPORun]] = []
  for i, ((name, prompts), stage_loop) in enumerate(zip(stages, per_stage)):
    stage_dir = root / stage_name(i, name) if root is not None else None
    stage_io = dataclasses.replace(
        io, workdir=stage_dir, checkpoint_dir=stage_dir / "checkpoints" if stage_dir else None,
        config={**dict(io.config or {}), "stage": {"index": i, "name": name}})
    run = train_grpo(model_cfg, params, params if cfg.kl_coef > 0 else None, prompts, cfg,
                     optim, stage_loop, stage_io, runtime=runtime.replace(seed=runtime.seed + i),
                     extras=extras)
    params = run.state.params
    done.append((name, run))
    if on_stage is not None:
      on_stage(i, name, run)
  return SequentialRun(done[-1][1].state, done)
