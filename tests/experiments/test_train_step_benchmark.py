"""Smoke test of experiments/benchmarks/train_step.py in --quick mode.

Timings are not asserted (the reference machine is shared). The test checks
the JSON record and that the explicit FLOP count agrees with an independent
count: 6 x (matmul parameters) x tokens plus the attention score/value
matmuls, computed here from the sizes, and with XLA's cost analysis.
"""
import json

from experiments.benchmarks import train_step as bench


def test_train_step_benchmark_quick(tmp_path, capsys):
  payload = bench.main(["--quick", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "train_step.json").read_text())
  assert record["benchmark"] == "train_step"
  assert record["sizes"] == payload["sizes"] and record["sizes"]["quick"] is True
  step = record["rows"][-1]
  assert step["op"] == "train_step" and step["seconds"] > 0 and step["gflop_per_s"] > 0
  assert all(r["seconds"] > 0 for r in record["rows"])
  assert record["ratios"]["train_step_vs_matmul_flops"] > 0

  # Independent FLOP count: every weight matrix is used once per token in
  # the forward pass (2 FLOPs per multiply-add) and twice in the backward;
  # attention adds QK^T and PV over T keys per layer.
  m, s = record["model"], record["sizes"]
  D, F, V, L, T, H = m["d_model"], m["d_ff"], m["vocab_size"], m["n_layers"], s["seq"], m["n_heads"]
  Dh = D // H
  matmul_params = L * (4 * D * D + 3 * D * F) + D * V  # q,k,v,o (K = H here), MLP, LM head
  attention = L * 2 * 2 * T * H * Dh
  expected = 3 * (2 * matmul_params + attention) * s["tokens"]
  assert step["flops"] == expected
  # XLA counts the same matmuls plus elementwise work: a little more, never less.
  assert 1.0 <= record["xla_flops"] / expected < 1.25
  assert "| train_step |" in capsys.readouterr().out
