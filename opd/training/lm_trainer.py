"""Next-token training (pre-training and SFT) on the shared sharded step.

``train_lm`` wires ``opd.training.objectives.lm_loss`` into ``opd.training.train_step`` and
``opd.training.loop``: sharded init (random or from given params), AdamW,
periodic held-out loss, TensorBoard/JSONL metrics, checkpoints with resume,
and a NaN stop that leaves the last good checkpoint untouched. Pre-training
feeds it raw-text batches, SFT feeds response-masked chat batches; the
batch layout is that of ``opd.training.data``.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from opd.config.fields import check_bool, check_int, set_field
from opd.models import ModelConfig, moe_balance
from opd.training import loop as train_loop
from opd.training.checkpoints import CheckpointManager
from opd.training.objectives import lm_loss
from opd.training.train_step import (OptimConfig, TrainState, init_train_state, make_optimizer,
                                     make_train_step, shard_batch)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LMTrainConfig:
  """Loop settings of ``train_lm``.

  Attributes:
    steps: total optimizer updates (a resumed run continues to this count).
    eval_every: held-out loss every this many steps and after the last
      (0: only after the last).
    save_every: checkpoint every this many steps and after the last (0: only
      after the last); the same meaning as in every trainer
      (``opd.training.loop.run``).
    keep_checkpoints: newest checkpoints kept (plus the best by eval loss).
    fused_loss: apply the LM head inside the fused cross-entropy kernel
      (never materialises ``[B, T, V]``; worth it at large V).
    progress: tqdm bar.
  """
  steps: int
  eval_every: int = 0
  save_every: int = 0
  keep_checkpoints: int = 2
  fused_loss: bool = False
  progress: bool = True

  def __post_init__(self):
    for name, lo in (("steps", 0), ("eval_every", 0), ("save_every", 0), ("keep_checkpoints", 1)):
      set_field(self, name, check_int("LMTrainConfig", name, getattr(self, name), min_value=lo))
    for name in ("fused_loss", "progress"):
      set_field(self, name, check_bool("LMTrainConfig", name, getattr(self, name)))


def _jit_eval(loss_fn):
  return jax.jit(lambda p, b: loss_fn(p, b, jax.random.key(0)))


def evaluate_loss(loss_fn, params, batches: Sequence[Mapping[str, np.ndarray]], mesh, rules, *,
                  jitted: Callable | None = None) -> dict[str, float]:
  """Token-weighted mean loss (and accuracy, if reported) over ``batches``.

  ``jitted``: ``jax.jit`` of ``loss_fn`` with a fixed rng, built by the caller
  to reuse one compile across calls (by default compiled for this call).
  """
  fn = jitted if jitted is not None else _jit_eval(loss_fn)
  total = weighted = acc = 0.0
  for batch in batches:
    loss, metrics = fn(params, shard_batch(batch, mesh, rules))
    n = float(metrics["tokens"])
    total += n
    weighted += float(loss) * n
    acc += float(metrics.get("accuracy", np.nan)) * n
  if total == 0:
    return {"loss": float("nan")}
  out = {"loss": weighted / total}
  if not np.isnan(acc):
    out["accuracy"] = acc / total
  return out


def train_lm(model_cfg: ModelConfig, batches: Iterator[Mapping[str, np.ndarray]],
             optim: OptimConfig, loop: LMTrainConfig, *, mesh, rules, seed: int = 0,
             params: Any | None = None, eval_batches: Sequence[Mapping[str, np.ndarray]] = (),
             checkpoint_dir: str | pathlib.Path | None = None,
             on_metrics: Callable[[int, dict[str, float]], None] | None = None,
             extra_eval: Callable[[Any], Mapping[str, float]] | None = None,
             run_config: Mapping[str, Any] | None = None,
             first_metrics: dict | None = None) -> TrainState:
  """Trains ``model_cfg`` on ``batches`` for ``loop.steps`` updates.

  Args:
    model_cfg: the model.
    batches: host batches in the ``opd.training.data`` layout, per-process rows (a
      grain iterator's position is checkpointed with the state).
    optim: optimizer settings (``grad_accum_steps`` included).
    loop: loop settings.
    mesh, rules: the ``(data, fsdp, tensor)`` mesh and logical rules.
    seed: init and per-step randomness.
    params: start from these parameters (SFT from a base, a specialist
      from SFT) instead of a random init.
    eval_batches: held-out batches for ``eval/loss``.
    checkpoint_dir: where to checkpoint and resume from (None: no checkpoints).
    on_metrics: ``on_metrics(step, metrics)`` for logging (eval metrics,
      prefixed ``eval/``, in the same dict on eval steps).
    extra_eval: ``extra_eval(params) -> metrics`` run with the held-out loss
      (e.g. generation-based task scores during SFT).
    run_config: JSON dict saved with each checkpoint; on resume the whole
      of it must match the checkpoint's (``opd.training.loop.run``).
    first_metrics: filled with step 1's metrics at key 1, the original run's
      after a resume (``opd.training.loop.run``).

  Returns:
    The final ``TrainState``.

  Raises:
    ValueError: ``optim.warmup_steps`` exceeds ``loop.steps`` (the run would
      end before its learning rate reaches ``optim.lr``).
  """
  if optim.warmup_steps > loop.steps:
    raise ValueError(f"OptimConfig.warmup_steps={optim.warmup_steps} exceeds LMTrainConfig.steps="
                     f"{loop.steps}: the run would end before the warmup does (the rate never "
                     f"reaches lr={optim.lr})")
  loss_fn = lm_loss(model_cfg, fused=loop.fused_loss)
  optimizer = make_optimizer(optim)
  state, shardings = init_train_state(model_cfg, optimizer, mesh, rules, rng=seed, params=params)
  step_fn = make_train_step(loss_fn, optimizer, mesh, shardings, rules=rules,
                            after_update=moe_balance.bias_update_hook(model_cfg))

  jitted_eval = _jit_eval(loss_fn)  # one compile for every eval of this run

  def eval_fn(st: TrainState) -> dict[str, float]:
    out = {}
    if eval_batches:
      out.update(evaluate_loss(loss_fn, st.params, eval_batches, mesh, rules,
                               jitted=jitted_eval))
    if extra_eval is not None:
      out.update(extra_eval(st.params))
    return out

  manager = None
  if checkpoint_dir is not None:
    manager = CheckpointManager(checkpoint_dir, max_to_keep=loop.keep_checkpoints,
                                keep_best=1 if eval_batches else 0, best_metric="eval/loss")
  config = dict(run_config or {})
  config.setdefault("model", model_cfg.to_dict())
  has_eval = bool(eval_batches) or extra_eval is not None
  try:
    state = train_loop.run(
        state, step_fn, batches, loop.steps, checkpoint_manager=manager,
        save_every=loop.save_every if manager is not None else 0, config=config,
        on_metrics=on_metrics, eval_fn=eval_fn if has_eval else None,
        eval_every=loop.eval_every if has_eval else 0,
        prepare_batch=functools.partial(shard_batch, mesh=mesh, rules=rules),
        progress=loop.progress, first_metrics=first_metrics)
  finally:
    if manager is not None:
      manager.close()
  return state
