"""Metrics to TensorBoard event files and a JSONL log, from the main process only.

``MetricWriter(workdir)`` writes

* ``workdir/events.out.tfevents.*`` via tensorboard's own event writer (no
  TensorFlow needed): scalars as ``simple_value``, text through the text
  plugin, histograms as ``HistogramProto``. ``EventAccumulator`` reads them
  back with ``Scalars``, ``Tensors`` and ``Histograms``.
* ``workdir/metrics.jsonl``: one JSON object per step,
  ``{"step": s, "wall_time": t, "<name>": value, ...}``; scalars written for
  the same step in several calls are merged into one line, emitted when a
  later step arrives or on ``flush``/``close``. Text and histograms go to
  TensorBoard only.

Crash safety (docs/DESIGN.md, "Failure model"): every emitted line is flushed
to the OS at once, so a killed process loses at most the step in progress;
``sync`` also fsyncs and returns the file's length, which
``opd.training.loop.train`` stores with each checkpoint and, on resume, hands
back to ``rewind``: rows written after that checkpoint are cut, so a
killed-and-resumed run's log equals the uninterrupted run's. A torn last line
(a crash in the middle of a write) is cut with a warning when a writer opens
the file and skipped with a warning by ``read_metrics``.

In a multi-host run every process may call the writer; only the process with
``jax.process_index() == 0`` writes, the others do nothing.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

# The open writers of this process that keep a JSONL log (see ``open_writers``).
_OPEN: "weakref.WeakSet[MetricWriter]" = weakref.WeakSet()


def open_writers() -> list["MetricWriter"]:
  """The writers of this process whose ``metrics.jsonl`` is open.

  ``opd.training.loop.train`` syncs them at every checkpoint and rewinds them
  on resume, whichever way the caller routes its metrics to them.
  """
  return [w for w in list(_OPEN) if w._jsonl is not None and not w._closed]


def repair_torn_tail(path: str | os.PathLike) -> int:
  """Cuts a last line that has no newline (a write a crash tore); returns the bytes cut.

  Logs a warning naming the file and the dropped text. A missing file is left alone.
  """
  path = pathlib.Path(path)
  try:
    size = path.stat().st_size
  except FileNotFoundError:
    return 0
  if size == 0:
    return 0
  with open(path, "rb+") as f:
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return 0
    # Find the start of the last line.
    pos, keep = size, 0
    while pos > 0:
      step = min(65536, pos)
      f.seek(pos - step)
      chunk = f.read(step)
      nl = chunk.rfind(b"\n")
      if nl >= 0:
        keep = pos - step + nl + 1
        break
      pos -= step
    f.seek(keep)
    torn = f.read(size - keep)
    f.truncate(keep)
    f.flush()
    os.fsync(f.fileno())
  log.warning("%s: cut a torn last line (%d bytes, %r...) left by an interrupted write",
              path, size - keep, torn[:80].decode("utf-8", "replace"))
  return size - keep


def is_main_process() -> bool:
  """True on the process that owns logging (``jax.process_index() == 0``)."""
  import jax  # deferred so that reading metrics never needs jax
  return jax.process_index() == 0


def _to_float(name: str, value: Any) -> float:
  array = np.asarray(value)
  if array.size != 1:
    raise ValueError(f"scalar metric {name!r} must have one element, got shape {array.shape}")
  if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
    raise ValueError(f"scalar metric {name!r} must be numeric, got {value!r}")
  return float(array.reshape(()))


def _check_step(step: Any) -> int:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int, got {step!r}")
  return int(step)


def histogram_proto(values: Any, bins: int = 30):
  """A ``HistogramProto`` of ``values`` (any shape) with ``bins`` equal buckets."""
  from tensorboard.compat.proto import summary_pb2
  data = np.asarray(values, np.float64).reshape(-1)
  if data.size == 0:
    raise ValueError("histogram of an empty array")
  if not np.all(np.isfinite(data)):
    raise ValueError(f"histogram values must be finite, got {int((~np.isfinite(data)).sum())} "
                     "non-finite entries")
  counts, edges = np.histogram(data, bins=bins)
  return summary_pb2.HistogramProto(
      min=float(data.min()), max=float(data.max()), num=float(data.size),
      sum=float(data.sum()), sum_squares=float(np.square(data).sum()),
      bucket_limit=[float(e) for e in edges[1:]], bucket=[float(c) for c in counts])


class MetricWriter:
  """Writes scalars, text and histograms for one run directory.

  Usage::

    with MetricWriter(workdir) as w:
      w.write_scalars(step, {"loss": loss, "lr": lr})
      w.write_texts(step, {"sample": text})
      w.write_histograms(step, {"logits": logits})
  """

  def __init__(self, logdir: str | os.PathLike, *, is_main: bool | None = None,
               tensorboard: bool = True, jsonl: bool = True):
    """Opens the writers.

    Args:
      logdir: directory for the event file and ``metrics.jsonl``.
      is_main: whether this process writes; default ``is_main_process()``.
      tensorboard: write the TensorBoard event file.
      jsonl: write ``metrics.jsonl``.
    """
    self.logdir = pathlib.Path(logdir)
    self.is_main = is_main_process() if is_main is None else bool(is_main)
    self._events = None
    self._jsonl = None
    self._pending: dict[str, Any] | None = None
    # The last emitted row and the offset it starts at: a later write for the
    # same step (after a ``flush`` emitted it) rewrites that line merged,
    # unless a ``sync`` has made it durable (its length may be in a
    # checkpoint): then the later values go to a new line for that step.
    self._last: tuple[dict[str, Any], int] | None = None
    self._synced = 0
    self._closed = False
    if not self.is_main:
      return
    self.logdir.mkdir(parents=True, exist_ok=True)
    if tensorboard:
      from tensorboard.summary.writer.event_file_writer import EventFileWriter
      self._events = EventFileWriter(str(self.logdir))
    if jsonl:
      repair_torn_tail(self.jsonl_path)
      self._jsonl = open(self.jsonl_path, "a")
      _OPEN.add(self)

  @property
  def jsonl_path(self) -> pathlib.Path:
    """The absolute path of this writer's ``metrics.jsonl``."""
    return (self.logdir / METRICS_FILE).absolute()

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _check_open(self):
    if self._closed:
      raise ValueError(f"MetricWriter({str(self.logdir)!r}) is closed")

  def _emit(self, step: int, values, wall_time: float) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    summary = summary_pb2.Summary(value=values)
    self._events.add_event(event_pb2.Event(step=step, wall_time=wall_time, summary=summary))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Logs numeric scalars (python numbers, numpy or jax 0-d arrays)."""
    self._check_open()
    step = _check_step(step)
    values = {name: _to_float(name, v) for name, v in scalars.items()}
    if not self.is_main:
      return
    now = time.time()
    if self._events is not None:
      from tensorboard.compat.proto import summary_pb2
      self._emit(step, [summary_pb2.Summary.Value(tag=k, simple_value=v)
                        for k, v in values.items()], now)
    if self._jsonl is not None:
      if self._pending is not None and self._pending["step"] != step:
        self._write_pending()
      if (self._pending is None and self._last is not None and self._last[0]["step"] == step
          and self._last[1] >= self._synced):
        row, start = self._last  # emitted by a flush: reopen that line
        self._jsonl.flush()
        self._jsonl.truncate(start)
        self._jsonl.seek(start)
        self._pending, self._last = dict(row), None
      if self._pending is None:
        self._pending = {"step": step, "wall_time": now}
      self._pending.update(values)

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    """Logs strings (e.g. samples) to the TensorBoard text plugin."""
    self._check_open()
    step = _check_step(step)
    for name, text in texts.items():
      if not isinstance(text, str):
        raise ValueError(f"text {name!r} must be a str, got {type(text).__name__}")
    if not self.is_main or self._events is None:
      return
    from tensorboard.plugins.text import summary_v2 as text_summary
    values = []
    for name, text in texts.items():
      values.extend(text_summary.text_pb(name, text).value)
    self._emit(step, values, time.time())

  def write_histograms(self, step: int, arrays: Mapping[str, Any], bins: int = 30) -> None:
    """Logs the distribution of each array's values."""
    self._check_open()
    step = _check_step(step)
    protos = {name: histogram_proto(a, bins) for name, a in arrays.items()}
    if not self.is_main or self._events is None:
      return
    from tensorboard.compat.proto import summary_pb2
    self._emit(step, [summary_pb2.Summary.Value(tag=k, histo=h) for k, h in protos.items()],
               time.time())

  def _write_pending(self) -> None:
    # NaN/inf are kept (json writes NaN/Infinity, Python's json reads them):
    # a diverging loss is exactly what the log must show.
    start = self._jsonl.tell()
    self._jsonl.write(json.dumps(self._pending) + "\n")
    self._jsonl.flush()  # a killed process loses at most the step in progress
    self._last, self._pending = (self._pending, start), None

  def sync(self) -> int | None:
    """Writes the pending line, flushes and fsyncs; returns the JSONL length in
    bytes (None when this process keeps no JSONL). Every row written so far
    is then durable; ``rewind`` to this length restores this point."""
    if self._closed or not self.is_main or self._jsonl is None:
      return None
    if self._pending is not None:
      self._write_pending()
    self._jsonl.flush()
    os.fsync(self._jsonl.fileno())
    self._synced = self._jsonl.tell()
    return self._synced

  def rewind(self, length: int) -> None:
    """Cuts ``metrics.jsonl`` back to ``length`` bytes (a ``sync`` result),
    dropping the pending row: the rows of steps a resumed run redoes.

    A file shorter than ``length`` (lost or replaced since) is left as it is,
    with a warning.
    """
    self._check_open()
    if not self.is_main or self._jsonl is None:
      return
    self._pending, self._last = None, None
    self._jsonl.flush()
    size = self._jsonl.tell()
    if size < length:
      log.warning("%s holds %d bytes, less than the %d it held at the checkpoint being resumed; "
                  "rows before it are missing from the log", self.jsonl_path, size, length)
      return
    if size > length:
      self._jsonl.truncate(length)
      self._jsonl.seek(length)
      self._synced = min(self._synced, length)
      log.info("%s: cut %d bytes of rows written after the resumed checkpoint",
               self.jsonl_path, size - length)

  def flush(self) -> None:
    """Writes the pending JSONL line and flushes both files."""
    if self._closed or not self.is_main:
      return
    if self._jsonl is not None:
      if self._pending is not None:
        self._write_pending()
      self._jsonl.flush()
    if self._events is not None:
      self._events.flush()

  def close(self) -> None:
    if self._closed:
      return
    self.flush()
    if self._jsonl is not None:
      self._jsonl.close()
      _OPEN.discard(self)
    if self._events is not None:
      self._events.close()
    self._closed = True


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads a ``metrics.jsonl`` (or the run directory holding one) into a list of dicts.

  A last line that is not JSON (torn by a crash in the middle of a write) is
  skipped with a warning naming the file; a bad line before it raises
  ``ValueError`` naming the file and line. Consecutive lines of one step (a
  step's row written again after a checkpoint made it durable) are merged
  into one dict, later values winning, as ``MetricWriter`` merges them in memory.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / METRICS_FILE
  with open(path) as f:
    lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
  rows = []
  for i, (lineno, line) in enumerate(lines):
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        log.warning("%s:%d: skipped a torn last line (%s): %r", path, lineno, e,
                    line[:80])
        break
      raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
    if not isinstance(row, dict):
      raise ValueError(f"{path}:{lineno}: not a JSON object: {line[:80]!r}")
    if rows and "step" in row and rows[-1].get("step") == row["step"]:
      rows[-1].update(row)
    else:
      rows.append(row)
  return rows

