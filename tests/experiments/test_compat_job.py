"""The teacher-compatibility job (experiments/compat.py): its numbers, and its tiny run through the CLI.

``summarize`` is checked on hand-built inputs (the expected numbers worked
out in the comments). The tiny run checks the plumbing: every stage left a
checkpoint, the arms differ only where they should (base seed; teacher
checkpoint), and the report's numbers are the evaluation's and the OPD
runs' logged diagnostics, recomputed here from results.json and
metrics.jsonl.
"""
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import compat
from opd.config.overrides import config_mismatches
from opd.eval.report import load_results
from opd.training.metrics_writer import read_metrics
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
METRICS = ("reward@1", "mean@4")


def _series(first, last_three, **extra):
  """One teacher's diagnostics at steps 1, 5, 9, 13: ``first`` then ``last_three``."""
  steps = np.array([1.0, 5.0, 9.0, 13.0])
  out = {}
  for key in ("overlap@8", "overlap@1", "rkl", "rkl_first", "rkl_middle", "rkl_last"):
    v = extra.get(key, (first, *last_three))
    out[key] = (steps, np.asarray(v, np.float64))
  return {"t": out}


def test_summarize_gains_gaps_and_positions():
  scores = {"teacher_A": {"reward@1": (50.0, 3.0), "mean@4": (40.0, 2.0)},
            "teacher_B": {"reward@1": (46.0, 4.0), "mean@4": (41.0, 2.0)},
            "student": {"reward@1": (10.0, 1.0), "mean@4": (8.0, 1.0)},
            "opd_A": {"reward@1": (22.0, 2.0), "mean@4": (15.0, 2.0)},
            "opd_B": {"reward@1": (12.0, 2.0), "mean@4": (9.0, 2.0)}}
  series = {"A": _series(0.8, (0.5, 0.4, 0.3), rkl_last=(0.2, 0.4, 0.1, 0.1)),
            "B": _series(0.6, (0.9, 0.6, 0.3))}
  heldout = {"A": {"initial": 0.5, "final": 0.2}, "B": {"initial": 0.9, "final": 0.7}}
  s = compat.summarize(scores, series, heldout, METRICS)
  # Gap A − B: 50 − 46 = 4, se sqrt(3² + 4²) = 5.
  assert s["teacher_gap"]["reward@1"] == pytest.approx((4.0, 5.0))
  # Gain A: 22 − 10 = 12 ± sqrt(2² + 1²); gain B on mean@4: 9 − 8 = 1 ± sqrt(5).
  assert s["arms"]["A"]["gain"]["reward@1"] == pytest.approx((12.0, math.sqrt(5.0)))
  assert s["arms"]["B"]["gain"]["mean@4"] == pytest.approx((1.0, math.sqrt(5.0)))
  # Initial overlap: the first point (step 1); final: mean of the last 3 = 0.4.
  assert s["arms"]["A"]["overlap@8_initial"] == 0.8
  assert s["arms"]["A"]["overlap@8_final"] == pytest.approx(0.4)
  # rkl_last of A: 0.2 → mean(0.4, 0.1, 0.1) = 0.2, change 0%; first: 0.8 → 0.4, −50%.
  pos = s["arms"]["A"]["rkl_by_position"]
  assert pos["last"] == pytest.approx({"initial": 0.2, "final": 0.2, "change_pct": 0.0})
  assert pos["first"] == pytest.approx({"initial": 0.8, "final": 0.4, "change_pct": -50.0})
  # B: 0.6 → mean(0.9, 0.6, 0.3) = 0.6: 0%.
  assert s["arms"]["B"]["rkl_by_position"]["middle"]["change_pct"] == pytest.approx(0.0)
  assert s["arms"]["B"]["heldout_rkl"] == heldout["B"]
  text = compat.render(s, "math")
  assert "| A: same base | 50.0 ± 3.0 |" in text and "12.0 ± 2.2" in text
  with pytest.raises(ValueError, match="expected one"):
    compat.summarize(scores, {"A": {**series["A"], "u": series["A"]["t"]}, "B": series["B"]},
                     heldout, METRICS)


def _result(name, ids, greedy, sampled):
  from opd.eval.results import DomainResult, EvalConfig, EvalResult
  d = DomainResult("math", {}, list(ids), list(greedy), None, [list(r) for r in sampled], None,
                   {}, [])
  return EvalResult(name, EvalConfig(domains=("math",)), {"math": d}, {})


def test_paired_diff_is_the_mean_difference_with_the_bootstrap_se_of_differences():
  rng = np.random.default_rng(3)
  n = 40
  hard = rng.uniform(0.0, 1.0, n)  # shared difficulty: the paired SE removes it
  ga = (rng.uniform(size=n) < hard).astype(float)
  gb = (rng.uniform(size=n) < hard * 0.8).astype(float)
  sa, sb = rng.uniform(size=(n, 4)) * hard[:, None], rng.uniform(size=(n, 4)) * hard[:, None]
  ids = [f"e{i}" for i in range(n)]
  a, b = _result("a", ids, ga, sa), _result("b", ids, gb, sb)
  B = 500
  for metric, d in (("reward@1", 100 * (ga - gb)), ("mean@4", 100 * (sa - sb).mean(axis=1))):
    value, se = compat.paired_diff(a, b, "math", metric, B, 7)
    assert value == pytest.approx(d.mean(), rel=1e-12, abs=1e-9)
    # Reference: resample examples with the same stream (rng.integers(0, n, (B, n))).
    idx = np.random.default_rng(7).integers(0, n, size=(B, n))
    assert se == pytest.approx(d[idx].mean(axis=1).std(ddof=1), rel=1e-9)
  with pytest.raises(ValueError, match="different math examples"):
    compat.paired_diff(a, _result("c", ids[::-1], gb, sb), "math", "reward@1", B, 7)
  with pytest.raises(ValueError, match="metric='pass@1'"):
    compat.paired_diff(a, b, "math", "pass@1", B, 7)


