"""Smoke tests of the fused-KL benchmarks, so that their scripts cannot rot.

* ``kl_loss --quick`` runs the CPU benchmark end to end at small sizes (four
  measurement subprocesses) and must find the chunked loss equal to the
  reference loss measured in the same run;
* ``kl_loss_gpu --cpu-smoke`` runs what the accelerator script can run on
  CPU: the correctness part (chunked, both Pallas layouts and the GPU default
  block sizes in interpret mode, bfloat16 as on the device, against the
  materialised reference), the CUDA lowering of the GPU default blocks, and
  the timing/memory code at tiny sizes.
"""
import json

import jax.numpy as jnp

from experiments.benchmarks import kl_loss, kl_loss_gpu
from pallas_kernels import BlockSizes, pallas_kl


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
  gpu_default = BlockSizes.get_default("gpu")
  sizes = kl_loss_gpu.SMOKE
  # The smoke sizes leave the GPU defaults unshrunk, so the interpret-mode row
  # and the lowering below run exactly the blocks a GPU gets.
  d_max = sizes["d"] + 16 * (sizes["k"] - 1)
  assert pallas_kl._fit(gpu_default, sizes["t"], sizes["v"], d_max, jnp.bfloat16) == gpu_default

  payload = kl_loss_gpu.main(["--cpu-smoke", "--out", str(tmp_path)])
  checks = payload["correctness"]
  assert {(c["impl"], c["layout"], c["dtype"]) for c in checks} == {
      ("chunked", "default", "bfloat16"), ("pallas", "tiled", "bfloat16"),
      ("pallas", "looped", "bfloat16"), ("pallas", "gpu_default", "bfloat16")}
  assert all(c["ok"] for c in checks), checks
  # Forward, dh_s and dW_s lower to Triton with the GPU defaults' compiler params.
  lowering = payload["cuda_lowering"]
  assert lowering["triton_kernels"] == lowering["with_num_warps"] == 3
  assert lowering["with_num_stages"] == 3
  assert {r["impl"] for r in payload["perf"]} == set(kl_loss_gpu.IMPLS)
  assert all(r["ms"] > 0 and r["transient_gib"] is None for r in payload["perf"])  # no CPU stats
  assert {(r["impl"], r["K"]) for r in payload["ratios"]} == {("pallas", 1), ("chunked", 1)}
  assert all(r["time_ratio"] > 0 for r in payload["ratios"])
  record = json.loads((tmp_path / "kl_loss_gpu_smoke.json").read_text())
  assert record["ratios"] == payload["ratios"]

