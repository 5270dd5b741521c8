"""Smoke test of experiments/benchmarks/sampler.py in --quick mode.

Timings are not asserted (the reference machine is shared); the test checks
that the three decoders run and decode the same greedy tokens, that the
prefix baseline's segments cover every generated column from a wide enough
prefix, and that the JSON record holds sizes, rows, both speedups and the
headline's name.
"""
import json

from experiments.benchmarks import sampler as bench


def test_prefix_widths_cover_each_column_once():
  P, N, bucket = 5, 30, 8
  segments = bench.prefix_widths(P, N, bucket)
  covered = [c for _, start, stop in segments for c in range(start, stop)]
  assert covered == list(range(P, P + N))
  for width, start, stop in segments:
    # Column c is predicted from [0, c): the view must hold it, and no more
    # than one bucket of extra columns is recomputed.
    assert all(c <= width < c + bucket for c in range(start, stop)) and width <= P + N
  assert len({w for w, _, _ in segments}) == len(segments)  # one compile per width


def test_sampler_benchmark_quick(tmp_path, capsys):
  payload = bench.main(["--quick", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "sampler.json").read_text())
  assert record["benchmark"] == "sampler"
  assert record["sizes"] == payload["sizes"]
  assert record["sizes"]["quick"] is True
  rows = {r["method"]: r for r in record["rows"]}
  assert set(rows) == {"kv_cache", "recompute_prefix", "recompute_full"}
  for r in rows.values():
    assert r["median_s"] > 0 and r["tokens_per_s"] > 0 and r["first_call_s"] > 0
  s = record["sizes"]
  assert rows["recompute_prefix"]["compiles"] == len(record["prefix_segments"])
  assert rows["recompute_full"]["columns_per_step"] == s["prompt_len"] + s["new_tokens"]
  # The prefix baseline does less decoder work than the full buffer.
  assert record["ratios"]["full_vs_prefix_work"] > 1
  assert record["headline"] == "kv_cache_vs_recompute_prefix_speedup"
  for name in ("kv_cache_vs_recompute_prefix_speedup", "kv_cache_vs_recompute_full_speedup"):
    assert record["ratios"][name] > 0
  # The cached sampler and both cache-free baselines agree token for token.
  assert record["tokens_match"] == {"recompute_prefix": 1.0, "recompute_full": 1.0}
  out = capsys.readouterr().out
  assert "| kv_cache |" in out and "| recompute_prefix |" in out and "headline" in out
