"""CPU benchmark: materialised reference vs chunked fused reverse KL (fwd + bwd).

    python -m experiments.benchmarks.kl_loss            # T=2048 D=256 V=131072, K=1,3
    python -m experiments.benchmarks.kl_loss --quick    # small sizes (CI smoke)

Each (implementation, K) runs in its own subprocess, so the peak resident
memory (``ru_maxrss``) belongs to that implementation alone. Reported per
row: median wall time of ``jax.value_and_grad`` (loss summed over tokens,
w.r.t. student hidden states and head), peak RSS, transient RSS (peak minus
the RSS once inputs are placed and the function compiled) and XLA's own
temp-buffer size for the compiled program. Targets (issue #3): chunked
transient memory <= 1/10 of the reference, chunked time <= 1.2x reference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from experiments.benchmarks import common

FULL = dict(t=2048, d=256, v=131072, iters=3)
QUICK = dict(t=128, d=32, v=4096, iters=2)
IMPLS = ("reference", "chunked")


def _current_rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(impl: str, k: int, t: int, d: int, v: int, iters: int) -> dict:
  """Measures one implementation; returns a JSON-able row."""
  import jax
  from pallas_kernels import fused_reverse_kl

  keys = jax.random.split(jax.random.key(0), 2 * k + 3)
  scale = 2.0 / d ** 0.5  # logits ~ N(0, 4)
  h_s = jax.random.normal(keys[0], (t, d))
  w_s = jax.random.normal(keys[1], (d, v)) * scale
  h_k = [jax.random.normal(keys[2 + i], (t, d)) for i in range(k)]
  w_k = [jax.random.normal(keys[2 + k + i], (d, v)) * scale for i in range(k)]
  weights = jax.random.uniform(keys[-1], (t, k))

  def loss(h_s, w_s, h_k, w_k, weights):
    return fused_reverse_kl(h_s, w_s, h_k, w_k, weights, impl=impl).sum()

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = (h_s, w_s, h_k, w_k, weights)
  compiled = fn.lower(*args).compile()
  mem = compiled.memory_analysis()
  jax.block_until_ready(args)
  rss_before = _current_rss_mib()
  timing = common.time_fn(lambda: jax.block_until_ready(compiled(*args)), warmup=1, iters=iters)
  value, _ = compiled(*args)
  peak = common.max_rss_mib()
  return {"impl": impl, "K": k, "ms": timing["median_s"] * 1e3, "min_ms": timing["min_s"] * 1e3,
          "peak_rss_mib": peak, "transient_rss_mib": peak - rss_before,
          "xla_temp_mib": (mem.temp_size_in_bytes / 2**20) if mem is not None else None,
          "loss_sum": float(value)}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes for CI")
  parser.add_argument("--out", default="benchmark_results")
  parser.add_argument("--worker", nargs=6, metavar=("IMPL", "K", "T", "D", "V", "ITERS"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    impl, *nums = args.worker
    print(json.dumps(worker(impl, *map(int, nums))))
    return {}

  sizes = QUICK if args.quick else FULL
  rows = []
  for k in (1, 3):
    for impl in IMPLS:
      row = common.run_isolated("experiments.benchmarks.kl_loss", [
          "--worker", impl, str(k), *(str(sizes[n]) for n in ("t", "d", "v", "iters"))])
      row.pop("max_rss_mib", None)  # the child's own peak_rss_mib is exact
      rows.append(row)
  ratios = []
  for k in (1, 3):
    ref, chk = (next(r for r in rows if r["impl"] == i and r["K"] == k) for i in IMPLS)
    ratios.append({
        "K": k,
        "time_ratio": chk["ms"] / ref["ms"],
        "transient_mem_ratio": chk["transient_rss_mib"] / ref["transient_rss_mib"],
        "peak_mem_ratio": chk["peak_rss_mib"] / ref["peak_rss_mib"],
        "loss_rel_diff": abs(chk["loss_sum"] - ref["loss_sum"]) / abs(ref["loss_sum"]),
    })
  targets = {"time_ratio_max": 1.2, "transient_mem_ratio_max": 0.1}
  for r in ratios:
    r["meets_time"] = r["time_ratio"] <= targets["time_ratio_max"]
    r["meets_memory"] = r["transient_mem_ratio"] <= targets["transient_mem_ratio_max"]
  print(f"# fused reverse KL, CPU, fwd+bwd, T={sizes['t']} Ds=Dt={sizes['d']} V={sizes['v']} float32")
  print(common.format_table(rows, ["impl", "K", "ms", "min_ms", "peak_rss_mib",
                                   "transient_rss_mib", "xla_temp_mib", "loss_sum"]))
  print()
  print(common.format_table(ratios))
  payload = {"sizes": {**sizes, "dtype": "float32", "K": [1, 3]}, "rows": rows,
             "ratios": ratios, "targets": targets, "quick": args.quick}
  path = common.write_result("kl_loss_quick" if args.quick else "kl_loss", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
