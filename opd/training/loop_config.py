"""What every trainer hands the loop (docs/DESIGN.md §1): ``LoopConfig``, ``RunIO``, ``Runtime``.

A trainer (``train_grpo``, ``train_opd``, ``train_offpolicy_kd``, ``train_lm``,
...) builds a batch source and a loss from its own config objects and calls
``opd.training.loop.train(state, step_fn, source, loop, io)``. The three
objects here are the arguments every trainer shares, so no trainer repeats
the loop's dozen keywords:

* ``LoopConfig``: how long and how often (plain data: steps, eval /
  checkpoint / text cadence, checkpoints kept, resume rules, progress bar,
  early-stop rule).
* ``RunIO``: what the run reads and writes (work directory or an open
  writer, checkpoint directory or an open manager, the JSON config saved with
  each checkpoint and compared on resume, first-step figures) and the hooks
  it calls (``on_metrics``, ``eval_fn``).
* ``Runtime``: where it runs (mesh, logical rules, seed, tokenizer).
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Mapping, Sequence

from opd.config.fields import check_bool, check_choice, check_float, check_int, set_field
from opd.parallel import sharding as sharding_lib
from opd.training.early_stop import MODES

__all__ = ["LoopConfig", "RunIO", "Runtime"]


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """How long a run trains and how often it evaluates, saves and logs.

  Attributes:
    steps: total steps (batches; a resumed run continues to this count).
    save_every: checkpoint after every this many steps and after the last
      (0 or None: only after the last); needs a checkpoint directory or
      manager in ``RunIO``.
    eval_every: ``RunIO.eval_fn`` every this many steps (0 or None: none in
      between) and after the last step.
    text_every: a rollout source's text summaries on the first step and every
      this many (GRPO's rollouts; 0: first step only).
    keep_checkpoints: newest checkpoints kept when the loop opens the manager.
    allow_config_change: dotted config fields (or groups) that may differ
      from the checkpoint's on resume, each logged (``opd.training.resume``).
    fall_back_on_corrupt: resume from the previous checkpoint when the latest
      fails its checksums (it is moved aside); else raise.
    progress: a tqdm bar on process 0.
    early_stop_metric: stop early on this eval metric, named as the loop
      reports it (``"eval/loss"``); None: never. Needs ``eval_every`` > 0
      (``opd.training.early_stop``).
    early_stop_mode: "min" (lower is better) or "max".
    early_stop_patience: evals in a row without an improvement that stop
      the run; the loop then saves a checkpoint of that step and returns
      (None: no patience rule; then ``early_stop_target`` is needed).
    early_stop_min_delta: an eval improves on the best when it is better by
      more than 0 and by at least this much.
    early_stop_target: also stop after the first eval at or below this value
      ("min"; at or above for "max"); None: no target.
  """
  steps: int
  save_every: int | None = 0
  eval_every: int | None = 0
  text_every: int = 10
  keep_checkpoints: int = 2
  allow_config_change: Sequence[str] = ()
  fall_back_on_corrupt: bool = False
  progress: bool = True
  early_stop_metric: str | None = None
  early_stop_mode: str = "min"
  early_stop_patience: int | None = 1
  early_stop_min_delta: float = 0.0
  early_stop_target: float | None = None

  def __post_init__(self):
    owner = type(self).__name__
    set_field(self, "steps", check_int(owner, "steps", self.steps, min_value=0))
    for name in ("save_every", "eval_every"):
      set_field(self, name, check_int(owner, name, getattr(self, name), min_value=0,
                                      allow_none=True) or 0)
    set_field(self, "text_every", check_int(owner, "text_every", self.text_every, min_value=0))
    set_field(self, "keep_checkpoints",
              check_int(owner, "keep_checkpoints", self.keep_checkpoints, min_value=1))
    if isinstance(self.allow_config_change, str):
      raise ValueError(f"{owner}.allow_config_change must be a sequence of field names, got "
                       f"the string {self.allow_config_change!r}")
    set_field(self, "allow_config_change", tuple(str(f) for f in self.allow_config_change))
    for name in ("fall_back_on_corrupt", "progress"):
      set_field(self, name, check_bool(owner, name, getattr(self, name)))
    metric = self.early_stop_metric
    if metric is not None and (not isinstance(metric, str) or not metric.startswith("eval/")
                               or metric == "eval/"):
      raise ValueError(f"{owner}.early_stop_metric={metric!r}: expected an eval metric as the "
                       "loop reports it, e.g. 'eval/loss' (or None)")
    if metric is not None and not self.eval_every:
      raise ValueError(f"{owner}.early_stop_metric={metric!r} needs eval_every > 0 (evals are "
                       f"its only input), got eval_every={self.eval_every}")
    check_choice(owner, "early_stop_mode", self.early_stop_mode, MODES)
    set_field(self, "early_stop_patience",
              check_int(owner, "early_stop_patience", self.early_stop_patience, min_value=1,
                        allow_none=True))
    set_field(self, "early_stop_min_delta",
              check_float(owner, "early_stop_min_delta", self.early_stop_min_delta, min_value=0))
    set_field(self, "early_stop_target",
              check_float(owner, "early_stop_target", self.early_stop_target, allow_none=True))
    if metric is not None and self.early_stop_patience is None and self.early_stop_target is None:
      raise ValueError(f"{owner}.early_stop_metric={metric!r} has no rule to stop on: "
                       "early_stop_patience=None and early_stop_target=None")

  def replace(self, **changes) -> "LoopConfig":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class RunIO:
  """What a run reads and writes, and the hooks it calls.

  Attributes:
    workdir: a ``MetricWriter`` (``metrics.jsonl``, TensorBoard) is opened
      and closed there, unless ``writer`` is given.
    writer: an open ``MetricWriter``: flushed at the end, never closed.
    checkpoint_dir: a ``CheckpointManager`` is opened (keeping
      ``LoopConfig.keep_checkpoints``) and closed there; resume from it.
    checkpoint_manager: an open manager instead (not closed).
    config: JSON dict saved with each checkpoint; on resume the whole of it
      is compared with the checkpoint's (trainers add their own entries:
      ``model``, ``grpo``, ...).
    first_metrics: a dict saved with every checkpoint and restored on resume:
      key 0 may hold figures measured before training, the loop puts step
      1's metrics at key 1 (after a resume: the original run's).
    on_metrics: ``on_metrics(step, metrics)`` after each step (python floats;
      eval metrics prefixed ``eval/`` on eval steps).
    eval_fn: ``eval_fn(params) -> metrics``, every ``LoopConfig.eval_every``
      steps and after the last, logged as ``eval/...``.
  """
  workdir: str | pathlib.Path | None = None
  writer: Any = None
  checkpoint_dir: str | pathlib.Path | None = None
  checkpoint_manager: Any = None
  config: Mapping[str, Any] | None = None
  first_metrics: dict | None = None
  on_metrics: Callable[[int, dict[str, float]], None] | None = None
  eval_fn: Callable[[Any], Mapping[str, Any]] | None = None

  def __post_init__(self):
    if self.checkpoint_dir is not None and self.checkpoint_manager is not None:
      raise ValueError(f"RunIO: give checkpoint_dir ({self.checkpoint_dir}) or "
                       "checkpoint_manager, not both")
    if self.first_metrics is not None and not isinstance(self.first_metrics, dict):
      raise ValueError(f"RunIO.first_metrics must be a dict (the loop fills it), got "
                       f"{type(self.first_metrics).__name__}")
    for name in ("on_metrics", "eval_fn"):
      fn = getattr(self, name)
      if fn is not None and not callable(fn):
        raise ValueError(f"RunIO.{name} must be callable or None, got {type(fn).__name__}")

  @property
  def checkpoints(self) -> bool:
    """Whether the run checkpoints (a directory or a manager is given)."""
    return self.checkpoint_dir is not None or self.checkpoint_manager is not None

  def with_config(self, entries: Mapping[str, Any]) -> "RunIO":
    """A copy whose ``config`` adds a trainer's ``entries`` (``model``, ``grpo``, ...)."""
    return dataclasses.replace(self, config={**dict(self.config or {}), **dict(entries)})

  def replace(self, **changes) -> "RunIO":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Runtime:
  """Where a trainer runs.

  Attributes:
    mesh: the ``(data, fsdp, tensor)`` device mesh of the train step.
    rules: logical-axis sharding rules (validated).
    seed: initialisation and per-step randomness.
    tokenizer: for trainers that sample text (rollouts); None otherwise.
  """
  mesh: Any
  rules: Any = sharding_lib.DEFAULT_RULES
  seed: int = 0
  tokenizer: Any = None

  def __post_init__(self):
    set_field(self, "rules", sharding_lib.validate_rules(self.rules))
    set_field(self, "seed", check_int("Runtime", "seed", self.seed))

  def replace(self, **changes) -> "Runtime":
    return dataclasses.replace(self, **changes)
