"""``make bench`` driver: it knows every benchmark, and its summary path works.

The full ``run_all --quick`` takes minutes on the 2-core reference machine
(each benchmark has its own smoke test), so only the sampler runs here.
"""
import json
import pathlib

from experiments.benchmarks import run_all

BENCH_DIR = pathlib.Path(run_all.__file__).parent


def test_every_benchmark_module_is_run():
  modules = {p.stem for p in BENCH_DIR.glob("*.py")
             if "def main(" in p.read_text() and p.stem != "run_all"}
  assert modules == set(run_all.BENCHMARKS)


def test_run_all_quick_sampler_writes_summary(tmp_path, capsys):
  record = run_all.main(["--quick", "--only", "sampler", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "run_all_quick.json").read_text())
  assert saved["rows"] == record["rows"] and [r["benchmark"] for r in saved["rows"]] == ["sampler"]
  sampler = json.loads((tmp_path / "sampler.json").read_text())
  speedup = sampler["ratios"]["kv_cache_vs_recompute_prefix_speedup"]
  assert f"KV cache {speedup:.1f}x vs prefix recompute" in record["rows"][0]["headline"]
  assert "=== summary" in capsys.readouterr().out
