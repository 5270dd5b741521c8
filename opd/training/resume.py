"""Resuming and stopping ``opd.training.loop.train``: the config check, the
fallback from a corrupt checkpoint, the metric logs kept in step with the
checkpoints, and SIGTERM (docs/DESIGN.md, "Failure model").
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import signal
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from opd.config.migrations import migrate
from opd.config.overrides import config_mismatches
from opd.training.checkpoints import CheckpointCorruptError, CheckpointManager
from opd.training.metrics_writer import open_writers

log = logging.getLogger(__name__)

TERMINATED_STATUS = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended

# Set by ``allowed_config_changes`` (the launcher's --allow_config_change and
# --fall_back_on_corrupt reach every ``run`` of a job this way).
_ALLOWED: contextvars.ContextVar[tuple[tuple[str, ...], bool]] = contextvars.ContextVar(
    "opd_training_loop_allowed", default=((), False))


@contextlib.contextmanager
def allowed_config_changes(fields: Sequence[str] = (), *, fall_back_on_corrupt: bool = False):
  """Within this context every ``run`` resumes even where ``fields`` of its
  config differ from the checkpoint's (see ``run``'s ``allow_config_change``)
  and, with ``fall_back_on_corrupt``, from the previous checkpoint when the
  latest is corrupt."""
  token = _ALLOWED.set((tuple(f.strip() for f in fields if f.strip()), bool(fall_back_on_corrupt)))
  try:
    yield
  finally:
    _ALLOWED.reset(token)


def context_allowances() -> tuple[tuple[str, ...], bool]:
  """``(fields, fall_back_on_corrupt)`` of the enclosing ``allowed_config_changes``."""
  return _ALLOWED.get()


class Terminated(SystemExit):
  """``run`` got SIGTERM: it saved a checkpoint of the last finished step and
  stopped. Exit status ``TERMINATED_STATUS`` (143); ``step`` is the step saved
  (None without a checkpoint manager)."""

  def __init__(self, message: str, step: int | None):
    super().__init__(TERMINATED_STATUS)
    self.message, self.step = message, step

  def __str__(self) -> str:
    return self.message


def _allowed(field: str, allow: Sequence[str]) -> bool:
  """Whether ``field`` (dotted) is named by ``allow``: exactly or as a group,
  from the top of the config or from below its first entry (``train.steps``
  names ``experiment.train.steps``: the launcher's names are the experiment
  config's)."""
  parts = field.split(".")
  tails = [field] + ([".".join(parts[1:])] if len(parts) > 1 else [])
  return any(t == a or t.startswith(a + ".") for t in tails for a in allow)


def _config_changes(saved: Mapping, config: Mapping) -> list[tuple[str, Any, Any]]:
  """``(field, saved, new)`` for every leaf that differs, either way round;
  ``saved`` in today's layout (``opd.config.migrations``: a checkpoint of a
  run launched before a config group was nested)."""
  saved = migrate(saved)
  out = config_mismatches(saved, config)
  out += [(name, want, "<missing>") for name, have, want in config_mismatches(config, saved)
          if have == "<missing>"]
  return sorted(out, key=lambda t: t[0])


def _check_config(manager: CheckpointManager, step: int, config: Mapping,
                  allow: Sequence[str]) -> None:
  changes = _config_changes(manager.read_config(step), config)
  refused = [c for c in changes if not _allowed(c[0], allow)]
  if refused:
    detail = "; ".join(f"{k}: checkpoint has {have!r}, now {want!r}" for k, have, want in refused)
    raise ValueError(
        f"checkpoint {manager.step_path(step)} was saved with a different config: {detail}. "
        "Use a new directory, or allow these changes (allow_config_change / "
        f"--allow_config_change={','.join(k for k, _, _ in refused)}) if continuing the run "
        "under the new values is intended")
  for k, have, want in changes:
    log.warning("resuming %s with config field %s changed from %r to %r (allowed)",
                manager.step_path(step), k, have, want)


def resume(state, checkpoint_manager: CheckpointManager | None, data_iterator=None, *,
           config: Mapping | None = None, allow_config_change: Sequence[str] = (),
           fall_back_on_corrupt: bool = False):
  """Restores the latest checkpoint onto ``state``'s shardings, if there is one.

  The batch source's position is restored too (``set_state``). Returns
  ``(state, restored)``: ``restored`` is the ``Restored`` record, or None (and
  ``state`` itself) when the directory holds no checkpoint.

  Raises:
    ValueError: ``config`` differs from the checkpoint's outside
      ``allow_config_change`` (every differing field named); or the
      checkpoint holds a source position but ``data_iterator`` has no
      ``set_state`` (re-reading data from the start silently would bias the run).
    CheckpointCorruptError: the latest checkpoint fails its checksums (names
      the step, the array and the previous step), unless
      ``fall_back_on_corrupt``: then it is moved aside and the previous one
      tried, with a warning.
  """
  if checkpoint_manager is None or checkpoint_manager.latest_step() is None:
    return state, None
  step = checkpoint_manager.latest_step()
  if config is not None:
    _check_config(checkpoint_manager, step, config, allow_config_change)
  while True:
    try:
      restored = checkpoint_manager.restore(state)
      break
    except CheckpointCorruptError as err:
      if not fall_back_on_corrupt or err.previous is None:
        raise
      moved = checkpoint_manager.quarantine(err.step)
      log.warning("checkpoint step %d is corrupt (%s); moved it to %s and resuming from step %d",
                  err.step, err, moved, err.previous)
  if restored.data_state:
    if data_iterator is None or not hasattr(data_iterator, "set_state"):
      raise ValueError(f"checkpoint {restored.path} holds a data iterator position "
                       f"{restored.data_state} but the data iterator "
                       f"{type(data_iterator).__name__} has no set_state()")
    data_iterator.set_state(restored.data_state)
  log.info("resumed from %s (step %d)", restored.path, restored.step)
  return restored.state, restored


def synced_writers(writer) -> list:
  """The metric logs kept in step with checkpoints: every open
  ``MetricWriter`` of the process, and ``writer`` if it is another kind
  with ``sync``/``rewind``."""
  out = open_writers()
  if writer is not None and writer not in out and hasattr(writer, "sync"):
    out.append(writer)
  return out


def rewind_logs(writer, logs: Mapping[str, int]) -> None:
  """Cuts each open log named in ``logs`` (a checkpoint's ``{path: length}``)
  back to its length at that checkpoint."""
  for w in synced_writers(writer):
    path = str(getattr(w, "jsonl_path", ""))
    if path in logs:
      w.rewind(int(logs[path]))


class SigtermFlag:
  """Turns SIGTERM into a flag the loop checks between steps (main thread
  only: elsewhere Python cannot install handlers, and SIGTERM stays fatal)."""

  def __init__(self):
    self.hit, self._previous = False, None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    self.hit = True

  def agreed(self) -> bool:
    """Whether any process got SIGTERM: every process of a multi-host run
    must stop after the same step (the others would wait in its collectives)."""
    import jax
    if jax.process_count() == 1:
      return self.hit
    from jax.experimental import multihost_utils
    return bool(np.max(multihost_utils.process_allgather(np.int32(self.hit))))

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
