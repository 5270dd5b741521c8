"""Smoke test of experiments/benchmarks/train_step.py in --quick mode.

Timings are not asserted (the reference machine is shared). The test checks
the JSON record and that the explicit FLOP counts agree with an independent
count computed here from the sizes: 6 x (matmul parameters) x tokens plus the
attention score/value matmuls, over the (T + 1) / 2 unmasked keys per query
for the headline count and over all T keys for the executed count, which
XLA's cost analysis must match.
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
  # attention adds QK^T and PV: over t + 1 keys for query t (causal), over
  # all T keys as the decoder executes it.
  m, s = record["model"], record["sizes"]
  D, F, V, L, T, H = m["d_model"], m["d_ff"], m["vocab_size"], m["n_layers"], s["seq"], m["n_heads"]
  B, Dh = s["batch"], D // H
  matmul_params = L * (4 * D * D + 3 * D * F) + D * V  # q,k,v,o (K = H here), MLP, LM head
  causal_keys = sum(t + 1 for t in range(T))  # per row
  causal = 3 * B * (2 * matmul_params * T + L * 2 * 2 * H * Dh * causal_keys)
  dense = 3 * B * T * (2 * matmul_params + L * 2 * 2 * H * Dh * T)
  assert step["flops"] == causal
  assert record["flops_dense_attention"] == dense
  # XLA counts the executed matmuls plus elementwise work: a little more, never less.
  assert 1.0 <= record["xla_flops"] / dense < 1.25
  assert record["xla_vs_dense"] == record["xla_flops"] / dense
  out = capsys.readouterr().out
  assert "causal half" in out
  assert "| train_step |" in out
