"""The V4 pipeline job (experiments/v4.py) end to end at the ``tiny`` size, through the CLI.

Tiny models score ~0 everywhere, so this checks the plumbing: every stage
ran and left a checkpoint, every row was evaluated on every domain, and the
summary's cells are the evaluation results (recomputed here from
``results.json``), the average's standard error is the quadrature mean of
the domains', and retention is the ratio it claims to be. A second run in a new workdir
(the width lever, reusing the first) reruns only the stages it changes.
"""
import json
import math
import pathlib
import subprocess
import sys

import numpy as np

from experiments import diagnostics_plot, v4, v4_report
from opd.eval.report import load_results
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_v4_tiny_runs_every_stage_and_reports_every_row(tmp_path):
  workdir = tmp_path / "v4"
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", "--config=experiments/configs/v4.py:tiny",
         f"--workdir={workdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  final = json.loads((workdir / "final_metrics.json").read_text())
  domains = ("math", "instruct")
  for stage in ("cold_start", "opd", "anneal"):
    assert (workdir / "student" / "seed0" / stage / "checkpoints").is_dir()
  for job in ("merge", "task_arithmetic", "mixed_rl"):
    assert (workdir / "baselines" / job / "checkpoints").is_dir()

  summary = json.loads((workdir / "v4" / "summary.json").read_text())
  results = {r.name: r for r in load_results(str(workdir / "v4" / "results.json"))}
  expected_rows = (["base"] + [f"{d}-specialist" for d in sorted(domains)]
                   + list(v4_report.STUDENT_ROWS.values())
                   + [v4_report.BASELINE_ROWS[j] for j in ("merge", "task_arithmetic",
                                                            "mixed_rl")])
  for metric in ("reward@1", "mean@2"):
    table = summary["table"][metric]
    assert list(table) == expected_rows
    for row, cells in table.items():
      result = results[row + "#0"] if row.startswith("student") else results[row]
      scores = [result.score(d, metric) for d in domains]
      for d, s in zip(domains, scores):
        assert cells[d] == [s.value, s.se]
      assert np.isclose(cells["average"][0], np.mean([s.value for s in scores]))
      assert np.isclose(cells["average"][1], math.sqrt(sum(s.se ** 2 for s in scores)) / 2)
  main = summary["table"]["reward@1"]
  for d in domains:
    spec = main[f"{d}-specialist"][d][0]
    want = 100 * main[v4_report.FINAL][d][0] / spec if spec > 0 else None
    got = final[f"retention/{d}"]
    assert (math.isnan(got) if want is None else np.isclose(got, want))
  report = (workdir / "v4" / "report.md").read_text()
  assert "retention" in report and all(row in report for row in expected_rows)
  assert (workdir / "v4" / "heatmap.png").stat().st_size > 0
  # Diagnostics plot: OPD then annealing (2 steps each, diag_every=2, so the
  # first batch of each stage: steps 1 and 2 + 1). Annealing's first batch
  # already weights every teacher (α = 1/2), so each has its step-3 point.
  assert final["diagnostics"] == str(workdir / "v4" / "diagnostics.png")
  assert (workdir / "v4" / "diagnostics.png").stat().st_size > 0
  series = diagnostics_plot.read_diagnostics(
      [workdir / "student" / "seed0" / s for s in ("opd", "anneal")])
  assert set(series) == set(domains)
  for t in domains:
    steps = series[t]["overlap@8"][0]
    assert set(steps) <= {1.0, 3.0} and steps[-1] == 3.0, (t, steps)

  # Model width (--config.student_width): a wider student from its own base
  # (the specialists' base recipe at that width), cold start and OPD to the
  # narrower specialists, mixed RL on the same wide network; merging, the
  # specialists and their base are still read from the first run.
  # (A lever that changes only OPD reruns only OPD and annealing: their stage
  # configs are the only ones it changes, test_v4_student_model.py.) The first
  # run is read, never written.
  before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()}
  wide = tmp_path / "wide"
  proc = subprocess.run(cmd[:-1] + [f"--workdir={wide}", f"--config.reuse_from={workdir}",
                                    "--config.student_width=48"],
                        capture_output=True, text=True, env=env, timeout=1200, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()} == before
  assert not any((wide / d).exists() for d in ("base", *domains))
  assert not (wide / "baselines" / "merge").exists()
  narrow = json.loads((workdir / "student" / "seed0" / "opd" / "config.json").read_text())
  d_spec = narrow["student"]["model"]["d_model"]
  for stage_dir in [wide / "student_base", wide / "baselines" / "mixed_rl"] + [
      wide / "student" / "seed0" / s for s in v4.STUDENT_STAGES]:
    saved = json.loads((stage_dir / "config.json").read_text())
    model = saved.get("model") or saved["student"]["model"]
    assert model["d_model"] == 48 != d_spec, stage_dir
    assert model["d_ff"] == narrow["student"]["model"]["d_ff"] * 48 // d_spec
  cold = json.loads((wide / "student" / "seed0" / "cold_start" / "config.json").read_text())
  assert cold["student"]["init"] == str(wide / "student_base" / "checkpoints")
  assert all(t["model"]["d_model"] == d_spec for t in cold["teachers"].values())
  # (the evaluations load each checkpoint with the model of its row, so a
  # student saved at the specialists' width would have failed the run)
  changed = {v4_report.STUDENT_ROWS[s] + "#0" for s in v4.STUDENT_STAGES} | {
      v4_report.BASELINE_ROWS["mixed_rl"]}
  evals = {p.name for p in (wide / "eval").iterdir()}
  assert evals == {v4._slug(name) for name in changed}
  again = {r.name: r for r in load_results(str(wide / "v4" / "results.json"))}
  assert set(again) == set(results)
  for name, r in results.items():  # every other row is the first run's result
    if name not in changed:
      assert again[name].to_dict() == r.to_dict(), name


