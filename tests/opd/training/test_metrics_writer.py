"""Tests for opd/metrics_writer.py: read the event file and the JSONL back."""
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from opd.training.metrics_writer import METRICS_FILE, MetricWriter, read_metrics


def _accumulator(logdir):
  acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0,
                                                     "histograms": 0})
  acc.Reload()
  return acc


def test_scalars_text_histograms_round_trip(tmp_path):
  rng = np.random.default_rng(0)
  losses = rng.uniform(0, 5, size=4)
  weights = rng.normal(size=(8, 16)).astype(np.float32)
  with MetricWriter(tmp_path, is_main=True) as w:
    for step, loss in enumerate(losses):
      # jax, numpy and python scalars are all accepted.
      w.write_scalars(step, {"loss": jnp.asarray(loss), "lr": np.float32(0.1 * step)})
      w.write_scalars(step, {"acc": step / 4})  # same step: merged into one JSONL line
    w.write_texts(2, {"sample": "2 + 2 = 4 <|eos|>"})
    w.write_histograms(3, {"weights": weights}, bins=10)
    w.write_scalars(4, {"loss": float("nan")})

  acc = _accumulator(tmp_path)
  loss_events = acc.Scalars("loss")
  assert [e.step for e in loss_events] == [0, 1, 2, 3, 4]
  # simple_value is float32 on disk; jnp.asarray(loss) already rounded the
  # float64 loss to float32 once (x64 off), so the values come back exactly.
  assert [e.value for e in loss_events[:4]] == losses.astype(np.float32).tolist()
  assert math.isnan(loss_events[4].value)
  assert [e.value for e in acc.Scalars("acc")] == [0, 0.25, 0.5, 0.75]  # exact in binary

  (text,) = acc.Tensors("sample")
  assert text.step == 2
  assert text.tensor_proto.string_val[0].decode() == "2 + 2 = 4 <|eos|>"

  (hist,) = acc.Histograms("weights")
  h = hist.histogram_value
  counts, edges = np.histogram(weights.astype(np.float64), bins=10)
  assert hist.step == 3 and h.num == weights.size
  np.testing.assert_allclose(h.bucket, counts)
  np.testing.assert_allclose(h.bucket_limit, edges[1:])
  assert (h.min, h.max) == (weights.min(), weights.max())
  # Independent reference: math.fsum is correctly rounded. The writer sums
  # the n float32 values (and their squares, exact in float64: 24+24 bits) in
  # float64, in numpy's order: its error is at most n eps64 sum|terms|.
  tol = weights.size * np.finfo(np.float64).eps
  w64 = weights.astype(np.float64).ravel()
  assert abs(h.sum - math.fsum(w64)) <= tol * np.abs(w64).sum()
  assert abs(h.sum_squares - math.fsum(w64 ** 2)) <= tol * np.square(w64).sum()

  lines = (tmp_path / METRICS_FILE).read_text().splitlines()
  rows = [json.loads(line) for line in lines]
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # one object per step
  for step, (row, loss) in enumerate(zip(rows, losses)):
    # Scalars are float32 before they are written: exact after that rounding.
    assert row["loss"] == float(np.float32(loss)) and row["acc"] == step / 4
    assert row["lr"] == float(np.float32(0.1 * step))
  assert math.isnan(rows[4]["loss"])
  back = read_metrics(tmp_path)
  assert back[:4] == rows[:4] and math.isnan(back[4]["loss"])


def test_non_main_process_writes_nothing(tmp_path):
  logdir = tmp_path / "run"
  with MetricWriter(logdir, is_main=False) as w:
    w.write_scalars(0, {"loss": 1.0})
    w.write_texts(0, {"s": "x"})
    w.write_histograms(0, {"h": np.ones(3)})
  assert not logdir.exists()


def test_default_is_main_on_single_process(tmp_path):
  with MetricWriter(tmp_path) as w:
    w.write_scalars(0, {"loss": 1.0})
  assert read_metrics(tmp_path)[0]["loss"] == 1.0


