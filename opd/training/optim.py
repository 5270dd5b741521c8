"""AdamW with linear warmup, a decay schedule and global-norm clipping.

``OptimConfig`` is what experiment configs' ``config.optim`` groups hold;
``make_optimizer`` turns it into the optax transformation (an ``Optimizer``,
which keeps the config and so the gradient-accumulation count) that
``opd.training.train_step`` applies. The current learning rate lives in the optimizer
state (``inject_hyperparams``), so the step can report it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from opd.config.fields import check_choice, check_float, check_int, set_field

Array = jax.Array

_SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup, a decay schedule and global-norm clipping.

  Attributes:
    lr: peak learning rate.
    warmup_steps: linear warmup length; step ``s < warmup_steps`` uses
      ``lr * (s + 1) / warmup_steps`` (so no step has lr 0).
    decay_steps: length of the decay after warmup; afterwards the rate stays
      at ``lr * end_lr_ratio``. Must be > 0 unless ``schedule="constant"``.
    schedule: "cosine", "linear" or "constant" (constant after warmup).
    end_lr_ratio: final rate as a fraction of ``lr``.
    weight_decay: decoupled weight decay, applied to params with ndim >= 2
      only (not to norm scales and biases).
    b1, b2, eps: Adam moments' decay rates and denominator epsilon.
    clip_norm: clip the gradient to this global norm; None disables (on the
      command line: ``--config.optim.clip_norm=None``).
    grad_accum_steps: microbatches per update; ``make_train_step`` takes it
      from the optimizer ``make_optimizer`` builds from this config.
  """
  lr: float = 3e-4
  warmup_steps: int = 0
  decay_steps: int = 0
  schedule: str = "constant"
  end_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float | None = 1.0
  grad_accum_steps: int = 1

  def __post_init__(self):
    own = "OptimConfig"
    set_field(self, "lr", check_float(own, "lr", self.lr, min_value=0, min_exclusive=True))
    for name in ("warmup_steps", "decay_steps"):
      set_field(self, name, check_int(own, name, getattr(self, name), min_value=0))
    check_choice(own, "schedule", self.schedule, _SCHEDULES)
    if self.schedule != "constant" and self.decay_steps == 0:
      raise ValueError(f"OptimConfig.schedule={self.schedule!r} needs decay_steps > 0, got 0")
    set_field(self, "end_lr_ratio", check_float(own, "end_lr_ratio", self.end_lr_ratio,
                                                min_value=0, max_value=1))
    set_field(self, "weight_decay", check_float(own, "weight_decay", self.weight_decay,
                                                min_value=0))
    for name in ("b1", "b2"):
      set_field(self, name, check_float(own, name, getattr(self, name), min_value=0, max_value=1,
                                        max_exclusive=True))
    set_field(self, "eps", check_float(own, "eps", self.eps, min_value=0, min_exclusive=True))
    set_field(self, "clip_norm", check_float(own, "clip_norm", self.clip_norm, min_value=0,
                                             min_exclusive=True, allow_none=True))
    set_field(self, "grad_accum_steps", check_int(own, "grad_accum_steps", self.grad_accum_steps,
                                                  min_value=1))
    # The step computes in float32: a value that overflows there (lr=1e39 is
    # inf) would turn every parameter into inf/NaN on the first update.
    f32_max = float(np.finfo(np.float32).max)
    for name in ("lr", "weight_decay", "eps", "clip_norm"):
      value = getattr(self, name)
      if value is not None and abs(value) > f32_max:
        raise ValueError(f"{own}.{name}={value!r} is not finite in float32 (max {f32_max:.4g}), "
                         "the precision the train step computes in")

  def replace(self, **changes) -> "OptimConfig":
    return dataclasses.replace(self, **changes)


def make_schedule(cfg: OptimConfig) -> Callable[[Array], Array]:
  """The learning rate as a function of the (0-based) update count."""
  lr, warm, decay = float(cfg.lr), cfg.warmup_steps, cfg.decay_steps
  end = lr * cfg.end_lr_ratio

  def schedule(count):
    s = jnp.asarray(count, jnp.float32)
    warm_lr = lr * (s + 1.0) / max(warm, 1)
    if cfg.schedule == "constant":
      after = jnp.full_like(s, lr)
    else:
      frac = jnp.clip((s - warm) / decay, 0.0, 1.0)
      if cfg.schedule == "cosine":
        after = end + (lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
      else:
        after = lr + (end - lr) * frac
    return jnp.where(s < warm, warm_lr, after)

  return schedule


def _decay_mask(params):
  return jax.tree.map(lambda p: p.ndim >= 2, params)


class Optimizer(optax.GradientTransformationExtraArgs):
  """What ``make_optimizer`` returns: an optax transformation (``init``,
  ``update``) that also carries the ``OptimConfig`` it was built from.

  ``opd.training.train_step.make_train_step`` reads ``grad_accum_steps``
  from it, so the config is the one place that says how many microbatches
  make an update.
  """

  def __new__(cls, init, update, *, config: OptimConfig):
    self = super().__new__(cls, init, update)
    self.config = config  # not a tuple field: optax sees a plain (init, update) pair
    return self

  @property
  def grad_accum_steps(self) -> int:
    return self.config.grad_accum_steps


def make_optimizer(cfg: OptimConfig) -> Optimizer:
  """Clip-by-global-norm then AdamW; the current rate is in the state as
  ``learning_rate`` (``optax.tree_utils.tree_get``), which the step reports.
  The result carries ``cfg`` (``Optimizer.config``), so ``make_train_step``
  accumulates ``cfg.grad_accum_steps`` microbatches per update."""
  if not isinstance(cfg, OptimConfig):
    raise ValueError(f"make_optimizer needs an OptimConfig, got {type(cfg).__name__}")
  tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
      learning_rate=make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.clip_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
  return Optimizer(tx.init, tx.update, config=cfg)
