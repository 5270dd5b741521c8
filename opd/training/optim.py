"""AdamW with linear warmup, a decay schedule and global-norm clipping.

``OptimConfig`` is what experiment configs' ``config.optim`` groups hold;
``make_optimizer`` turns it into the optax transformation that
``opd.training.train_step`` applies. The current learning rate lives in the optimizer
state (``inject_hyperparams``), so the step can report it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
    clip_norm: clip the gradient to this global norm; None disables.
    grad_accum_steps: microbatches per step (pass it to ``make_train_step``).
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
    def check(name, ok):
      if not ok:
        raise ValueError(f"OptimConfig.{name}={getattr(self, name)!r} is invalid")

    def is_int(v):
      return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    check("lr", isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0)
    check("warmup_steps", is_int(self.warmup_steps) and self.warmup_steps >= 0)
    check("decay_steps", is_int(self.decay_steps) and self.decay_steps >= 0)
    if self.schedule not in _SCHEDULES:
      raise ValueError(f"OptimConfig.schedule={self.schedule!r} is not one of {_SCHEDULES}")
    if self.schedule != "constant" and self.decay_steps == 0:
      raise ValueError(f"OptimConfig.schedule={self.schedule!r} needs decay_steps > 0, got 0")
    check("end_lr_ratio", 0.0 <= self.end_lr_ratio <= 1.0)
    check("weight_decay", self.weight_decay >= 0)
    check("b1", 0.0 <= self.b1 < 1.0)
    check("b2", 0.0 <= self.b2 < 1.0)
    check("eps", self.eps > 0)
    check("clip_norm", self.clip_norm is None or self.clip_norm > 0)
    check("grad_accum_steps", is_int(self.grad_accum_steps) and self.grad_accum_steps >= 1)

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


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """Clip-by-global-norm then AdamW; the current rate is in the state as
  ``learning_rate`` (``optax.tree_utils.tree_get``), which the step reports."""
  adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
      learning_rate=make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.clip_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
