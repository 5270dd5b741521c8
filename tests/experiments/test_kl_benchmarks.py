"""Smoke tests of the fused-KL benchmarks, so that their scripts cannot rot.

* ``kl_loss --quick`` runs the CPU benchmark end to end at small sizes (four
  measurement subprocesses) and must find the chunked loss equal to the
  reference loss measured in the same run;
* ``kl_loss_gpu --cpu-smoke`` runs the accelerator script's correctness part
  on CPU (chunked and both Pallas layouts in interpret mode, bfloat16 as on
  the device, against the materialised reference).
"""
import json

from experiments.benchmarks import kl_loss, kl_loss_gpu


def test_cpu_benchmark_quick(tmp_path):
  payload = kl_loss.main(["--quick", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "kl_loss_quick.json").read_text())
  assert record["machine"]["backend"] == "cpu"
  assert {(r["impl"], r["K"]) for r in record["rows"]} == {
      (i, k) for i in ("reference", "chunked") for k in (1, 3)}
  for ratio in payload["ratios"]:
    assert ratio["loss_rel_diff"] < 1e-5
    assert ratio["time_ratio"] > 0 and ratio["transient_mem_ratio"] > 0


def test_gpu_benchmark_cpu_smoke(tmp_path):
  payload = kl_loss_gpu.main(["--cpu-smoke", "--out", str(tmp_path)])
  checks = payload["correctness"]
  assert {(c["impl"], c["layout"], c["dtype"]) for c in checks} == {
      ("chunked", "default", "bfloat16"), ("pallas", "tiled", "bfloat16"),
      ("pallas", "looped", "bfloat16")}
  assert all(c["ok"] for c in checks), checks
  assert (tmp_path / "kl_loss_gpu_smoke.json").exists()
