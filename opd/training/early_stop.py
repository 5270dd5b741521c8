"""Early stopping on an eval metric: the rule ``LoopConfig`` carries, applied by the loop.

``opd.training.loop.train`` feeds every eval's value of
``LoopConfig.early_stop_metric`` to an ``EarlyStop``; an eval improves on the
best so far when it moves in the ``early_stop_mode`` direction ("min" or
"max") by more than 0 and by at least ``early_stop_min_delta``. After
``early_stop_patience`` evals in a row without an improvement the run stops;
with ``early_stop_target`` it also stops after the first eval that reaches
the target (at or below it for "min", at or above for "max"; patience None:
the target is the only rule). The loop then saves a checkpoint of that
step, logs why, and returns. The
tracker's state (best value, its step, evals since, the step it stopped at)
is saved with every checkpoint, so a resumed run stops where the
uninterrupted one does, and a run that stopped stays stopped when it is
relaunched with the same rule (relaunched with early stopping off, or another
rule, it trains on; a changed rule starts from no best value).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

MODES = ("min", "max")

__all__ = ["EarlyStop", "MODES"]


@dataclasses.dataclass
class EarlyStop:
  """The running state of an early-stop rule (docs: the module docstring).

  Attributes:
    metric: the eval metric's name as the loop reports it (``eval/...``).
    mode: "min" (lower is better) or "max".
    patience: evals in a row without an improvement that stop the run
      (None: no patience rule).
    min_delta: the smallest change that counts as an improvement.
    target: stop after the first eval that reaches this value (None: never).
    best: the best value so far (None before the first eval).
    best_step: the step of ``best``.
    bad_evals: evals since the last improvement.
    stopped_at: the step after whose eval the run stopped (None: running).
    reached: the value that reached ``target`` (None: not reached).
  """
  metric: str
  mode: str
  patience: int | None
  min_delta: float
  target: float | None = None
  best: float | None = None
  best_step: int | None = None
  bad_evals: int = 0
  stopped_at: int | None = None
  reached: float | None = None

  def update(self, step: int, metrics: Mapping[str, float]) -> bool:
    """Takes step ``step``'s eval ``metrics``; True when the run should stop now.

    Raises:
      ValueError: ``metrics`` lacks the metric (naming the ones it has), or
        its value is not finite.
    """
    if self.metric not in metrics:
      evals = sorted(k for k in metrics if k.startswith("eval/"))
      raise ValueError(f"LoopConfig.early_stop_metric={self.metric!r} is not among the eval "
                       f"metrics at step {step}: {evals}")
    value = float(metrics[self.metric])
    if not math.isfinite(value):
      raise ValueError(f"LoopConfig.early_stop_metric={self.metric!r} is {value} at step {step}")
    if self.best is None:
      gain = math.inf
    else:
      gain = self.best - value if self.mode == "min" else value - self.best
    if gain > 0 and gain >= self.min_delta:
      self.best, self.best_step, self.bad_evals = value, step, 0
    else:
      self.bad_evals += 1
    if self.target is not None and (value <= self.target if self.mode == "min"
                                    else value >= self.target):
      self.reached, self.stopped_at = value, step
    elif self.patience is not None and self.bad_evals >= self.patience:
      self.stopped_at = step
    return self.stopped_at is not None

  def reason(self) -> str:
    """Why the run stopped, for the log."""
    if self.reached is not None:
      return (f"early stop after step {self.stopped_at}: {self.metric} = {self.reached:.6g} "
              f"reached the target {self.target:g} ({self.mode})")
    return (f"early stop after step {self.stopped_at}: {self.metric} has not improved by >= "
            f"{self.min_delta:g} ({self.mode}) for {self.bad_evals} evals (patience "
            f"{self.patience}); best {self.best:.6g} at step {self.best_step}")

  def to_json(self) -> dict[str, Any]:
    """The state saved with a checkpoint."""
    return dataclasses.asdict(self)

  def restore(self, saved: Mapping[str, Any] | None) -> None:
    """Continues from a checkpoint's ``to_json`` when it tracked the same rule
    (metric, mode, patience, min_delta, target); a changed rule starts afresh."""
    if not saved:
      return
    rule = ("metric", "mode", "patience", "min_delta", "target")
    if any(saved.get(k) != getattr(self, k) for k in rule):
      return
    for k in ("best", "best_step", "bad_evals", "stopped_at", "reached"):
      setattr(self, k, saved.get(k))
