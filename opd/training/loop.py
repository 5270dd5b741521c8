"""The host-side training loop shared by pre-training and SFT.

``run`` drives a jitted ``step(state, batch) -> (state, metrics)`` (from
``opd.training.train_step.make_train_step``) over a data iterator: it resumes from the
latest checkpoint (state *and* iterator position), checks every step's
``finite`` flag, reports metrics, evaluates, and saves checkpoints. GRPO and
distillation have their own rollout loops but reuse ``resume`` and
``raise_if_nonfinite``.

NaN/inf: the step itself discards a non-finite update, and ``run`` raises
``NonFiniteError`` naming the step before anything is saved, so the last
good checkpoint on disk is untouched. The exception carries the (unchanged)
state as ``err.state``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from opd.training.checkpoints import CheckpointManager
from opd.training.train_step import NonFiniteError, TrainState, raise_if_nonfinite

log = logging.getLogger(__name__)

__all__ = ["run", "resume", "NonFiniteError"]


def _host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  out = {}
  for k, v in jax.device_get(dict(metrics)).items():
    a = np.asarray(v)
    out[k] = float(a) if a.size == 1 else float(a.mean())
  return out


def resume(state: TrainState, checkpoint_manager: CheckpointManager | None, data_iterator=None, *,
           expected_config: Mapping | None = None) -> TrainState:
  """Restores the latest checkpoint onto ``state``'s shardings, if there is one.

  The data iterator's position is restored too (``set_state``). Returns
  ``state`` itself when the directory holds no checkpoint.

  Raises:
    ValueError: the checkpoint holds an iterator position but ``data_iterator``
      has no ``set_state`` (re-reading data from the start silently would bias
      the run).
  """
  if checkpoint_manager is None or checkpoint_manager.latest_step() is None:
    return state
  restored = checkpoint_manager.restore(state, expected_config=expected_config)
  if restored.data_state:
    if data_iterator is None or not hasattr(data_iterator, "set_state"):
      raise ValueError(f"checkpoint {restored.path} holds a data iterator position "
                       f"{restored.data_state} but the data iterator "
                       f"{type(data_iterator).__name__} has no set_state()")
    data_iterator.set_state(restored.data_state)
  log.info("resumed from %s (step %d)", restored.path, restored.step)
  return restored.state


def run(state: TrainState, step_fn: Callable[[TrainState, Any], tuple[TrainState, Mapping]],
        data_iterator: Iterator, num_steps: int, *,
        checkpoint_manager: CheckpointManager | None = None, save_every: int | None = None,
        config: Mapping | None = None,
        on_metrics: Callable[[int, dict[str, float]], None] | None = None,
        eval_fn: Callable[[TrainState], Mapping[str, Any]] | None = None,
        eval_every: int | None = None, prepare_batch: Callable[[Any], Any] | None = None,
        progress: bool = True) -> TrainState:
  """Trains until ``state.step == num_steps``; returns the final state.

  Args:
    state: the initial state, or its abstract form (``abstract_train_state``)
      when a checkpoint is sure to exist; the latest checkpoint, if any,
      replaces it (restored onto its shardings).
    step_fn: ``step(state, batch) -> (state, metrics)``; metrics must hold
      ``finite``, ``loss_finite``, ``grads_finite`` and ``loss`` (as
      ``make_train_step``'s do).
    data_iterator: yields host batches; if it has ``get_state``/``set_state``
      (grain iterators do) its position is checkpointed and restored.
    num_steps: total number of updates (counting those before a resume).
    checkpoint_manager: where to resume from and save to.
    save_every: save after every this many updates, and after the last one;
      None never saves (the manager is then only resumed from).
    config: JSON dict saved with each checkpoint; on resume its ``"model"``
      entry (if any) must match the checkpoint's.
    on_metrics: ``on_metrics(step, metrics)`` with python floats, after each
      update (``step`` = updates done so far) and after each eval (keys
      prefixed ``eval/``).
    eval_fn: ``eval_fn(state) -> metrics``, every ``eval_every`` updates.
    prepare_batch: applied to each batch before the step (e.g.
      ``functools.partial(shard_batch, mesh=mesh, rules=rules)``, needed with
      several processes).
    progress: show a tqdm bar (process 0 only).

  Raises:
    NonFiniteError: a step had a NaN/inf loss or gradient; names the step.
      Nothing is saved for that step; ``err.state`` is the state before it.
  """
  if not isinstance(num_steps, int) or num_steps < 0:
    raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
  for name, value in (("save_every", save_every), ("eval_every", eval_every)):
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"{name} must be a positive int or None, got {value!r}")
  if save_every is not None and checkpoint_manager is None:
    raise ValueError("save_every is set but checkpoint_manager is None")
  if eval_every is not None and eval_fn is None:
    raise ValueError("eval_every is set but eval_fn is None")

  expected = {"model": config["model"]} if config and "model" in config else None
  state = resume(state, checkpoint_manager, data_iterator, expected_config=expected)
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
    raise ValueError("state is abstract (ShapeDtypeStructs) but there is no checkpoint to resume "
                     f"from under {getattr(checkpoint_manager, 'directory', None)}")
  start = int(jax.device_get(state.step))
  has_position = hasattr(data_iterator, "get_state")
  bar = None
  if progress and jax.process_index() == 0 and start < num_steps:
    from tqdm.auto import tqdm
    bar = tqdm(total=num_steps, initial=start, desc="train", dynamic_ncols=True)

  last_saved = start if checkpoint_manager is not None and \
      checkpoint_manager.latest_step() == start else None
  step = start
  try:
    while step < num_steps:
      try:
        batch = next(data_iterator)
      except StopIteration:
        log.warning("data iterator exhausted after %d steps (asked for %d)", step, num_steps)
        break
      if prepare_batch is not None:
        batch = prepare_batch(batch)
      new_state, metrics = step_fn(state, batch)
      metrics = _host_scalars(metrics)
      try:
        raise_if_nonfinite(metrics, step)
      except NonFiniteError as err:
        err.state = new_state  # equal to the state before the step
        raise
      state, step = new_state, step + 1
      if on_metrics is not None:
        on_metrics(step, metrics)
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}")
      if eval_fn is not None and eval_every is not None and step % eval_every == 0:
        eval_metrics = {f"eval/{k}": v for k, v in _host_scalars(eval_fn(state)).items()}
        metrics.update(eval_metrics)
        if on_metrics is not None:
          on_metrics(step, eval_metrics)
      if save_every is not None and (step % save_every == 0 or step == num_steps):
        checkpoint_manager.save(step, state,
                                data_state=data_iterator.get_state() if has_position else None,
                                config=config, metrics=metrics)
        last_saved = step
  finally:
    if bar is not None:
      bar.close()
  if checkpoint_manager is not None:
    if save_every is not None and last_saved != step and step > start:
      checkpoint_manager.save(step, state,
                              data_state=data_iterator.get_state() if has_position else None,
                              config=config)
    checkpoint_manager.wait()
  return state
