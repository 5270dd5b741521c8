"""Tests for experiments/sweep.py: subprocess runs, a crashing run, summary and plot."""
import csv
import json
import os
import pathlib

import matplotlib.image
import pytest

import line_fit_job
from experiments import sweep
from opd.config import overrides as config_utils

HERE = pathlib.Path(__file__).parent
CONFIG = f"{HERE / 'line_fit_config.py'}:steps=30"


def test_sweep_runs_reports_failure_and_summarises(tmp_path, capsys):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
  # Entries: lr 0.05, 0.5, then -1.0 which the job rejects (the 4th is cut by max_runs).
  results = sweep.run_sweep(CONFIG, tmp_path, max_runs=3, jobs_modules=["line_fit_job"],
                            env=env)
  assert [r.status for r in results] == ["ok", "ok", "failed"]
  assert results[2].returncode not in (0, None) and results[2].metrics == {}
  assert "config.optim.lr must be > 0, got -1.0" in (tmp_path / results[2].name / "log.txt").read_text()
  assert "failed" in capsys.readouterr().out

  # Each ok run's final metrics equal the same job run in this process.
  for r, lr in zip(results[:2], (0.05, 0.5)):
    assert r.overrides == {"optim.lr": lr}
    config = config_utils.apply_overrides(config_utils.load_config(CONFIG), r.overrides)
    expected = line_fit_job.run(config, str(tmp_path / f"inproc_{lr}"))
    # The same float64 numpy job on the same machine, its metrics read back
    # through JSON (which round-trips floats): equal bit for bit.
    assert r.metrics == expected
    assert pathlib.Path(r.workdir, "metrics.jsonl").exists()
    saved = json.loads(pathlib.Path(r.workdir, "config.json").read_text())
    assert saved["optim"]["lr"] == lr and saved["train"]["steps"] == 30
  assert results[1].metrics["final_loss"] < results[0].metrics["final_loss"]

  with open(tmp_path / "sweep_summary.csv") as f:
    rows = list(csv.DictReader(f))
  assert [row["run"] for row in rows] == [r.name for r in results]
  assert [row["status"] for row in rows] == ["ok", "ok", "failed"]
  assert [float(row["optim.lr"]) for row in rows] == [0.05, 0.5, -1.0]
  assert float(rows[1]["final_loss"]) == results[1].metrics["final_loss"]  # csv writes repr()
  assert rows[2]["final_loss"] == ""
  md = (tmp_path / "sweep_summary.md").read_text().splitlines()
  assert md[0].startswith("| run | status | seconds | optim.lr | final_loss") and len(md) == 5
  saved = json.loads((tmp_path / "sweep_summary.json").read_text())
  assert [s["status"] for s in saved] == ["ok", "ok", "failed"]
  image = matplotlib.image.imread(tmp_path / "sweep_summary.png")
  assert image.ndim == 3 and image.shape[0] > 100

  # Finished runs are not run again; the failed one is (and fails again).
  again = sweep.run_sweep(CONFIG, tmp_path, max_runs=2, jobs_modules=["line_fit_job"], env=env)
  assert [r.status for r in again] == ["cached", "cached"]
  assert [r.metrics for r in again] == [r.metrics for r in results[:2]]


def test_run_names_are_unique_and_safe():
  names = [sweep.run_name(i, o) for i, o in enumerate(
      [{"optim.lr": 1e-3}, {"optim.lr": 1e-3}, {"data.name": "a b/c"}, {}])]
  assert names == ["000_lr=0.001", "001_lr=0.001", "002_name=a-b-c", "003_base"]


def test_sweep_entries_are_checked_before_running(tmp_path):
  path = tmp_path / "cfg.py"
  path.write_text(
      "import ml_collections\n"
      "def get_config():\n"
      "  return ml_collections.ConfigDict(dict(job='line_fit', optim=dict(lr=0.1), n=(1, 2)))\n"
      "def get_sweep():\n"
      "  return [{'optim.lr': 0.2}, {'optim.lrr': 0.3}]\n")
  with pytest.raises(ValueError, match=r"sweep entry 1 \{'optim.lrr': 0.3\}: unknown config "
                                       r"field 'optim.lrr'"):
    sweep.run_sweep(str(path), tmp_path / "out")
  assert not (tmp_path / "out").exists()
  path.write_text(path.read_text().replace("{'optim.lrr': 0.3}", "{'n': [3, 4]}"))
  with pytest.raises(ValueError, match=r"sweep override 'n'=\[3, 4\] \(list\) cannot be passed"):
    sweep.run_sweep(str(path), tmp_path / "out")


def test_summary_without_a_numeric_axis(tmp_path):
  # Two keys vary at once: the plot falls back to one bar per run.
  results = [sweep.RunResult(f"{i:03d}", {"a": i, "b": str(i)}, "ok", 0, 1.0,
                             {"loss": 1.0 / (i + 1), "tag": "x"}, str(tmp_path))
             for i in range(3)]
  paths = sweep.write_summary(results, tmp_path)
  assert matplotlib.image.imread(paths["png"]).ndim == 3
  with pytest.raises(ValueError, match=r"metrics \['acc'\] are not final metrics of any run"):
    sweep.write_summary(results, tmp_path, metrics=["acc"])


def test_a_locked_sweep_directory_and_a_torn_cached_run_are_refused(tmp_path):
  """A second sweep on a directory another one holds is refused before any
  run starts; a cached run whose final metrics were torn names the file."""
  from opd.training.files import ResultFileError
  from opd.training.workdir import WorkdirBusyError, WorkdirLock
  with WorkdirLock(tmp_path):  # as a sweep in progress holds it
    with pytest.raises(WorkdirBusyError, match=rf"workdir '{tmp_path}' is in use by pid "
                                               rf"{os.getpid()}"):
      sweep.run_sweep(CONFIG, tmp_path, max_runs=1, jobs_modules=["line_fit_job"])
  assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # no run directory, no summary
  final = tmp_path / sweep.run_name(0, {"optim.lr": 0.05}) / "final_metrics.json"
  final.parent.mkdir()
  final.write_text('{"final_loss": 0.0')  # a non-atomic write cut by a crash
  with pytest.raises(ResultFileError, match=rf"result file '{final}' is not valid JSON"):
    sweep.run_sweep(CONFIG, tmp_path, max_runs=1, jobs_modules=["line_fit_job"])
