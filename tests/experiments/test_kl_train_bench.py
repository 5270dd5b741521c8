"""Smoke test of the training-loss benchmark (experiments/benchmarks/kl_train.py).

Runs ``--quick`` end to end (seven measurement subprocesses) and checks the JSON
record: machine info, every (path, case) row, and ratios against the
baseline measured in the same run. The training entry and the per-token
path compute the same loss, so their values must agree; the speed is not
checked at smoke sizes.
"""
import json

import numpy as np

from experiments.benchmarks import kl_train


def test_kl_train_benchmark_quick(tmp_path):
  payload = kl_train.main(["--quick", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "kl_train_quick.json").read_text())
  assert record["machine"]["backend"] == "cpu" and record["quick"] is True
  assert record["sizes"]["t"] == kl_train.QUICK["t"] and record["sizes"]["dtype"] == "float32"
  assert {(r["path"], r["case"]) for r in record["rows"]} == {
      (p, c[0]) for p in kl_train.PATHS for c in kl_train.CASES}
  for row in record["rows"]:
    assert row["ms"] > 0 and row["cpu_ms"] > 0 and row["peak_rss_mib"] > 0
  assert [r["case"] for r in payload["ratios"]] == [c[0] for c in kl_train.CASES]
  for ratio in record["ratios"]:
    # Same loss in float32: a sum over T=128 tokens of O(1) terms.
    assert ratio["loss_rel_diff"] < 1e-5
    assert ratio["time_ratio"] > 0 and ratio["peak_mem_ratio"] > 0
    assert ratio["time_target"] == kl_train.TARGETS[ratio["case"]]
    assert isinstance(ratio["meets_time"], bool) and isinstance(ratio["meets_memory"], bool)
  assert record["shared_vs_separate_time"] > 0
  for ratio in record["ratios"]:
    assert ratio["cpu_time_ratio_min"] <= ratio["cpu_time_ratio"] <= ratio["cpu_time_ratio_max"]
  # Floor: every matmul kind at each chunk row count, both paths' elementwise
  # passes per K, and per case the minimal work summed from them.
  rows = {(r["item"], r["rows"], r["K"]) for r in record["floor_rows"]}
  chunk_rows = {int(k): c for k, c in record["chunk_rows"].items()}
  for c in {kl_train.QUICK["t"], *chunk_rows.values()}:
    assert {(f"mm_{m}", c, None) for m in kl_train.MATMULS} <= rows
  for k, c in chunk_rows.items():
    assert {("ew_per_token", kl_train.QUICK["t"], k), ("ew_train", c, k)} <= rows
  for f in record["floors"]:
    k = f["K"]
    # 2(1 + K) + 2 against 1 + K + 2 matmul passes of the same cost: the
    # per-token matmul floor exceeds the training one by (1 + K) z passes.
    z = next(r["cpu_ms"] for r in record["floor_rows"] if r["item"] == "mm_z"
             and r["rows"] == kl_train.QUICK["t"])
    np.testing.assert_allclose(f["mm_per_token_ms"] - f["mm_train_ms"], (1 + k) * z, rtol=1e-9)
    assert f["floor_ratio"] == f["floor_train_ms"] / f["floor_per_token_ms"]
