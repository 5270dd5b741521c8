"""Accelerator benchmark of the fused reverse KL: Pallas vs chunked XLA vs materialised.

    python -m experiments.benchmarks.kl_loss_gpu               # on a GPU (H200), < 5 min
    python -m experiments.benchmarks.kl_loss_gpu --cpu-smoke   # CPU: what runs without one

Part 1, correctness: Pallas (default block sizes of the backend; on CPU both
kernel layouts and the GPU default blocks, ``BlockSizes.get_default("gpu")``,
in interpret mode) and chunked against the materialised reference: loss,
per-teacher KL and the gradients w.r.t. student hidden states and head (mid
size on the device, small on CPU). On CPU the GPU default blocks are also
lowered for CUDA (Pallas -> Triton, ``jax.export``), which checks the kernels'
block shapes without a GPU (no Triton compilation, so no register check).

Part 2, speed and memory: T=8192, Ds=Dt=4096, V=131072, K ∈ {1, 3}, bfloat16
inputs, forward+backward (``value_and_grad`` of the summed loss); on CPU
(``--cpu-smoke``) the same code at tiny sizes, K=1, in-process. Each (impl, K)
runs in its own subprocess on the device. Reported: milliseconds, effective
TFLOP/s with FLOPs counted explicitly as ``2·T·D·V`` per head matmul — (1 + K)
forward logit matmuls plus the two student gradient matmuls (dh_s, dW_s);
recomputation in the backward pass is *not* counted — and device memory:
``transient_gib`` = peak bytes in use during the timed runs minus the bytes
held once the inputs were placed and the function compiled (it includes the
gradient outputs themselves: dW_s alone is 1 GiB in bf16 at these sizes).
Inputs are drawn directly in bfloat16, block by block, at their final widths
(no float32 draws, no slice copies), so setting up does not raise the peak
by more than one 16 Mi-element block; if the timed runs never exceed the
set-up peak, the transient is reported as that bound
(``transient_exact = false``). XLA's own temp-buffer size of the compiled
program is reported too. Ratios against
the materialised reference (time, transient memory) are printed per K, as
in the CPU benchmark. Targets (issue #3): >= 640 effective TFLOP/s (about
55 ms at K=1) and < 2 GB transient. Liger-Kernel's
``LigerFusedLinearJSD(jsd_beta=1)`` (reverse KL, one teacher) is measured on
the same sizes when ``torch`` with CUDA and ``liger_kernel`` import.

Part 3, the gradient-in-forward training entry
(``pallas_kernels.fused_reverse_kl_train``, docs/DESIGN.md §4): correctness of
chunked and Pallas against its reference, and the same timing as part 2
(rows with ``entry = "train"``; the loss is ``Σ_t L_t``, c = 1, the same
sum as the per-token rows) for reference / chunked / Pallas at K ∈ {1, 3} and Pallas at
K = 3 with one shared teacher head. Its effective TFLOP/s count the same
``(1 + K) + 2`` head matmuls (4 at K = 1, 6 at K = 3), which is all it
performs; ``train_vs_per_token`` gives its time over the per-token entry's
for the same (impl, K).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

from experiments.benchmarks import common

PERF = dict(t=8192, d=4096, v=131072)
MID = dict(t=2048, d=2048, v=32768, k=2)
SMOKE = dict(t=40, d=32, v=1000, k=2)
SMOKE_PERF = dict(t=64, d=32, v=512)
IMPLS = ("pallas", "chunked", "reference")
_BLOCK_ELEMENTS = 2 ** 24  # the input draw's working set: one such float32 block
GRAD_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}  # bf16: dz and the gradients round to 8 bits


def _normal(key, shape, dtype, scale=1.0):
  """N(0, scale²) of ``shape`` in ``dtype``, drawn in row blocks of at most
  ``_BLOCK_ELEMENTS`` (``lax.map``), so the draw's float32 temporaries are one
  block, not a full-size copy."""
  import jax
  import jax.numpy as jnp
  rows, row_size = shape[0], math.prod(shape[1:])
  per = max(1, min(rows, _BLOCK_ELEMENTS // max(row_size, 1)))
  while rows % per:
    per -= 1

  def block(k):
    return (jax.random.normal(k, (per, *shape[1:]), jnp.float32) * scale).astype(dtype)
  draw = jax.jit(lambda k: jax.lax.map(block, jax.random.split(k, rows // per)).reshape(shape))
  return draw(key)


def _problem(t, d, v, k, dtype, seed=0, teacher_widths=None):
  """Inputs of one problem; teacher widths default to ``d + 16 i`` (all differ)."""
  import jax
  import jax.numpy as jnp
  widths = teacher_widths or [d + 16 * i for i in range(k)]
  keys = jax.random.split(jax.random.key(seed), 2 * k + 3)
  scale = 2.0 / d ** 0.5  # logits ~ N(0, 4)
  return dict(h_s=_normal(keys[0], (t, d), dtype), w_s=_normal(keys[1], (d, v), dtype, scale),
              h_k=[_normal(keys[2 + i], (t, widths[i]), dtype) for i in range(k)],
              w_k=[_normal(keys[2 + k + i], (widths[i], v), dtype, scale) for i in range(k)],
              weights=jax.random.uniform(keys[-1], (t, k)),
              mask=jnp.arange(t) % 5 != 0)


def _value_and_grads(impl, block_sizes, p, temperature=0.8):
  import jax
  import jax.numpy as jnp
  from pallas_kernels import fused_reverse_kl

  def obj(h_s, w_s, h_k, w_k, weights, mask):
    loss, aux = fused_reverse_kl(h_s, w_s, h_k, w_k, weights, mask, temperature, impl=impl,
                                 block_sizes=block_sizes, return_aux=True)
    return jnp.sum(loss) + 0.5 * jnp.sum(aux["entropy"]), (loss, aux["kl"])
  fn = jax.jit(jax.value_and_grad(obj, argnums=(0, 1), has_aux=True))
  (_, (loss, kl)), grads = fn(p["h_s"], p["w_s"], p["h_k"], p["w_k"], p["weights"], p["mask"])
  return loss, kl, grads


def correctness(sizes, dtype_name: str, cpu: bool) -> list[dict]:
  """Compares each implementation with the materialised reference."""
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels import BlockSizes, ChunkSizes

  dtype = jnp.dtype(dtype_name)
  p = _problem(sizes["t"], sizes["d"], sizes["v"], sizes["k"], dtype)
  impls = [("chunked", "default", ChunkSizes(block_v=256) if cpu else None)]
  if cpu:
    impls += [("pallas", "tiled", BlockSizes(block_t=16, block_v=256, layout="tiled")),
              ("pallas", "looped", BlockSizes(block_t=16, block_v=128, layout="looped",
                                              block_d=16, v_splits=2)),
              ("pallas", "gpu_default", BlockSizes.get_default("gpu"))]
  else:
    impls += [("pallas", "default", None)]
  loss_r, kl_r, grads_r = _value_and_grads("reference", None, p)
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  rows = []
  for impl, label, bs in impls:
    loss, kl, grads = _value_and_grads(impl, bs, p)
    rel = [float(np.abs(f64(g) - f64(r)).max() / np.abs(f64(r)).max()) for g, r in zip(grads, grads_r)]
    row = {"impl": impl, "layout": label, "dtype": dtype_name,
           "loss_max_abs_diff": float(np.abs(f64(loss) - f64(loss_r)).max()),
           "kl_max_abs_diff": float(np.abs(f64(kl) - f64(kl_r)).max()),
           "dh_rel_err": rel[0], "dw_rel_err": rel[1]}
    row["ok"] = bool(row["loss_max_abs_diff"] < 1e-3 and row["kl_max_abs_diff"] < 1e-3
                     and max(rel) < GRAD_RTOL[dtype_name])
    rows.append(row)
  return rows


def lower_for_cuda(block_sizes, sizes) -> str:
  """StableHLO of value-and-grad of the Pallas statistics lowered for CUDA.

  Runs the Pallas -> Triton lowering of all three kernels (forward, dh_s,
  dW_s) for ``block_sizes`` on any machine; returns the module text.
  """
  import jax
  import jax.numpy as jnp
  from jax import export
  from pallas_kernels import pallas_kl, tile_math

  p = _problem(sizes["t"], sizes["d"], sizes["v"], sizes["k"], jnp.bfloat16)

  def value_and_grads(h_s, w_s, h_k, w_k):
    def obj(h_s, w_s):
      st = pallas_kl.vocab_stats_pallas(h_s, w_s, h_k, w_k, 0.8, block_sizes, interpret=False)
      return jnp.sum(tile_math.kl_from_stats(st)) + jnp.sum(st.ent)
    return jax.value_and_grad(obj, argnums=(0, 1))(h_s, w_s)

  # Triton custom calls carry no serialisation guarantee; we only read the text.
  disabled = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  exported = export.export(jax.jit(value_and_grads), platforms=["cuda"], disabled_checks=disabled)
  return exported(p["h_s"], p["w_s"], tuple(p["h_k"]), tuple(p["w_k"])).mlir_module()


def _memory(dev) -> tuple[int, int] | None:
  """(bytes in use, peak bytes in use) of ``dev``, or None where not reported (CPU)."""
  stats = dev.memory_stats()
  if not stats or "bytes_in_use" not in stats:
    return None
  return stats["bytes_in_use"], stats.get("peak_bytes_in_use", stats["bytes_in_use"])


def perf_worker(impl: str, k: int, t: int, d: int, v: int, iters: int = 10,
                entry: str = "per_token") -> dict:
  """Times one implementation on the default device (its own process on a GPU).

  ``entry``: ``"per_token"`` (``fused_reverse_kl(...).sum()``), ``"train"``
  (``fused_reverse_kl_train`` with c = 1) or ``"train_shared"`` (the same
  with K references to one teacher head, ``shared_head=True``).
  """
  import jax
  import jax.numpy as jnp
  from pallas_kernels import fused_reverse_kl, fused_reverse_kl_train

  dev = jax.devices()[0]
  # Ds = Dt = d for the FLOP count; drawn at that width (no slice copies).
  shared = entry == "train_shared"
  p = _problem(t, d, v, k, jnp.bfloat16, teacher_widths=[d] * k)
  args = (p["h_s"], p["w_s"], p["h_k"], p["w_k"][:1] if shared else p["w_k"], p["weights"])
  del p
  jax.block_until_ready(args)

  def loss(h_s, w_s, h_k, w_k, weights):
    if entry == "per_token":
      return fused_reverse_kl(h_s, w_s, h_k, w_k, weights, impl=impl).sum()
    heads = [w_k[0]] * k if shared else w_k
    return fused_reverse_kl_train(h_s, w_s, h_k, heads, weights, jnp.ones((t,), jnp.float32),
                                  impl=impl, shared_head=shared)
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
  xla = compiled.memory_analysis()
  placed = _memory(dev)  # inputs placed, program compiled
  timing = common.time_fn(lambda: jax.block_until_ready(compiled(*args)), warmup=2, iters=iters)
  after = _memory(dev)
  flops = 2.0 * t * d * v * (1 + k + 2)
  row = {"impl": impl, "entry": entry, "K": k, "ms": timing["median_s"] * 1e3,
         "eff_tflops": flops / timing["median_s"] / 1e12,
         "xla_temp_gib": xla.temp_size_in_bytes / 2**30 if xla is not None else None,
         "peak_gib": None, "transient_gib": None, "transient_exact": None}
  if placed is not None and after is not None:
    held, setup_peak = placed
    peak = after[1]
    # The allocator's peak cannot be reset: if the runs never exceeded the
    # set-up peak, (set-up peak - held) bounds their transient from above.
    row.update(peak_gib=peak / 2**30, transient_gib=(peak - held) / 2**30,
               transient_exact=peak > setup_peak)
  return row


def liger_worker(t: int, d: int, v: int) -> dict:
  """LigerFusedLinearJSD with jsd_beta=1 (reverse KL), one teacher, bf16, fwd+bwd."""
  import time
  import torch
  from liger_kernel.transformers import LigerFusedLinearJSD

  torch.manual_seed(0)
  dev, dt = "cuda", torch.bfloat16
  h_s = torch.randn(t, d, device=dev, dtype=dt, requires_grad=True)
  w_s = (torch.randn(v, d, device=dev, dtype=dt) * (2.0 / d ** 0.5)).requires_grad_()
  h_t = torch.randn(t, d, device=dev, dtype=dt)
  w_t = torch.randn(v, d, device=dev, dtype=dt) * (2.0 / d ** 0.5)
  loss_fn = LigerFusedLinearJSD(jsd_beta=1.0, temperature=1.0)

  def step():
    h_s.grad = w_s.grad = None
    loss_fn(h_s, w_s, h_t, w_t).backward()
    torch.cuda.synchronize()
  for _ in range(2):
    step()
  torch.cuda.reset_peak_memory_stats()
  held = torch.cuda.memory_allocated()
  times = []
  for _ in range(10):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  med = sorted(times)[len(times) // 2]
  peak = torch.cuda.max_memory_allocated()
  return {"impl": "liger_fused_linear_jsd", "entry": "per_token", "K": 1, "ms": med * 1e3,
          "eff_tflops": 2.0 * t * d * v * 4 / med / 1e12, "peak_gib": peak / 2**30,
          "transient_gib": (peak - held) / 2**30, "transient_exact": True, "xla_temp_gib": None}


def _ratio_row(r: dict, base: dict | None) -> dict | None:
  if base is None or "error" in r:
    return None
  ratio = lambda key: (r[key] / base[key]) if r.get(key) and base.get(key) else None
  return {"impl": r["impl"], "K": r["K"], "time_ratio": ratio("ms"),
          "transient_mem_ratio": ratio("transient_gib"), "xla_temp_ratio": ratio("xla_temp_gib")}


def ratios_vs_reference(perf: list[dict]) -> list[dict]:
  """Per (impl, K) of the per-token entry: time and transient memory over the
  materialised reference's."""
  out = []
  for r in perf:
    if r.get("entry", "per_token") != "per_token" or r["impl"] == "reference":
      continue
    ref = next((x for x in perf if x["impl"] == "reference" and x["K"] == r["K"]
                and x.get("entry", "per_token") == "per_token" and "error" not in x), None)
    row = _ratio_row(r, ref)
    if row:
      out.append(row)
  return out


