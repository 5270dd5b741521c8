"""experiments/ablation_report.py on synthetic sweeps with known curves, and the
ablation sweeps of experiments/configs/distill.py.

Expected values are recomputed here with plain numpy loops from the
definitions in docs/DESIGN.md §3 ("Baselines and curve metrics"), not read
back from opd.eval.curves. Every quantity is a float64 mean of at most ~30
terms of size O(1), so rounding is ~30·eps64 ≈ 1e-14 relative: 1e-9 leaves
a wide margin and still catches any wrong window, span or ddof.
"""
import json
import pathlib

import numpy as np
import pytest

from experiments import ablation_report as ar
from opd.config import overrides as config_utils

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs" / "distill.py"
N = 30  # steps per synthetic run
SEEDS = (0, 1, 2)
RTOL = 1e-9


def _curves(arm: int, seed: int) -> dict[str, np.ndarray]:
  """Per-step curves of one synthetic run: a trend plus an alternating wiggle
  whose size depends on the arm and seed, and a reward ramp."""
  t = np.arange(1, N + 1, dtype=np.float64)
  wiggle = (-1.0) ** t
  return {"train/loss": 3.0 - 0.02 * t + (0.05 + 0.1 * arm + 0.01 * seed) * wiggle,
          "train/grad_norm": 1.0 + 0.1 * (arm + 1) * wiggle + 0.003 * seed * t,
          "reward/mean": np.minimum(0.8 - 0.05 * arm - 0.03 * seed,
                                    (0.05 + 0.01 * seed) * (1 - 0.4 * arm) * t),
          "perf/step_time_s": np.where(t == 1, 40.0, 0.5 + 0.25 * arm + 0.01 * seed * t)}