def test_v4_tiny_strong_world_runs_with_bpe_shared_sft_and_the_positive_control(tmp_path):
  """``v4.py:tiny,strong``: every stage holds the same BPE tokenizer (byte-identical
  copies), the specialists start from the shared SFT, and the positive control's
  curve is the evaluation its stage saved, step 0 being the cold start."""
  workdir = tmp_path / "v4s"
  cmd = [sys.executable, "-m", "experiments.launch",
         "--config=experiments/configs/v4.py:tiny,strong", f"--workdir={workdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=one_device_env(),
                        timeout=1200, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  files = sorted(workdir.glob("**/tokenizer/bpe_1024/tokenizer.json"))
  assert len(files) >= 10 and len({f.read_bytes() for f in files}) == 1
  assert not list(workdir.glob("**/tokenizer/byte*"))
  assert (workdir / "shared_sft" / "final_metrics.json").exists()
  for d in ("math", "instruct"):
    sft = json.loads((workdir / d / "sft" / "config.json").read_text())
    assert sft["init"] == str(workdir / "shared_sft" / "checkpoints")
    assert sft["model"]["tokenizer"] == "bpe:1024" and sft["model"]["vocab_size"] == 1024
  control = json.loads((workdir / "v4" / "positive_control.json").read_text())
  assert sorted(control) == ["instruct", "math"]
  for d, s in control.items():
    assert s["steps"] == [0, 1, 2]
    results = load_results(str(workdir / "positive_control" / d / "eval" / "results.json"))
    assert [r.name for r in results] == ["teacher", "cold_start", "step1", "step2"]
    assert s["student_greedy"] == [r.score(d, "reward@1").value for r in results[1:]]
    assert s["teacher_sampled"] == results[0].score(d, "mean@2").value
  assert "## Positive control" in (workdir / "v4" / "report.md").read_text()
  # An arm of the control alone (positive_control.only) in its own workdir:
  # the cold start is read from the first run, the control reruns under the
  # arm's estimator, and nothing after it runs.
  arm = tmp_path / "arm"
  proc = subprocess.run(cmd[:-1] + [f"--workdir={arm}", f"--config.reuse_from={workdir}",
                                    "--config.positive_control.only=True",
                                    "--config.positive_control.domains=math",
                                    "--config.opd.loss.estimator=token"],
                        capture_output=True, text=True, env=one_device_env(), timeout=1200,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads((arm / "positive_control" / "math" / "opd" / "config.json").read_text())[
      "opd"]["loss"]["estimator"] == "token"
  assert not (arm / "student" / "seed0" / "cold_start").exists()  # reused from the first run
  assert not (arm / "student" / "seed0" / "opd").exists() and not (arm / "baselines").exists()
  assert sorted(json.loads((arm / "v4" / "positive_control.json").read_text())) == ["math"]
