"""The one host-side training loop: pre-training, SFT and GRPO all run through ``run``.

``run`` drives a jitted ``step(state, batch) -> (state, metrics)`` (from
``opd.training.train_step.make_train_step``) over a batch source, which is
either

* a plain iterator of host batches (pre-training, SFT: one update per
  batch), or
* a ``RolloutSource`` (GRPO): an object that builds each step's batch from
  the current state (rollouts, rewards, advantages) and may take several
  updates on it.

A trainer is then a loss function plus a batch source composed into ``run``;
the loop owns everything else: resume (state *and* source position), the
checkpoint cadence, eval, NaN/inf checks, metrics (``on_metrics``, a
``MetricWriter``) and the progress bar.

Steps: ``run`` counts *batches*. A step is one batch and its
``updates_per_batch`` optimizer updates, so ``state.step ==
step * updates_per_batch`` (plain iterators: 1 update, a step is an update);
checkpoints are numbered by step.

Checkpoints, the same in every trainer: with a ``checkpoint_manager``,
``save_every=k`` saves after every k-th step and after the last one;
``save_every`` 0 or None saves only after the last step. Eval likewise:
every ``eval_every`` steps (0 or None: none in between) and after the last.

NaN/inf: the step itself discards a non-finite update (loss, gradients, or
the updated parameters and optimizer state), and ``run`` raises
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
* Config: on resume the whole ``config`` is compared with the checkpoint's;
  every differing field is named, and only those in ``allow_config_change``
  (argument, or ``allowed_config_changes`` around the call) may differ.
* SIGTERM: the step in progress finishes, a checkpoint of it is saved, the
  logs synced, and ``Terminated`` (a ``SystemExit`` with status 143 =
  128 + SIGTERM) is raised with a message naming the step.
* A checkpoint that fails its checksums raises ``CheckpointCorruptError``
  naming the step, the array and the previous checkpoint; with
  ``fall_back_on_corrupt`` the corrupt step is moved aside
  (``<step>.corrupt``) and the previous one is used, with a warning.
"""
from __future__ import annotations

import logging
import pathlib
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from opd.config.fields import check_int
from opd.training.checkpoints import CheckpointManager
from opd.training.metrics_writer import MetricWriter
from opd.training.resume import (TERMINATED_STATUS, SigtermFlag, Terminated,
                                 allowed_config_changes, context_allowances, resume, rewind_logs,
                                 synced_writers)
from opd.training.train_step import NonFiniteError, TrainState, raise_if_nonfinite

log = logging.getLogger(__name__)

__all__ = ["RolloutSource", "run", "run_trainer", "resume", "NonFiniteError", "Terminated",
           "allowed_config_changes", "TERMINATED_STATUS"]