def _write_sweep(root: pathlib.Path, arms=("full", "token"), failed=("full", 3)):
  entries = []
  for a, label in enumerate(arms):
    for s in SEEDS:
      name = f"{len(entries):03d}_{label}_seed={s}"
      run = root / name
      run.mkdir(parents=True)
      c = _curves(a, s)
      rows = [{"step": 0, "eval/rkl/math": 1.0}]
      rows += [{"step": i + 1, **{k: float(v[i]) for k, v in c.items()}} for i in range(N)]
      (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
      (run / "final_metrics.json").write_text(json.dumps(
          {"rkl_final/math": 0.1 * (a + 1) + 0.01 * s, "rkl_final/code": 0.5 - 0.01 * s,
           "steps": N}))
      entries.append({"name": name, "overrides": {"run_label": label, "seed": s},
                      "status": "ok", "metrics": {}, "workdir": "/elsewhere/" + name})
  # A run that crashed: listed, left out, its directory never read.
  entries.append({"name": f"{len(entries):03d}_crashed", "status": "failed",
                  "overrides": {"run_label": failed[0], "seed": failed[1]}, "metrics": {}})
  (root / "sweep_summary.json").write_text(json.dumps(entries))
  return entries


def _fluctuation(x, w=9):
  n, h = len(x), w // 2
  rel = [(x[t] - np.mean(x[t - h:t + h + 1])) / abs(np.mean(x[t - h:t + h + 1]))
         for t in range(max(n // 2, h), n - h)]
  return 100 * np.sqrt(np.mean(np.square(rel)))


def _steps_to(x, target, w=5):
  for t in range(len(x)):
    if np.mean(x[max(0, t + 1 - w):t + 1]) >= target:
      return t + 1
  return None


def _expected_run(arm, seed):
  c, ref = _curves(arm, seed), _curves(0, seed)
  g = c["train/grad_norm"][N // 2:]
  final, ref_final = np.mean(c["reward/mean"][-5:]), np.mean(ref["reward/mean"][-5:])
  return {"loss_fluctuation_pct": _fluctuation(c["train/loss"]),
          "grad_norm_cv": np.std(g) / abs(np.mean(g)), "final_reward": final,
          "final_reward_pct_of_reference": 100 * final / ref_final,
          ar.STEPS_KEY: _steps_to(c["reward/mean"], 0.9 * ref_final),
          "step_time_s": np.mean(c["perf/step_time_s"][1:]),
          "rkl_final/math": 0.1 * (arm + 1) + 0.01 * seed}


def test_report_of_a_synthetic_sweep(tmp_path):
  _write_sweep(tmp_path)
  out = ar.report(tmp_path, tmp_path / "out")
  assert out["failed"] == ["006_crashed"]
  assert [(r["arm"], r["seed"]) for r in out["runs"]] == [(a, s) for a in ("full", "token")
                                                          for s in SEEDS]
  for row in out["runs"]:
    want = _expected_run(("full", "token").index(row["arm"]), row["seed"])
    for key, value in want.items():
      assert row[key] == pytest.approx(value, rel=RTOL), (row["run"], key)
  # The token arm's reward ramp is 0.6 times as steep: it needs more steps.
  assert all(r[ar.STEPS_KEY] > _expected_run(0, r["seed"])[ar.STEPS_KEY]
             for r in out["runs"] if r["arm"] == "token")
  for arm_index, arm in enumerate(("full", "token")):
    stats = out["summary"][arm]
    for key in ("loss_fluctuation_pct", "grad_norm_cv", "final_reward", ar.STEPS_KEY,
                "rkl_final/code"):
      values = [(_expected_run(arm_index, s)[key] if key != "rkl_final/code" else 0.5 - 0.01 * s)
                for s in SEEDS]
      assert stats[key]["mean"] == pytest.approx(np.mean(values), rel=RTOL), (arm, key)
      assert stats[key]["std"] == pytest.approx(np.std(values, ddof=1), rel=RTOL), (arm, key)
      assert stats[key]["n"] == stats[key]["of"] == 3
  ratio = (np.mean([_expected_run(1, s)[ar.STEPS_KEY] for s in SEEDS])
           / np.mean([_expected_run(0, s)[ar.STEPS_KEY] for s in SEEDS]))
  assert out["summary"]["token"]["steps_ratio"]["mean"] == pytest.approx(ratio, rel=RTOL)
  assert out["summary"]["full"]["final_reward_pct_of_reference"]["mean"] == 100.0
  text = out["markdown"]
  assert "Beside the seed's figures" in text and "| token |" in text and "±15" in text
  assert "006_crashed" in text
  for path in out["paths"].values():
    assert path.parent == tmp_path / "out" and path.stat().st_size > 0
  saved = json.loads(out["paths"]["json"].read_text())
  assert saved["summary"]["token"]["grad_norm_cv"] == out["summary"]["token"]["grad_norm_cv"]


def test_seed_bands_use_the_steps_every_run_logged(tmp_path):
  _write_sweep(tmp_path)
  runs, _ = ar.load_runs(tmp_path)
  token = ar.group_arms(runs)["token"]
  del token[1].history[5]  # step 5 missing in one run
  steps, mean, std = ar.seed_bands(token, "train/loss")
  keep = np.array([t != 5 for t in range(1, N + 1)])
  x = np.stack([_curves(1, s)["train/loss"][keep] for s in SEEDS])
  np.testing.assert_array_equal(steps, np.arange(1, N + 1)[keep])
  np.testing.assert_allclose(mean, x.mean(axis=0), rtol=RTOL)
  np.testing.assert_allclose(std, x.std(axis=0), rtol=RTOL, atol=1e-12)
  with pytest.raises(ValueError, match="no step where every run logged 'nope'"):
    ar.seed_bands(token, "nope")


def test_a_reference_without_reward_has_no_steps_to_reach(tmp_path):
  _write_sweep(tmp_path, arms=("routing", "uniform"), failed=("uniform", 0))
  for run in sorted(tmp_path.glob("00[0-2]_*")):  # the reference arm never scores
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{**r, "reward/mean": 0.0} if "reward/mean" in r else r for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = ar.report(tmp_path)
  assert all(r[ar.STEPS_KEY] is None and r["final_reward_pct_of_reference"] is None
             for r in out["runs"])
  assert "Beside the seed's figures" not in out["markdown"]  # not the estimator sweep


def test_missing_summary_names_the_directory(tmp_path):
  with pytest.raises(ValueError, match="sweep_dir=.*has no sweep_summary.json"):
    ar.report(tmp_path / "nothing")


def test_tiny_estimator_sweep_lists_twelve_distinct_runs():
  spec = f"{CONFIG}:tiny,ablation=estimator"
  sweep = config_utils.load_sweep(spec)
  assert len(sweep) == 12 and len({json.dumps(o, sort_keys=True) for o in sweep}) == 12
  seen, steps = set(), set()
  for overrides in sweep:
    c = config_utils.apply_overrides(config_utils.load_config(spec), overrides)
    k = c.opd.loss.top_k if c.opd.loss.estimator == "top_k" else None
    seen.add((c.opd.loss.estimator, k, c.seed))
    assert c.run_label == {"full": "full", "token": "token"}.get(c.opd.loss.estimator, f"top-{k}")
    assert c.opd.verify and c.opd.weighting.anneal_steps == 0
    steps.add(c.train.steps)
  assert seen == {(e, k, s) for e, k in (("full", None), ("top_k", 10), ("top_k", 32),
                                         ("token", None)) for s in (0, 1, 2)}
  assert sweep[0]["run_label"] == "full"  # the reference arm comes first
  # The same steps for every run, enough for a loss fluctuation over the
  # second half with a 9-point window (n // 2 < n - 4 needs n >= 10).
  assert len(steps) == 1 and steps.pop() >= 10


def test_other_ablations_and_their_arguments():
  weighting = config_utils.load_sweep(f"{CONFIG}:tiny,ablation=weighting")
  assert [(o["opd.weighting.schedule"], o["seed"]) for o in weighting] == [
      (s, seed) for seed in (0, 1, 2) for s in ("routing", "confidence", "uniform")]
  cold = config_utils.load_sweep(f"{CONFIG}:ablation=cold_start,demo=/d")
  assert {o["student.init"] for o in cold} == {"/d/student/seed0/cold_start/checkpoints",
                                               "/d/base/checkpoints"}
  c = config_utils.load_config(f"{CONFIG}:ablation=estimator,demo=/d,steps=20")
  assert c.teachers.code.init == "/d/code/grpo/checkpoints" and c.train.steps == 20
  assert c.student.init == "/d/student/seed0/cold_start/checkpoints"
  c = config_utils.load_config(f"{CONFIG}:tiny,ablation=estimator,teachers_dir=/t")
  assert c.teachers.math.init == "/t/math/checkpoints"
  with pytest.raises(ValueError, match="ablation='cold_start' has no tiny form"):
    config_utils.load_config(f"{CONFIG}:tiny,ablation=cold_start")
  with pytest.raises(ValueError, match="ablation='optimizer'"):
    config_utils.load_config(f"{CONFIG}:ablation=optimizer")
  with pytest.raises(ValueError, match="get_sweep needs config arg ablation"):
    config_utils.load_sweep(f"{CONFIG}:tiny")


def test_tiny_ablation_rejects_a_non_positive_run_count(tmp_path):
  with pytest.raises(ValueError, match=r"max_runs=0: expected a positive number of runs"):
    ar.run_tiny_ablation(tmp_path, "estimator", max_runs=0)
  assert not any(tmp_path.iterdir())  # nothing was built
