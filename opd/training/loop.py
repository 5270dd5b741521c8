"""The one host-side training loop: every trainer runs through ``train``.

``train(state, step_fn, source, loop, io)`` (``LoopConfig``, ``RunIO`` from
``opd.training.loop_config``) drives a jitted ``step(state, batch) -> (state, metrics)`` (from
``opd.training.train_step.make_train_step``) over a batch source, which is
either

* a plain iterator of host batches (pre-training, SFT: one update per
  batch), or
* a ``RolloutSource`` (GRPO): an object that builds each step's batch from
  the current state (rollouts, rewards, advantages) and may take several
  updates on it.

A trainer is then a loss function plus a batch source composed into
``train``; the loop owns everything else: resume (state *and* source position), the
checkpoint cadence, eval, NaN/inf checks, metrics (``on_metrics``, a
``MetricWriter``) and the progress bar.

Steps: the loop counts *batches*. A step is one batch and its
``updates_per_batch`` optimizer updates, so ``state.step ==
step * updates_per_batch`` (plain iterators: 1 update, a step is an update);
checkpoints are numbered by step.

Checkpoints, the same in every trainer: with a checkpoint directory or
manager (``RunIO``), ``LoopConfig.save_every=k`` saves after every k-th step and after the last one;
``save_every`` 0 or None saves only after the last step. Eval likewise:
every ``eval_every`` steps (0 or None: none in between) and after the last.

NaN/inf: the step itself discards a non-finite update (loss, gradients, or
the updated parameters and optimizer state), and the loop raises
``NonFiniteError`` naming the step (1-based, as metrics are reported)
before anything is saved, so the last good checkpoint on disk is untouched.
The exception carries the state as ``err.state``.

Crash safety (docs/DESIGN.md, "Failure model"):

* Metric logs: at every save the open ``MetricWriter``s of the process are
  synced (fsync) and their lengths stored in the checkpoint; a resume cuts
  them back to those lengths, so a killed-and-resumed run's
  ``metrics.jsonl`` equals the uninterrupted run's.
* First-step figures: ``first_metrics`` is saved with every checkpoint and
  restored on resume, so "the loss at step 1" is the original run's.
* Config: on resume the whole ``RunIO.config`` is compared with the
  checkpoint's; every differing field is named, and only those in
  ``LoopConfig.allow_config_change`` (or ``allowed_config_changes`` around
  the call) may differ.
* SIGTERM: the step in progress finishes, a checkpoint of it is saved, the
  logs synced, and ``Terminated`` (a ``SystemExit`` with status 143 =
  128 + SIGTERM) is raised with a message naming the step.
* Early stop (``LoopConfig.early_stop_metric``, ``opd.training.early_stop``):
  after the eval that exhausts the patience (or reaches
  ``early_stop_target``) the loop saves a checkpoint of
  that step (with the rule's state), logs why and returns; a relaunch with
  the same rule restores that state and trains no further.
* A checkpoint that fails its checksums raises ``CheckpointCorruptError``
  naming the step, the array and the previous checkpoint; with
  ``LoopConfig.fall_back_on_corrupt`` the corrupt step is moved aside
  (``<step>.corrupt``) and the previous one is used, with a warning.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence, \
    runtime_checkable

import jax
import numpy as np

from opd.config.fields import check_int
from opd.training.checkpoints import CheckpointManager
from opd.training.early_stop import EarlyStop
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.metrics_writer import MetricWriter
from opd.training.resume import (TERMINATED_STATUS, SigtermFlag, Terminated,
                                 allowed_config_changes, context_allowances, resume, rewind_logs,
                                 synced_writers)
from opd.training.train_step import NonFiniteError, TrainState, raise_if_nonfinite

log = logging.getLogger(__name__)

__all__ = ["LoopConfig", "RolloutSource", "RunIO", "Runtime", "TrainRun", "train", "resume",
           "NonFiniteError", "Terminated", "allowed_config_changes", "TERMINATED_STATUS"]

@runtime_checkable
class RolloutSource(Protocol):
  """A batch source that needs the current state (e.g. GRPO's rollouts).

  Attributes:
    updates_per_batch: optimizer updates the loop takes on each batch.
  """
  updates_per_batch: int

  def next_batch(self, state: TrainState, step: int) -> tuple[Any, dict[str, float]] | None:
    """The batch for 0-based ``step`` (built from ``state``) and host-side
    metrics about it; None when the source is exhausted."""

  def step_metrics(self, host_metrics: dict[str, float], train_metrics: dict[str, float], *,
                   batch_time_s: float, train_time_s: float) -> dict[str, float]:
    """The metrics reported for a step, from ``next_batch``'s host metrics,
    the mean over the step's updates of the train step's metrics and the
    seconds spent in ``next_batch`` and in the updates."""

  def texts(self, step: int) -> Mapping[str, str]:
    """Text summaries of the 1-based ``step`` just taken for the writer (may be empty)."""

  def get_state(self) -> Mapping[str, Any]:
    """The source's position (JSON), saved with each checkpoint."""

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores a position from ``get_state``."""


def _host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  out = {}
  for k, v in jax.device_get(dict(metrics)).items():
    a = np.asarray(v)
    out[k] = float(a) if a.size == 1 else float(a.mean())
  return out


def _check_source(source) -> bool:
  """Whether ``source`` is a ``RolloutSource`` (else a plain iterator)."""
  if not hasattr(source, "next_batch"):
    return False
  if not isinstance(source, RolloutSource):
    missing = [n for n in ("updates_per_batch", "next_batch", "step_metrics", "texts",
                           "get_state", "set_state") if not hasattr(source, n)]
    raise ValueError(f"{type(source).__name__} has next_batch but lacks {missing} of the "
                     "RolloutSource protocol")
  check_int(type(source).__name__, "updates_per_batch", source.updates_per_batch, min_value=1)
  return True


def _mean_metrics(per_update: Sequence[Mapping[str, float]]) -> dict[str, float]:
  if len(per_update) == 1:
    return dict(per_update[0])
  return {k: float(np.mean([m[k] for m in per_update])) for k in per_update[0]}


class TrainRun(NamedTuple):
  """What ``train`` returns: the final state and one metrics dict per step run."""
  state: TrainState
  history: list[dict[str, float]]


def train(state: TrainState, step_fn: Callable[[TrainState, Any], tuple[TrainState, Mapping]],
          source: Iterator | RolloutSource, loop: LoopConfig, io: RunIO | None = None, *,
          prepare_batch: Callable[[Any], Any] | None = None, desc: str = "train",
          progress_key: str = "loss") -> TrainRun:
  """Trains until ``loop.steps`` steps are done; returns the final state and the history.

  Args:
    state: the initial state, or its abstract form (``abstract_train_state``)
      when a checkpoint is sure to exist; the latest checkpoint, if any,
      replaces it (restored onto its shardings).
    step_fn: ``step(state, batch) -> (state, metrics)``; metrics must hold
      ``finite``, ``loss_finite``, ``grads_finite`` and ``loss`` (as
      ``make_train_step``'s do).
    source: the batch source: an iterator of host batches or a
      ``RolloutSource``. If it has ``get_state``/``set_state`` (grain
      iterators and rollout sources do) its position is checkpointed and
      restored.
    loop: steps (counting those before a resume), save / eval cadence, the
      resume rules and the progress bar (``LoopConfig``).
    io: where metrics and checkpoints go, the config saved with them,
      ``first_metrics``, and the ``on_metrics`` / ``eval_fn(params)`` hooks
      (``RunIO``; None: nothing written). A ``workdir`` writer and a
      ``checkpoint_dir`` manager are opened and closed here; a given
      ``writer`` / ``checkpoint_manager`` is flushed, not closed.
    prepare_batch: applied to each plain iterator's batch before the step
      (e.g. ``functools.partial(shard_batch, mesh=mesh, rules=rules)``).
    desc, progress_key: the progress bar's label and the metric it shows.

  Raises:
    NonFiniteError: a step had a NaN/inf loss, gradient or update; names the
      step. Nothing is saved for that step; ``err.state`` is the state the
      discarded update left (equal to the state before it).
    Terminated: SIGTERM arrived; the last finished step was saved first.
    ValueError: bad arguments, a config that differs from the checkpoint's,
      or an abstract ``state`` with no checkpoint.
    CheckpointCorruptError: see ``resume``.
  """
  if not isinstance(loop, LoopConfig):
    raise ValueError(f"loop must be a LoopConfig, got {type(loop).__name__}")
  io = io if io is not None else RunIO()
  if not isinstance(io, RunIO):
    raise ValueError(f"io must be a RunIO or None, got {type(io).__name__}")
  manager = io.checkpoint_manager
  if manager is None and io.checkpoint_dir is not None:
    manager = CheckpointManager(io.checkpoint_dir, max_to_keep=loop.keep_checkpoints)
  own_writer = MetricWriter(io.workdir) if io.writer is None and io.workdir is not None else None
  history: list[dict[str, float]] = []

  def report(step: int, metrics: dict[str, float]) -> None:
    history.append(metrics)
    if io.on_metrics is not None:
      io.on_metrics(step, metrics)

  try:
    state = _run(state, step_fn, source, loop, manager=manager, config=io.config,
                 first_metrics=io.first_metrics, on_metrics=report,
                 writer=io.writer if io.writer is not None else own_writer,
                 eval_fn=(lambda st: io.eval_fn(st.params)) if io.eval_fn is not None else None,
                 prepare_batch=prepare_batch, desc=desc, progress_key=progress_key)
  finally:
    if own_writer is not None:
      own_writer.close()
    if manager is not None and io.checkpoint_manager is None:
      manager.close()
  return TrainRun(state, history)


def _run(state, step_fn, data_iterator, loop: LoopConfig, *, manager, config, first_metrics,
         on_metrics, writer, eval_fn, prepare_batch, desc, progress_key) -> TrainState:
  """``train``'s engine (its arguments resolved: an open ``manager`` and
  ``writer`` or None, ``eval_fn(state)``)."""
  num_steps, save_every, eval_every = loop.steps, loop.save_every, loop.eval_every
  if save_every and manager is None:
    raise ValueError(f"LoopConfig.save_every={save_every} is set but checkpoint_manager is None "
                     "(RunIO has no checkpoint_dir or checkpoint_manager)")
  if eval_every and eval_fn is None:
    raise ValueError(f"LoopConfig.eval_every={eval_every} is set but eval_fn is None")
  is_source = _check_source(data_iterator)
  updates = int(data_iterator.updates_per_batch) if is_source else 1

  context_allow, context_fall_back = context_allowances()
  allow = loop.allow_config_change + context_allow
  state, restored = resume(state, manager, data_iterator, config=dict(config) if config else None,
                           allow_config_change=allow,
                           fall_back_on_corrupt=loop.fall_back_on_corrupt or context_fall_back)
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
    raise ValueError("state is abstract (ShapeDtypeStructs) but there is no checkpoint to resume "
                     f"from under {getattr(manager, 'directory', None)}")
  done_updates = int(jax.device_get(state.step))
  if done_updates % updates:
    raise ValueError(f"state.step={done_updates} is not a multiple of updates_per_batch="
                     f"{updates}: the checkpoint was written with another updates_per_batch")
  start = step = done_updates // updates
  firsts = first_metrics if first_metrics is not None else {}
  stopper = (EarlyStop(loop.early_stop_metric, loop.early_stop_mode, loop.early_stop_patience,
                       loop.early_stop_min_delta, loop.early_stop_target)
             if loop.early_stop_metric else None)
  if restored is not None:
    saved_first = restored.extra.get("first_metrics") or {}
    if saved_first:
      firsts.clear()
      firsts.update({int(k): dict(v) for k, v in saved_first.items()})
    if start < num_steps:  # rows after the checkpoint are redone: cut them
      rewind_logs(writer, restored.extra.get("logs") or {})
    if stopper is not None:
      stopper.restore(restored.extra.get("early_stop"))
      if stopper.stopped_at is not None:
        log.warning("%s; a relaunch with the same rule trains no further (turn "
                    "LoopConfig.early_stop_metric off to continue)", stopper.reason())
        return state
  position = (lambda: data_iterator.get_state()) if hasattr(data_iterator, "get_state") \
      else (lambda: None)
  bar = None
  if loop.progress and jax.process_index() == 0 and start < num_steps:
    from tqdm.auto import tqdm
    bar = tqdm(total=num_steps, initial=start, desc=desc, dynamic_ncols=True)

  last_saved = start if manager is not None and manager.latest_step() == start else None

  def save(metrics=None):
    logs = {}
    for w in synced_writers(writer):  # every row so far durable before the checkpoint names it
      length, path = w.sync(), getattr(w, "jsonl_path", None)
      if length is not None and path is not None:
        logs[str(path)] = length
    manager.save(step, state, data_state=position(), config=config, metrics=metrics,
                 extra={"first_metrics": {str(k): v for k, v in firsts.items()}, "logs": logs,
                        "early_stop": stopper.to_json() if stopper is not None else None})

  sigterm = SigtermFlag()
  try:
    sigterm.__enter__()
    while step < num_steps and not sigterm.agreed():
      t0 = time.perf_counter()
      if is_source:
        out = data_iterator.next_batch(state, step)
        batch, host_metrics = out if out is not None else (None, None)
      else:
        batch, host_metrics = next(data_iterator, None), {}
      if batch is None:
        log.warning("batch source exhausted after %d steps (asked for %d)", step, num_steps)
        break
      if prepare_batch is not None and not is_source:
        batch = prepare_batch(batch)
      t1 = time.perf_counter()
      per_update = []
      for _ in range(updates):
        new_state, m = step_fn(state, batch)
        m = _host_scalars(m)
        try:
          raise_if_nonfinite(m, step + 1)
        except NonFiniteError as err:
          err.state = new_state  # the step discarded the update
          raise
        state = new_state
        per_update.append(m)
      metrics = _mean_metrics(per_update)
      if is_source:
        metrics = data_iterator.step_metrics(host_metrics, metrics, batch_time_s=t1 - t0,
                                             train_time_s=time.perf_counter() - t1)
      step += 1
      stop = False
      if eval_fn is not None and ((eval_every and step % eval_every == 0) or step == num_steps):
        metrics.update({f"eval/{k}": v for k, v in _host_scalars(eval_fn(state)).items()})
        stop = stopper is not None and stopper.update(step, metrics)
      if step == 1:
        firsts[1] = dict(metrics)
      if writer is not None:
        writer.write_scalars(step, metrics)
        texts = data_iterator.texts(step) if is_source else None
        if texts:
          writer.write_texts(step, texts)
      if on_metrics is not None:
        on_metrics(step, metrics)
      if bar is not None:
        bar.update(1)
        if progress_key in metrics:
          bar.set_postfix({progress_key: f"{metrics[progress_key]:.4f}"})
      if manager is not None and ((save_every and step % save_every == 0) or step == num_steps
                                  or stop):
        save(metrics)
        last_saved = step
      if stop:
        log.warning("%s", stopper.reason())
        break
    if manager is not None:
      if last_saved != step and step > start:  # SIGTERM, or the source ran out
        save()
        last_saved = step
      manager.wait()
  finally:
    sigterm.__exit__()
    if bar is not None:
      bar.close()
    if writer is not None:
      writer.flush()
  if step < num_steps and sigterm.agreed():
    where = (f"saved checkpoint {manager.step_path(last_saved)}" if last_saved is not None else
             "no checkpoint manager: nothing saved" if manager is None else
             "no step was finished since the last checkpoint")
    message = (f"received SIGTERM: stopped after step {step} of {num_steps} ({where}); exiting "
               f"with status {TERMINATED_STATUS}; relaunch the same command to resume")
    print(message, file=sys.stderr, flush=True)
    raise Terminated(message, last_saved)
  return state