@runtime_checkable
class RolloutSource(Protocol):
  """A batch source that needs the current state (e.g. GRPO's rollouts).

  Attributes:
    updates_per_batch: optimizer updates ``run`` takes on each batch.
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


def run(state: TrainState, step_fn: Callable[[TrainState, Any], tuple[TrainState, Mapping]],
        data_iterator: Iterator | RolloutSource, num_steps: int, *,
        checkpoint_manager: CheckpointManager | None = None, save_every: int | None = None,
        config: Mapping | None = None, match_config: Sequence[str] | None = None,
        allow_config_change: Sequence[str] = (), fall_back_on_corrupt: bool = False,
        first_metrics: dict | None = None,
        on_metrics: Callable[[int, dict[str, float]], None] | None = None,
        writer: MetricWriter | None = None,
        eval_fn: Callable[[TrainState], Mapping[str, Any]] | None = None,
        eval_every: int | None = None, prepare_batch: Callable[[Any], Any] | None = None,
        progress: bool = True, desc: str = "train", progress_key: str = "loss") -> TrainState:
  """Trains until ``num_steps`` steps are done; returns the final state.

  Args:
    state: the initial state, or its abstract form (``abstract_train_state``)
      when a checkpoint is sure to exist; the latest checkpoint, if any,
      replaces it (restored onto its shardings).
    step_fn: ``step(state, batch) -> (state, metrics)``; metrics must hold
      ``finite``, ``loss_finite``, ``grads_finite`` and ``loss`` (as
      ``make_train_step``'s do).
    data_iterator: the batch source: an iterator of host batches or a
      ``RolloutSource``. If it has ``get_state``/``set_state`` (grain
      iterators and rollout sources do) its position is checkpointed and
      restored.
    num_steps: total number of steps (counting those before a resume).
    checkpoint_manager: where to resume from and save to.
    save_every: save after every this many steps and after the last one
      (0 or None: only after the last); needs ``checkpoint_manager``.
    config: JSON dict saved with each checkpoint.
    match_config: the top-level ``config`` entries compared with the
      checkpoint's on resume; None (the default): the whole config.
    allow_config_change: dotted config fields (or groups) that may differ
      from the checkpoint's on resume, each logged; ``train.steps`` also
      names ``experiment.train.steps``. Added to those of an enclosing
      ``allowed_config_changes``.
    fall_back_on_corrupt: resume from the previous checkpoint when the latest
      fails its checksums (it is moved aside, not deleted); else raise.
    first_metrics: a dict saved with every checkpoint and restored on
      resume: before a fresh run the caller may put figures measured before
      training at key 0; ``run`` adds step 1's metrics at key 1. After a
      resume it holds the original run's (keys as ints).
    on_metrics: ``on_metrics(step, metrics)`` with python floats after each
      step (``step`` = steps done so far); on eval steps the eval metrics are
      included, prefixed ``eval/``.
    writer: each step's metrics go to its ``write_scalars`` (and a rollout
      source's ``texts`` to ``write_texts``); flushed, not closed, at the end.
    eval_fn: ``eval_fn(state) -> metrics``, every ``eval_every`` steps (0 or
      None: none in between) and after the last step.
    prepare_batch: applied to each plain iterator's batch before the step
      (e.g. ``functools.partial(shard_batch, mesh=mesh, rules=rules)``).
    progress: show a tqdm bar (process 0 only), labelled ``desc`` and
      showing the metric ``progress_key``.

  Raises:
    NonFiniteError: a step had a NaN/inf loss, gradient or update; names the
      step. Nothing is saved for that step; ``err.state`` is the state the
      discarded update left (equal to the state before it).
    Terminated: SIGTERM arrived; the last finished step was saved first.
    ValueError: bad arguments, a config that differs from the checkpoint's,
      or an abstract ``state`` with no checkpoint.
    CheckpointCorruptError: see ``resume``.
  """
  num_steps = check_int("run", "num_steps", num_steps, min_value=0)
  save_every = check_int("run", "save_every", save_every, min_value=0, allow_none=True) or 0
  eval_every = check_int("run", "eval_every", eval_every, min_value=0, allow_none=True) or 0
  if save_every and checkpoint_manager is None:
    raise ValueError(f"save_every={save_every} is set but checkpoint_manager is None")
  if eval_every and eval_fn is None:
    raise ValueError(f"eval_every={eval_every} is set but eval_fn is None")
  is_source = _check_source(data_iterator)
  updates = int(data_iterator.updates_per_batch) if is_source else 1

  if first_metrics is not None and not isinstance(first_metrics, dict):
    raise ValueError(f"first_metrics must be a dict (run fills it), got "
                     f"{type(first_metrics).__name__}")
  context_allow, context_fall_back = context_allowances()
  allow = tuple(allow_config_change) + context_allow
  compared = None
  if config:
    compared = dict(config) if match_config is None else \
        {k: config[k] for k in match_config if k in config}
  state, restored = resume(state, checkpoint_manager, data_iterator, config=compared,
                           allow_config_change=allow,
                           fall_back_on_corrupt=fall_back_on_corrupt or context_fall_back)
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
    raise ValueError("state is abstract (ShapeDtypeStructs) but there is no checkpoint to resume "
                     f"from under {getattr(checkpoint_manager, 'directory', None)}")
  done_updates = int(jax.device_get(state.step))
  if done_updates % updates:
    raise ValueError(f"state.step={done_updates} is not a multiple of updates_per_batch="
                     f"{updates}: the checkpoint was written with another updates_per_batch")
  start = step = done_updates // updates
  firsts = first_metrics if first_metrics is not None else {}
  if restored is not None:
    saved_first = restored.extra.get("first_metrics") or {}
    if saved_first:
      firsts.clear()
      firsts.update({int(k): dict(v) for k, v in saved_first.items()})
    if start < num_steps:  # rows after the checkpoint are redone: cut them
      rewind_logs(writer, restored.extra.get("logs") or {})
  position = (lambda: data_iterator.get_state()) if hasattr(data_iterator, "get_state") \
      else (lambda: None)
  bar = None
  if progress and jax.process_index() == 0 and start < num_steps:
    from tqdm.auto import tqdm
    bar = tqdm(total=num_steps, initial=start, desc=desc, dynamic_ncols=True)

  manager = checkpoint_manager
  last_saved = start if manager is not None and manager.latest_step() == start else None

  def save(metrics=None):
    logs = {}
    for w in synced_writers(writer):  # every row so far durable before the checkpoint names it
      length, path = w.sync(), getattr(w, "jsonl_path", None)
      if length is not None and path is not None:
        logs[str(path)] = length
    manager.save(step, state, data_state=position(), config=config, metrics=metrics,
                 extra={"first_metrics": {str(k): v for k, v in firsts.items()}, "logs": logs})

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
      if eval_fn is not None and ((eval_every and step % eval_every == 0) or step == num_steps):
        metrics.update({f"eval/{k}": v for k, v in _host_scalars(eval_fn(state)).items()})
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
      if manager is not None and ((save_every and step % save_every == 0) or step == num_steps):
        save(metrics)
        last_saved = step
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


def run_trainer(state: TrainState, step_fn: Callable[[TrainState, Any], tuple[TrainState, Mapping]],
                source: Iterator | RolloutSource, num_steps: int, *,
                checkpoint_dir: str | pathlib.Path | None = None, keep_checkpoints: int = 2,
                workdir: str | pathlib.Path | None = None, writer: MetricWriter | None = None,
                on_metrics: Callable[[int, dict[str, float]], None] | None = None,
                eval_fn: Callable[[Any], Mapping[str, Any]] | None = None,
                **run_kwargs) -> tuple[TrainState, list[dict[str, float]]]:
  """``run`` with the resources a trainer owns: returns ``(state, history)``.

  Opens (and closes) a ``CheckpointManager`` on ``checkpoint_dir`` and a
  ``MetricWriter`` on ``workdir`` unless an open ``writer`` is given (that one
  is flushed by ``run``, never closed here), collects every step's metrics
  into the returned history, and passes ``eval_fn`` the params (not the
  state). ``run_kwargs`` go to ``run`` (``save_every``, ``config``,
  ``match_config``, ``allow_config_change``, ``first_metrics``, ``eval_every``,
  ``progress``, ``desc``, ...). GRPO and
  distillation are this call with their own source and loss.
  """
  manager = (CheckpointManager(checkpoint_dir, max_to_keep=keep_checkpoints)
             if checkpoint_dir is not None else None)
  own_writer = MetricWriter(workdir) if writer is None and workdir is not None else None
  history: list[dict[str, float]] = []

  def report(step: int, metrics: dict[str, float]) -> None:
    history.append(metrics)
    if on_metrics is not None:
      on_metrics(step, metrics)

  try:
    state = run(state, step_fn, source, num_steps, checkpoint_manager=manager,
                on_metrics=report, writer=writer if writer is not None else own_writer,
                eval_fn=(lambda st: eval_fn(st.params)) if eval_fn is not None else None,
                **run_kwargs)
  finally:
    if own_writer is not None:
      own_writer.close()
    if manager is not None:
      manager.close()
  return state, history

