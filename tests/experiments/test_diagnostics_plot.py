"""experiments/diagnostics_plot.py: diagnostics series read back from metrics.jsonl, against numpy.

The runs are written with the real ``MetricWriter`` (as the OPD source
does), with known values: every ``diag/`` point must come back at its step
(later stages shifted past the earlier stage's last step), other scalars
and non-finite points must not, and the endpoints are recomputed here.
"""
import math

import numpy as np
import pytest

from experiments import diagnostics_plot as dp
from opd.training.metrics_writer import MetricWriter

TEACHERS = ("math", "code")


def _write_run(path, steps, diag_every, rng, first_step_eval=True):
  """A run's metrics.jsonl; returns ``{(teacher, metric): [(step, value), ...]}``."""
  want = {}
  with MetricWriter(path, tensorboard=False) as w:
    if first_step_eval:
      w.write_scalars(0, {"eval/rkl/math": 1.0})  # step 0: held-out eval, no diagnostics
    for s in range(1, steps + 1):
      row = {"train/loss": float(rng.normal())}
      if (s - 1) % diag_every == 0:  # the source's batch s-1 carries the diagnostics
        for t in TEACHERS:
          for m in ("overlap@8", "rkl_first", "rkl_middle", "rkl_last"):
            v = float(rng.uniform())
            row[f"diag/{t}/{m}"] = v
            want.setdefault((t, m), []).append((s, v))
      w.write_scalars(s, row)
  return want


def test_series_come_back_at_their_steps_and_stages_are_offset(tmp_path):
  rng = np.random.default_rng(0)
  opd = _write_run(tmp_path / "opd", steps=10, diag_every=3, rng=rng)
  anneal = _write_run(tmp_path / "anneal", steps=4, diag_every=2, rng=rng)
  series = dp.read_diagnostics([tmp_path / "opd", tmp_path / "anneal"])
  assert set(series) == set(TEACHERS)
  for t in TEACHERS:
    assert set(series[t]) == {"overlap@8", "rkl_first", "rkl_middle", "rkl_last"}
    for m, (steps, values) in series[t].items():
      # The annealing stage starts after the OPD stage's last step (10).
      expect = opd[t, m] + [(s + 10, v) for s, v in anneal[t, m]]
      np.testing.assert_array_equal(steps, [s for s, _ in expect])
      np.testing.assert_array_equal(values, [v for _, v in expect])
  single = dp.read_diagnostics(tmp_path / "opd")
  np.testing.assert_array_equal(single["math"]["rkl_last"][0], [1, 4, 7, 10])


def test_nan_buckets_are_dropped_and_endpoints(tmp_path):
  with MetricWriter(tmp_path, tensorboard=False) as w:
    w.write_scalars(1, {"diag/a/rkl_last": 0.5, "diag/a/overlap@8": 0.2})
    w.write_scalars(3, {"diag/a/rkl_last": float("nan"), "diag/a/overlap@8": 0.4})
    w.write_scalars(5, {"diag/a/rkl_last": 0.1, "diag/a/overlap@8": 0.9})
  series = dp.read_diagnostics(tmp_path)
  np.testing.assert_array_equal(series["a"]["rkl_last"][0], [1, 5])
  ends = dp.endpoints(series, tail=2)
  assert ends["a"]["overlap@8"] == {"first": 0.2, "last": pytest.approx((0.4 + 0.9) / 2), "n": 3}
  assert ends["a"]["rkl_last"] == {"first": 0.5, "last": pytest.approx(0.3), "n": 2}
  assert dp.endpoints(series, tail=10)["a"]["overlap@8"]["last"] == pytest.approx(1.5 / 3)
  with pytest.raises(ValueError, match="tail=0"):
    dp.endpoints(series, tail=0)


def test_plot_written_or_none_and_bad_dirs(tmp_path):
  rng = np.random.default_rng(1)
  _write_run(tmp_path / "run", steps=6, diag_every=2, rng=rng)
  out = dp.plot_diagnostics(tmp_path / "run", tmp_path / "d.png", "title")
  assert out == str(tmp_path / "d.png") and (tmp_path / "d.png").stat().st_size > 0
  with MetricWriter(tmp_path / "nodiag", tensorboard=False) as w:
    w.write_scalars(1, {"train/loss": 1.0})
  assert dp.plot_diagnostics(tmp_path / "nodiag", tmp_path / "none.png") is None
  assert not (tmp_path / "none.png").exists()
  with pytest.raises(ValueError, match="holds no metrics.jsonl"):
    dp.read_diagnostics(tmp_path / "missing")
  with pytest.raises(ValueError, match="run_dirs"):
    dp.read_diagnostics([])


def test_relabel_names_runs():
  one = {"t": {"overlap@8": (np.array([1.0]), np.array([0.5]))}}
  two = {"x": one["t"], "y": one["t"]}
  merged = dp.relabel({"same base": one, "both": two})
  assert set(merged) == {"same base", "both: x", "both: y"}
  assert math.isclose(merged["same base"]["overlap@8"][1][0], 0.5)