def test_config_checks():
  from experiments.configs import compat as compat_config
  with pytest.raises(ValueError, match="domain='poetry'"):
    compat_config.get_config("domain=poetry")
  c = compat_config.get_config()
  # The teachers follow the specialists' math settings (160 SFT steps, GRPO lr 5e-5).
  assert c.sft.train.steps == 160 and c.grpo_optim.lr == 5e-5
  # opd_steps=N: only the OPD stages change (steps, checkpoint, eval spacing, cosine length).
  long = compat_config.get_config("opd_steps=120")
  assert (long.opd_train.steps, long.opd_train.save_every, long.opd_train.eval_every) == (
      120, 120, 30)
  assert long.opd_optim.decay_steps == 120 - long.opd_optim.warmup_steps
  assert long.sft == c.sft and long.student_sft == c.student_sft and long.opd == c.opd
  with pytest.raises(ValueError, match="opd_steps=-1"):
    compat_config.get_config("opd_steps=-1")
  c.base_seeds = (3, 3)
  with pytest.raises(ValueError, match="base_seeds"):
    compat.run_teachers(c, pathlib.Path("/nonexistent"))
  with pytest.raises(ValueError, match="arm='C'"):
    compat.opd_config(c, pathlib.Path("/x"), "C")


def test_compat_tiny_through_the_cli(tmp_path):
  workdir = tmp_path / "compat"
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch",
         "--config=experiments/configs/compat.py:tiny", f"--workdir={workdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  final = json.loads((workdir / "final_metrics.json").read_text())
  for stage in ("base_a", "base_b", "teacher_a/sft", "teacher_a/grpo", "teacher_b/sft",
                "teacher_b/grpo", "student", "opd_a", "opd_b"):
    assert (workdir / stage / "checkpoints").is_dir(), stage

  cfg = lambda d: json.loads((workdir / d / "config.json").read_text())
  # The bases differ by seed only; the teachers' SFT only by the base they start from.
  assert [k for k, _, _ in config_mismatches(cfg("base_a"), cfg("base_b"))] == ["seed"]
  assert [k for k, _, _ in config_mismatches(cfg("teacher_a/sft"), cfg("teacher_b/sft"))] == [
      "init"]
  assert cfg("student")["init"] == str(workdir / "base_a" / "checkpoints")
  # The OPD arms: the same student and settings; only the teacher (its name and checkpoint).
  a, b = cfg("opd_a"), cfg("opd_b")
  assert a["student"] == b["student"] and a["opd"] == b["opd"] and a["optim"] == b["optim"]
  assert a["teachers"]["same_base"]["init"] == str(workdir / "teacher_a" / "grpo" / "checkpoints")
  assert b["teachers"]["other_base"]["init"] == str(workdir / "teacher_b" / "grpo" /
                                                    "checkpoints")

  summary = json.loads((workdir / "compat" / "summary.json").read_text())
  results = {r.name: r for r in load_results(str(workdir / "compat" / "results.json"))}
  assert set(results) == set(compat.ROWS.values())
  score = lambda key, m: results[compat.ROWS[key]].score("math", m)
  metrics = ("reward@1", "mean@2")
  for m in metrics:
    ta, tb = score("teacher_A", m), score("teacher_B", m)
    assert summary["teacher_gap"][m] == pytest.approx([ta.value - tb.value,
                                                       math.hypot(ta.se, tb.se)])
    # After OPD, A − B paired over the same test examples.
    pa, pb = results[compat.ROWS["opd_A"]], results[compat.ROWS["opd_B"]]
    assert summary["after_gap"][m][0] == pytest.approx(
        pa.score("math", m).value - pb.score("math", m).value, abs=1e-6)
  for arm, teacher in compat.TEACHER.items():
    run = workdir / f"opd_{arm.lower()}"
    rows = read_metrics(run)
    diag = {r["step"]: r for r in rows if f"diag/{teacher}/overlap@8" in r}
    # diag_every=1 over 2 steps: points at 1 and 2; the step-1 point is the untrained student's.
    assert sorted(diag) == [1, 2]
    got = summary["arms"][arm]
    assert got["overlap@8_initial"] == diag[1][f"diag/{teacher}/overlap@8"]
    assert got["overlap@1_initial"] == diag[1][f"diag/{teacher}/overlap@1"]
    assert final[f"{arm}/overlap@8_initial"] == diag[1][f"diag/{teacher}/overlap@8"]
    for bucket in compat.BUCKETS:
      values = [diag[s][f"diag/{teacher}/rkl_{bucket}"] for s in (1, 2)]
      pos = got["rkl_by_position"][bucket]
      assert pos["initial"] == values[0]
      assert pos["final"] == pytest.approx(np.mean(values))  # the last ≤ 3 points
    opd_final = json.loads((run / "final_metrics.json").read_text())
    assert got["heldout_rkl"] == {"initial": opd_final[f"rkl_initial/{teacher}"],
                                  "final": opd_final[f"rkl_final/{teacher}"]}
    before, after = score("student", "reward@1"), score(f"opd_{arm}", "reward@1")
    assert got["gain"]["reward@1"] == pytest.approx([after.value - before.value,
                                                     math.hypot(after.se, before.se)])
  report = (workdir / "compat" / "report.md").read_text()
  assert "| A: same base |" in report and "| B: other base |" in report
  assert (workdir / "compat" / "compat.png").stat().st_size > 0
