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

import pathlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from opd.config.fields import check_int
from opd.models import ModelConfig
from opd.parallel import sharding as sharding_lib
from opd.rl.config import GRPOConfig
from opd.rl.grpo import GRPORun, train_grpo
from opd.tasks import Example
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


def train_sequential_grpo(model_cfg: ModelConfig, params, stages: Sequence[tuple[str, Sequence[Example]]],
                          cfg: GRPOConfig, optim: OptimConfig, *, tokenizer,
                          steps: int | Sequence[int], mesh, rules=sharding_lib.DEFAULT_RULES,
                          seed: int = 0, workdir: str | pathlib.Path | None = None,
                          save_every: int = 0, keep_checkpoints: int = 1,
                          run_config: Mapping[str, Any] | None = None,
                          on_stage: Callable[[int, str, GRPORun], None] | None = None,
                          **grpo_kwargs) -> SequentialRun:
  """Runs GRPO stage by stage (module docstring).

  Args:
    model_cfg, params: the model and its starting params.
    stages: ``(name, prompts)`` per stage in training order, e.g.
      ``[("math", math_prompts), ("code", code_prompts)]``; names must be
      distinct identifiers-like strings (they name the stage directories).
    cfg, optim: GRPO and optimizer settings, the same for every stage.
    steps: GRPO steps per stage (one int for all, or one per stage).
    workdir: stage i writes metrics to ``workdir/<stage_name(i, name)>/``
      and checkpoints to its ``checkpoints/`` (None: nothing written, no resume).
    on_stage: ``on_stage(i, name, run)`` after each stage.
    grpo_kwargs: passed to every ``train_grpo`` call (``reward_fn``,
      ``agent_config``, ``task_kwargs``, ``progress``, ``eval_fn``, ...).

  Raises:
    ValueError: no stages, a duplicate or empty stage name, empty prompts,
      or ``steps`` of the wrong length.
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
  per_stage = [steps] * len(stages) if isinstance(steps, int) else list(steps)
  if len(per_stage) != len(stages):
    raise ValueError(f"steps has {len(per_stage)} entries for {len(stages)} stages")
  per_stage = [check_int("train_sequential_grpo", f"steps[{i}]", s, min_value=1)
               for i, s in enumerate(per_stage)]
  root = pathlib.Path(workdir) if workdir is not None else None
  done: list[tuple[str, GRPORun]] = []
  for i, ((name, prompts), n_steps) in enumerate(zip(stages, per_stage)):
    stage_dir = root / stage_name(i, name) if root is not None else None
    run = train_grpo(
        model_cfg, params, params if cfg.kl_coef > 0 else None, prompts, cfg, optim,
        tokenizer=tokenizer, steps=n_steps, mesh=mesh, rules=rules, seed=seed + i,
        workdir=stage_dir, checkpoint_dir=stage_dir / "checkpoints" if stage_dir else None,
        save_every=save_every, keep_checkpoints=keep_checkpoints,
        run_config={**dict(run_config or {}), "stage": {"index": i, "name": name}},
        **grpo_kwargs)
    params = run.state.params
    done.append((name, run))
    if on_stage is not None:
      on_stage(i, name, run)
  return SequentialRun(done[-1][1].state, done)
