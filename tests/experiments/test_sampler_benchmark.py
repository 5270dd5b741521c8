"""Smoke test of experiments/benchmarks/sampler.py in --quick mode.

Timings are not asserted (the reference machine is shared); the test checks
that both methods run, decode the same greedy tokens and that the JSON
record holds the sizes, rows and ratio.
"""
import json

from experiments.benchmarks import sampler as bench


def test_sampler_benchmark_quick(tmp_path, capsys):
  payload = bench.main(["--quick", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "sampler.json").read_text())
  assert record["benchmark"] == "sampler"
  assert record["sizes"] == payload["sizes"]
  assert record["sizes"]["quick"] is True
  assert {r["method"] for r in record["rows"]} == {"kv_cache", "recompute"}
  for r in record["rows"]:
    assert r["median_s"] > 0 and r["tokens_per_s"] > 0
  assert record["ratios"]["kv_cache_vs_recompute_speedup"] > 0
  # The cached sampler and the cache-free baseline must agree token for token.
  assert record["tokens_match"] == 1.0
  assert "| kv_cache |" in capsys.readouterr().out
