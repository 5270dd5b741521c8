"""Smoke test of experiments/benchmarks/moe.py in --quick mode.

Timings are not asserted (the reference machine is shared). The test checks
the JSON record, that the ratios are the rows' tokens/s ratios, and the
parameter counts against independent formulas from the sizes: the dense
baseline has the MoE's active SwiGLU width, the MoE stores E experts plus
its router.
"""
import json

from experiments.benchmarks import moe as bench


def test_moe_benchmark_quick(tmp_path):
  payload = bench.main(["--quick", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "moe.json").read_text())
  assert record["benchmark"] == "moe" and record["sizes"] == payload["sizes"]
  s = record["sizes"]
  assert s["quick"] is True and s["devices"] == 8  # conftest's fake CPU devices
  tps = {r["layer"]: r["tokens_per_s"] for r in record["rows"]}
  assert set(tps) == {"dense", "moe_ragged", "moe_onehot", "replicated", "expert_parallel"}
  for r in record["rows"]:
    assert r["seconds"] > 0 and abs(r["tokens_per_s"] * r["seconds"] - s["tokens"]) < 1e-6 * s[
        "tokens"]
  ratios = record["ratios"]
  assert ratios["moe_ragged_vs_dense"] == tps["moe_ragged"] / tps["dense"]
  assert ratios["ragged_vs_onehot"] == tps["moe_ragged"] / tps["moe_onehot"]
  assert ratios["expert_parallel_vs_replicated"] == tps["expert_parallel"] / tps["replicated"]
  D, E, k, Fe, S = s["d_model"], s["experts"], s["top_k"], s["moe_d_ff"], s["shared"]
  assert record["params"]["dense"] == 3 * D * (k + S) * Fe
  assert record["params"]["moe_total"] == D * E + 3 * E * D * Fe + 3 * D * S * Fe
