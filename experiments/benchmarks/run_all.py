"""Runs every CPU benchmark in sequence (``make bench``) and prints a summary.

    python -m experiments.benchmarks.run_all            # default sizes (~10-15 min on 2 cores)
    python -m experiments.benchmarks.run_all --quick    # smoke sizes (~3 min)
    python -m experiments.benchmarks.run_all --only sampler train_step

Each benchmark prints its own table and writes its JSON under ``--out``
(default ``benchmark_results/``); this script adds ``run_all.json`` with the
wall time and the headline ratio of each. The accelerator benchmark
(``kl_loss_gpu``) runs only its ``--cpu-smoke`` part here; run it by hand on
a GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from experiments.benchmarks import (common, kl_loss, kl_loss_gpu, kl_train, moe, opd_forms,
                                    opd_step, rollout, sampler, tokenizer, train_step)


def _sampler_headline(p: dict) -> str:
  r = p["ratios"]
  return (f"KV cache {r['kv_cache_vs_recompute_prefix_speedup']:.1f}x vs prefix recompute "
          f"({r['kv_cache_vs_recompute_full_speedup']:.1f}x vs full buffer)")


def _train_step_headline(p: dict) -> str:
  return (f"train-step / matmul FLOP/s {p['ratios']['train_step_vs_matmul_flops']:.3f} "
          "(causal attention FLOPs)")


def _moe_headline(p: dict) -> str:
  r = p["ratios"]
  return (f"MoE fwd+bwd tokens/s: {r['moe_ragged_vs_dense']:.2f}x a dense layer of equal active "
          f"params, grouped matmul {r['ragged_vs_onehot']:.2f}x one-hot, expert-parallel "
          f"{r['expert_parallel_vs_replicated']:.2f}x replicated ({p['sizes']['devices']} devices)")


def _tokenizer_headline(p: dict) -> str:
  return "; ".join(f"{r['tokenizer']}: {r['ratio']:.2f}x fewer tokens than bytes"
                   for r in p["overall"] if r["tokenizer"] != "byte")


def _kl_headline(p: dict) -> str:
  return "; ".join(f"K={r['K']}: chunked/reference time {r['time_ratio']:.2f}, transient "
                   f"{r['transient_mem_ratio']:.3f}" for r in p["ratios"])


def _kl_train_headline(p: dict) -> str:
  return "; ".join(f"{r['case']}: train/per-token time {r['time_ratio']:.2f}, peak memory "
                   f"{r['peak_mem_ratio']:.2f}" for r in p["ratios"])


def _kl_gpu_headline(p: dict) -> str:
  ok = sum(c["ok"] for c in p["correctness"])
  return (f"{ok}/{len(p['correctness'])} correctness rows ok, "
          f"{p['cuda_lowering']['triton_kernels']} kernels lower for CUDA")


def _opd_step_headline(p: dict) -> str:
  parts = []
  for r in p["ratios"]:
    if r["V"] == max(p["sizes"]["vocab"]) and "vs_materialised" in r:
      a = r["vs_materialised"]
      part = f"V={r['V']} K={r['K']}: {a['peak_mem_ratio']:.1f}x less memory than materialised"
      if "time_ratio" in a:
        part += f", time {a['time_ratio']:.2f}x"
      if "time_ratio" in r.get("vs_tunix_rkl", {}):
        part += f", time vs tunix {r['vs_tunix_rkl']['time_ratio']:.2f}x"
      parts.append(part)
  return "; ".join(parts)


def _opd_forms_headline(p: dict) -> str:
  return "; ".join(f"V={r['V']} K={r['K']}: advantage/exact time "
                   f"{r['advantage_vs_exact']['time_ratio']:.2f}, peak memory "
                   f"{r['advantage_vs_exact']['peak_mem_ratio']:.2f}" for r in p["ratios"])


def _rollout_headline(p: dict) -> str:
  agg = p["grpo_total"]
  text = (f"GRPO largest stage {agg['largest_stage']} "
          f"({100 * agg['share'][agg['largest_stage']]:.0f}%)")
  for s in p.get("speedups", []):
    if "verify" in s and s["batch"] == "grpo/code":
      text += f"; code verify {s['verify']:.2f}x vs baseline (outputs match: {s['outputs_match']})"
  return text


# name -> (main, arguments at default sizes, extra arguments for --quick, headline)
BENCHMARKS: dict[str, tuple[Callable[..., dict], list[str], list[str],
                            Callable[[dict], str]]] = {
    "sampler": (sampler.main, [], ["--quick"], _sampler_headline),
    "train_step": (train_step.main, [], ["--quick"], _train_step_headline),
    "kl_loss": (kl_loss.main, [], ["--quick"], _kl_headline),
    "kl_train": (kl_train.main, [], ["--quick"], _kl_train_headline),
    "kl_loss_gpu": (kl_loss_gpu.main, ["--cpu-smoke"], [], _kl_gpu_headline),
    "opd_step": (opd_step.main, [], ["--quick"], _opd_step_headline),
    "opd_forms": (opd_forms.main, [], ["--quick"], _opd_forms_headline),
    "rollout": (rollout.main, [], ["--quick"], _rollout_headline),
    "moe": (moe.main, [], ["--quick"], _moe_headline),
    "tokenizer": (tokenizer.main, [], ["--quick"], _tokenizer_headline),
}


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="every benchmark at smoke sizes")
  parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="a subset, in order")
  parser.add_argument("--out", default="benchmark_results")
  args = parser.parse_args(argv)
  names = args.only or list(BENCHMARKS)
  summary = []
  for name in names:
    fn, base, quick, headline = BENCHMARKS[name]
    argv_b = base + (quick if args.quick else []) + ["--out", args.out]
    print(f"\n=== {name} {' '.join(argv_b)}", flush=True)
    t0 = time.perf_counter()
    payload = fn(argv_b)
    summary.append({"benchmark": name, "seconds": time.perf_counter() - t0,
                    "headline": headline(payload)})
  print("\n=== summary")
  print(common.format_table(summary, ["benchmark", "seconds", "headline"]))
  record = {"quick": args.quick, "rows": summary}
  path = common.write_result("run_all_quick" if args.quick else "run_all", record, args.out)
  print(f"wrote {path}")
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