@pytest.mark.parametrize("call,pattern", [
    (lambda w: w.write_scalars(0, {"loss": np.ones(2)}), r"'loss' must have one element, got shape \(2,\)"),
    (lambda w: w.write_scalars(0, {"loss": "high"}), r"'loss' must be numeric"),
    (lambda w: w.write_scalars(-1, {"loss": 1.0}), r"step must be a non-negative int, got -1"),
    (lambda w: w.write_scalars(1.5, {"loss": 1.0}), r"step must be a non-negative int, got 1.5"),
    (lambda w: w.write_texts(0, {"s": 3}), r"text 's' must be a str, got int"),
    (lambda w: w.write_histograms(0, {"h": [1.0, np.inf]}), r"must be finite"),
])
def test_bad_input_raises(tmp_path, call, pattern):
  # The checks run on every process, so a bug shows up on the main one too.
  for is_main in (True, False):
    with MetricWriter(tmp_path, is_main=is_main) as w:
      with pytest.raises(ValueError, match=pattern):
        call(w)


def test_closed_writer_raises(tmp_path):
  w = MetricWriter(tmp_path, is_main=True)
  w.close()
  with pytest.raises(ValueError, match="is closed"):
    w.write_scalars(0, {"loss": 1.0})


def test_torn_last_line_is_skipped_by_the_reader_and_cut_by_the_writer(tmp_path, caplog):
  """A crash in the middle of a write leaves half a line: reading warns and
  skips it (a closing plot never fails on it), reopening the log cuts it so
  that the next row starts on a line of its own."""
  with MetricWriter(tmp_path, is_main=True, tensorboard=False) as w:
    for step in (1, 2):
      w.write_scalars(step, {"loss": 1.0 / step})
  path = tmp_path / METRICS_FILE
  whole = path.read_text()
  torn = json.dumps({"step": 3, "wall_time": 0.0, "loss": 0.25})[:17]
  path.write_text(whole + torn)
  with caplog.at_level("WARNING"):
    rows = read_metrics(tmp_path)
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 0.5)]
  assert f"{path}:3: skipped a torn last line" in caplog.text
  with caplog.at_level("WARNING"):
    with MetricWriter(tmp_path, is_main=True, tensorboard=False) as w:
      w.write_scalars(3, {"loss": 0.25})
  assert f"{path}: cut a torn last line ({len(torn)} bytes" in caplog.text
  assert path.read_text().startswith(whole)
  assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0), (2, 0.5), (3, 0.25)]
  # A bad line that is not the last is not a torn write: it still raises.
  path.write_text(whole.replace('"step": 2', '"step" 2'))
  path.write_text(path.read_text() + json.dumps({"step": 3}) + "\n")
  with pytest.raises(ValueError, match=f"{path}:2: not a JSON object"):
    read_metrics(path)


def test_sync_makes_rows_durable_and_rewind_cuts_back_to_it(tmp_path):
  with MetricWriter(tmp_path, is_main=True, tensorboard=False) as w:
    w.write_scalars(1, {"loss": 1.0})
    w.write_scalars(2, {"loss": 2.0})
    length = w.sync()
    path = tmp_path / METRICS_FILE
    synced = path.read_text()
    assert len(synced.encode()) == length
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # the pending step 2 is written
    w.write_scalars(3, {"loss": 3.0})
    w.write_scalars(4, {"loss": 4.0})  # emits step 3's row, flushed at once
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    w.rewind(length)  # a resume from the checkpoint taken at the sync
    assert path.read_text() == synced
    w.write_scalars(3, {"loss": 30.0})
    # A value for a step already synced goes to a new line; the reader merges it.
    w.write_scalars(3, {"eval/loss": 31.0})
  rows = read_metrics(path)
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
  assert rows[2]["eval/loss"] == 31.0
  assert len(path.read_text().splitlines()) == 3  # step 3's values merged before any sync


def test_values_written_after_a_sync_for_the_synced_step_are_merged_by_the_reader(tmp_path):
  with MetricWriter(tmp_path, is_main=True, tensorboard=False) as w:
    w.write_scalars(5, {"loss": 1.0})
    w.sync()  # a checkpoint of step 5
    w.write_scalars(5, {"eval/final": 2.0})  # the job's post-run evaluation at the last step
  assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 2
  (row,) = read_metrics(tmp_path)
  assert (row["step"], row["loss"], row["eval/final"]) == (5, 1.0, 2.0)
