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

In a multi-host run every process may call the writer; only the process with
``jax.process_index() == 0`` writes, the others do nothing.
"""
from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"


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
    self._closed = False
    if not self.is_main:
      return
    self.logdir.mkdir(parents=True, exist_ok=True)
    if tensorboard:
      from tensorboard.summary.writer.event_file_writer import EventFileWriter
      self._events = EventFileWriter(str(self.logdir))
    if jsonl:
      self._jsonl = open(self.logdir / METRICS_FILE, "a")

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
    self._jsonl.write(json.dumps(self._pending) + "\n")
    self._pending = None

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
    if self._events is not None:
      self._events.close()
    self._closed = True


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads a ``metrics.jsonl`` (or the run directory holding one) into a list of dicts."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / METRICS_FILE
  rows = []
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
  return rows