def train_vs_per_token(perf: list[dict]) -> list[dict]:
  """Per training row: its time / memory over the per-token entry's (same impl, K)."""
  out = []
  for r in perf:
    if not r.get("entry", "").startswith("train"):
      continue
    base = next((x for x in perf if x["impl"] == r["impl"] and x["K"] == r["K"]
                 and x.get("entry") == "per_token" and "error" not in x), None)
    row = _ratio_row(r, base)
    if row:
      out.append({**row, "entry": r["entry"]})
  return out


def train_correctness(sizes, dtype_name: str) -> list[dict]:
  """``fused_reverse_kl_train`` (chunked, Pallas at default blocks) against its
  materialised reference: loss and the gradients w.r.t. (h_s, W_s)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels import fused_reverse_kl_train

  p = _problem(sizes["t"], sizes["d"], sizes["v"], sizes["k"], jnp.dtype(dtype_name))
  coef = p["mask"] / jnp.sum(p["mask"])

  def run(impl):
    fn = jax.jit(jax.value_and_grad(lambda h, w: fused_reverse_kl_train(
        h, w, p["h_k"], p["w_k"], p["weights"], coef, 0.8, impl=impl), argnums=(0, 1)))
    return fn(p["h_s"], p["w_s"])
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  loss_r, grads_r = run("reference")
  rows = []
  for impl in ("chunked", "pallas"):
    loss, grads = run(impl)
    rel = [float(np.abs(f64(g) - f64(r)).max() / np.abs(f64(r)).max())
           for g, r in zip(grads, grads_r)]
    row = {"impl": impl, "entry": "train", "dtype": dtype_name,
           "loss_abs_diff": abs(float(loss) - float(loss_r)), "dh_rel_err": rel[0],
           "dw_rel_err": rel[1]}
    row["ok"] = bool(row["loss_abs_diff"] < 1e-3 and max(rel) < GRAD_RTOL[dtype_name])
    rows.append(row)
  return rows


TRAIN_JOBS = [("train", impl, k) for k in (1, 3) for impl in IMPLS] + [
    ("train_shared", "pallas", 3)]


def _perf_device() -> list[dict]:
  perf = []
  jobs = ([("per_token", impl, k) for k in (1, 3) for impl in IMPLS]
          + [("per_token", "liger", 1)] + TRAIN_JOBS)
  for entry, impl, k in jobs:
    try:
      perf.append(common.run_isolated("experiments.benchmarks.kl_loss_gpu", [
          "--worker", impl, str(k), *(str(PERF[n]) for n in ("t", "d", "v")),
          "--entry", entry], timeout=240))
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # e.g. OOM: record, keep going
      name = "liger_fused_linear_jsd" if impl == "liger" else impl
      perf.append({"impl": name, "entry": entry, "K": k, "error": str(e)[-300:]})
  for r in perf:
    r.pop("max_rss_mib", None)
  return perf


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cpu-smoke", action="store_true",
                      help="CPU: correctness at small sizes (Pallas in interpret mode), the "
                           "CUDA lowering of the GPU default blocks, perf code at tiny sizes")
  parser.add_argument("--out", default="benchmark_results")
  parser.add_argument("--worker", nargs=5, metavar=("IMPL", "K", "T", "D", "V"),
                      help=argparse.SUPPRESS)
  parser.add_argument("--entry", default="per_token", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    impl, *nums = args.worker
    nums = list(map(int, nums))
    row = (liger_worker(*nums[1:]) if impl == "liger"
           else perf_worker(impl, *nums, entry=args.entry))
    print(json.dumps(row))
    return {}

  import jax
  from pallas_kernels import BlockSizes
  cpu = args.cpu_smoke
  if not cpu and jax.default_backend() == "cpu":
    raise SystemExit("no accelerator: run with --cpu-smoke for the CPU-runnable parts")
  checks = correctness(SMOKE if cpu else MID, "bfloat16", cpu)
  print(f"# correctness vs materialised reference ({'CPU smoke' if cpu else 'device'})")
  print(common.format_table(checks))
  train_checks = train_correctness(SMOKE if cpu else MID, "bfloat16")
  print("\n# training entry (fused_reverse_kl_train) vs its materialised reference")
  print(common.format_table(train_checks))
  lowering = None
  if cpu:
    gpu_default = BlockSizes.get_default("gpu")
    module = lower_for_cuda(gpu_default, SMOKE)
    lowering = {"block_sizes": str(gpu_default), "triton_kernels": module.count("xla.gpu.triton"),
                "with_num_warps": module.count(f"num_warps = {gpu_default.num_warps} : i32"),
                "with_num_stages": module.count(f"num_stages = {gpu_default.num_stages} : i32")}
    print(f"\nGPU default {gpu_default} lowers for CUDA: "
          f"{lowering['triton_kernels']} Triton kernels")
  if cpu:  # the device code path at tiny sizes, in-process (no device memory stats on CPU)
    sizes = SMOKE_PERF
    perf = [perf_worker(impl, 1, sizes["t"], sizes["d"], sizes["v"], iters=2) for impl in IMPLS]
    perf += [perf_worker(impl, 1, sizes["t"], sizes["d"], sizes["v"], iters=2, entry="train")
             for impl in IMPLS]
  else:
    sizes = PERF
    perf = _perf_device()
  ratios = ratios_vs_reference(perf)
  train_ratios = train_vs_per_token(perf)
  print(f"\n# fwd+bwd, T={sizes['t']} Ds=Dt={sizes['d']} V={sizes['v']} bf16"
        f"{' (CPU smoke: tiny sizes, timings meaningless)' if cpu else ''}")
  print(common.format_table(perf, ["impl", "entry", "K", "ms", "eff_tflops", "peak_gib",
                                   "transient_gib", "transient_exact", "xla_temp_gib", "error"]))
  print("\n# ratios vs the materialised reference (same K)")
  print(common.format_table(ratios))
  print("\n# training entry / per-token entry (same impl, K)")
  print(common.format_table(train_ratios))
  payload = {"correctness": checks, "train_correctness": train_checks,
             "cuda_lowering": lowering, "perf": perf, "ratios": ratios,
             "train_vs_per_token": train_ratios, "cpu_smoke": cpu,
             "sizes": {"correctness": SMOKE if cpu else MID, "perf": sizes},
             "targets": {"eff_tflops_min": 640, "transient_gib_max": 2.0},
             "flops_formula": "2*T*D*V*(1+K+2): (1+K) forward logit matmuls + dh_s + dW_s",
             "memory": "transient = peak during the timed runs - bytes held after inputs were "
                       "placed and the program compiled (device memory_stats; None on CPU)"}
  path = common.write_result("kl_loss_gpu_smoke" if cpu else "kl_loss_gpu", payload, args.out)
  print(f"wrote {path}")
  if not all(c["ok"] for c in checks + train_checks):
    raise SystemExit("correctness check failed")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
