"""CPU benchmark: gradient-in-forward training entry vs the per-token chunked path.

    python -m experiments.benchmarks.kl_train            # T=2048 D=256 V=131072 fp32
    python -m experiments.benchmarks.kl_train --quick    # small sizes (CI smoke)

Both sides compute the same scalar training loss ``Σ_t c_t L_t`` (c = mask /
token count, 80% of tokens on) and its gradients w.r.t. the student hidden
states and head, under ``jax.value_and_grad``:

* ``per_token`` (baseline): ``Σ c · fused_reverse_kl(..., impl="chunked")``,
  whose ``custom_vjp`` backward recomputes every logit tile
  (2(1 + K) + 2 head matmuls);
* ``train``: ``fused_reverse_kl_train(..., impl="chunked")``, loss and
  gradients in one pass (1 + K + 2 head matmuls, docs/DESIGN.md §4).

Cases: K = 1, K = 3 with separate heads, K = 3 sharing one head array (the
shared-head fast path; the baseline has none and runs the same heads as
separate ones). Each (path, case) runs in its own subprocess, so its peak
resident memory (``ru_maxrss``) is its own. Reported per row: median wall
time, peak RSS, transient RSS (peak minus the RSS once the inputs are
placed and the program compiled) and XLA's temp-buffer size of the compiled
program; also the process CPU time of one call (``cpu_ms``, the median over
the timed calls), which other jobs sharing the machine inflate much less
than the wall time, and every timed call's CPU time (``cpu_calls_ms``); the
ratio rows give the spread of the i-th calls' ratio (``cpu_time_ratio_min`` /
``_max``). Targets (issue #13): time ≤ 0.75x the baseline at K = 1 and ≤ 0.70x
at K = 3, peak memory no higher.

Floor (one more subprocess): each head matmul kind (``z = h W``, ``g Wᵀ``,
``dW += hᵀ g``) timed alone over all of T × V, at T rows and at the training
path's chunk rows C, and each path's elementwise passes alone (the same
tile_math updates on synthetic tiles, no matmul). ``floors`` adds them up per
case: the per-token path's 2(1 + K) + 2 matmuls plus its elementwise work,
the training path's 1 + K + 2 at T rows (its ideal) and at C rows.
``floor_ratio`` is the best ratio the training path's work allows against
the baseline's minimal work; ``train_over_floor`` / ``per_token_over_floor``
say how close each measured path is to its own floor.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments.benchmarks import common

FULL = dict(t=2048, d=256, v=131072, iters=3)
QUICK = dict(t=128, d=32, v=4096, iters=2)
CASES = (("K1", 1, False), ("K3", 3, False), ("K3_shared", 3, True))
PATHS = ("per_token", "train")
TARGETS = {"K1": 0.75, "K3": 0.70, "K3_shared": 0.70}


def _current_rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(path: str, case: str, t: int, d: int, v: int, iters: int) -> dict:
  """Measures one (path, case); returns a JSON-able row."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels import fused_reverse_kl, fused_reverse_kl_train

  _, k, shared = next(c for c in CASES if c[0] == case)
  keys = jax.random.split(jax.random.key(0), 2 * k + 3)
  scale = 2.0 / d ** 0.5  # logits ~ N(0, 4)
  h_s = jax.random.normal(keys[0], (t, d))
  w_s = jax.random.normal(keys[1], (d, v)) * scale
  h_k = [jax.random.normal(keys[2 + i], (t, d)) for i in range(k)]
  w_k = [jax.random.normal(keys[2 + k + i], (d, v)) * scale for i in range(1 if shared else k)]
  weights = jax.random.uniform(keys[-1], (t, k))
  mask = jnp.arange(t) % 5 != 0
  coef = mask / jnp.sum(mask)

  def loss(h_s, w_s, h_k, w_k, weights, coef):
    heads = [w_k[0]] * k if shared else w_k
    if path == "train":
      return fused_reverse_kl_train(h_s, w_s, h_k, heads, weights, coef, impl="chunked",
                                    shared_head=shared)
    per_tok = fused_reverse_kl(h_s, w_s, h_k, heads, weights, coef != 0, impl="chunked")
    return jnp.sum(coef * per_tok)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = (h_s, w_s, h_k, w_k, weights, coef)
  compiled = fn.lower(*args).compile()
  mem = compiled.memory_analysis()
  jax.block_until_ready(args)
  rss_before = _current_rss_mib()
  cpu = []

  def call():
    t0 = time.process_time()
    jax.block_until_ready(compiled(*args))
    cpu.append(time.process_time() - t0)
  timing = common.time_fn(call, warmup=1, iters=iters)
  cpu_calls = cpu[1:]  # the timed calls (the first is the warm-up)
  cpu_s = sorted(cpu_calls)[len(cpu_calls) // 2]
  value, _ = compiled(*args)
  peak = common.max_rss_mib()
  return {"path": path, "case": case, "K": k, "shared_head": shared,
          "ms": timing["median_s"] * 1e3, "min_ms": timing["min_s"] * 1e3,
          "cpu_ms": cpu_s * 1e3, "cpu_calls_ms": [c * 1e3 for c in cpu_calls],
          "peak_rss_mib": peak, "transient_rss_mib": peak - rss_before,
          "xla_temp_mib": (mem.temp_size_in_bytes / 2**20) if mem is not None else None,
          "loss": float(value)}


# Floor of the work: the head matmuls and the elementwise passes, each timed alone.
MATMULS = ("z", "dh", "dw")  # h W_tile, g W_tileᵀ, dW_tile += hᵀ g


def _mm_pass(kind: str, rows: int, t: int, d: int, v: int, block_v: int):
  """Jitted ``f(h [T, D], w [D, V]) ->`` one matmul of ``kind`` over all of T × V,
  in chunks of ``rows`` tokens × tiles of ``block_v`` columns (the loop nest of
  the training path; rows = T is the per-token path's). The [rows, tile]
  operand of dh / dw is the tile ``h_c W_tile`` stood in as ``g`` computed
  ONCE per chunk from the first tile, so only the named matmul runs per tile."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  n, bv = -(-t // rows), block_v

  def f(h, w):
    h = jnp.pad(h, ((0, n * rows - t), (0, 0)))  # zero rows, as the training path pads
    def chunk(carry, i):
      dh, dw = carry
      h_c = lax.dynamic_slice_in_dim(h, i * rows, rows, 0)
      g0 = h_c @ w[:, :bv]  # [C, bv], once per chunk

      def tile(carry, j):
        dh, dw = carry
        w_t = lax.dynamic_slice_in_dim(w, j * bv, bv, 1)
        if kind == "z":  # the logit product; a [C, D] column block keeps it alive
          return (dh + lax.slice_in_dim(h_c @ w_t, 0, d, axis=1), dw), None
        g = g0 * (1.0 + j.astype(jnp.float32))  # varies per tile: no hoisting
        if kind == "dh":
          return (dh + jnp.einsum("TV,DV->TD", g, w_t), dw), None
        dw_t = lax.dynamic_slice_in_dim(dw, j * bv, bv, 1) + jnp.einsum("TD,TV->DV", h_c, g)
        return (dh, lax.dynamic_update_slice_in_dim(dw, dw_t, j * bv, 1)), None
      return lax.scan(tile, (dh, dw), jnp.arange(v // bv))[0], None
    return lax.scan(chunk, (jnp.zeros((rows, d)), jnp.zeros((d, v))), jnp.arange(n))[0]
  return jax.jit(f)


def _ew_pass(path: str, k: int, rows: int, t: int, v: int, block_v: int):
  """Jitted ``f(z0, x0 [T, block_v]) ->`` the elementwise work of ``path`` alone
  over T × V: the same tile_math updates on synthetic tiles ``z0 + δ·j`` (no
  matmul). ``per_token``: forward ``acc_update`` and backward ``dz_tile``;
  ``train``: pass 1 (``acc_update``, ``e``, ``b`` into [C, V] buffers) and
  pass 2 (``g`` from the buffers), per chunk of ``rows`` tokens."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from pallas_kernels import tile_math
  n, bv, nt = -(-t // rows), block_v, v // block_v

  def tiles(z0, x0, j):
    shift = 1e-3 * j.astype(jnp.float32)
    return z0 + shift, [x0 + (i + 1) * shift for i in range(k)]

  def f(z0, x0):
    z0, x0 = (jnp.pad(a, ((0, n * rows - t), (0, 0))) for a in (z0, x0))
    wh = jnp.full((rows, k), 1.0 / k)
    def chunk(out, i):
      z0c, x0c = (lax.dynamic_slice_in_dim(a, i * rows, rows, 0) for a in (z0, x0))

      def fwd(carry, j):
        acc, eb, bb = carry
        z, xs = tiles(z0c, x0c, j)
        acc = tile_math.acc_update(acc, z, xs, None)
        if path == "train":
          b = z - sum(wh[:, i:i + 1] * x for i, x in enumerate(xs))
          eb = lax.dynamic_update_slice_in_dim(eb, jnp.exp(z - acc.m), j * bv, 1)
          bb = lax.dynamic_update_slice_in_dim(bb, b, j * bv, 1)
        return (acc, eb, bb), None
      buf = jnp.zeros((rows, v) if path == "train" else (1, 1))
      (acc, eb, bb), _ = lax.scan(fwd, (tile_math.acc_init(rows, k), buf, buf), jnp.arange(nt))
      st = tile_math.stats_from_columns(*tile_math.acc_finalize(acc), k)

      def bwd(s, j):
        if path == "train":
          e = lax.dynamic_slice_in_dim(eb, j * bv, bv, 1)
          b = lax.dynamic_slice_in_dim(bb, j * bv, bv, 1)
          g = (st.lse[:, None] * 1e-3) * e * (b - st.e_k[:, :1])
        else:
          coef = tile_math.coef_from_cotangents(
              st, tile_math.Stats(st.lse * 0, st.ent * 0, st.e_k * 0 + 1.0, st.lse_k))
          z, xs = tiles(z0c, x0c, j)
          g = tile_math.dz_tile(z, xs, None, coef)
        return s + jnp.sum(g, axis=1), None
      return out + jnp.sum(lax.scan(bwd, jnp.zeros(rows), jnp.arange(nt))[0]), None
    return lax.scan(chunk, jnp.zeros(()), jnp.arange(n))[0]
  return jax.jit(f)


def floor_worker(t: int, d: int, v: int, iters: int, rows_k1: int, rows_k3: int) -> list:
  """CPU time (median and spread of ``iters`` calls after a warm-up) of each
  matmul kind at T rows and at the training path's chunk rows, and of each
  path's elementwise passes alone. Rows of {"item", "rows", "K", "cpu_ms", ...}."""
  import jax
  block_v = 2048
  keys = jax.random.split(jax.random.key(1), 4)
  h = jax.random.normal(keys[0], (t, d))
  w = jax.random.normal(keys[1], (d, v)) * (2.0 / d ** 0.5)
  z0 = 2.0 * jax.random.normal(keys[2], (t, block_v))
  x0 = 2.0 * jax.random.normal(keys[3], (t, block_v))

  def cpu_times(fn, *args):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    out = []
    for _ in range(iters):
      t0 = time.process_time()
      jax.block_until_ready(fn(*args))
      out.append((time.process_time() - t0) * 1e3)
    return out

  rows_out = []
  for rows in sorted({t, rows_k1, rows_k3}):
    for kind in MATMULS:
      rows_out.append({"item": f"mm_{kind}", "rows": rows, "K": None,
                       "cpu_calls_ms": cpu_times(_mm_pass(kind, rows, t, d, v, block_v), h, w)})
  for k, rows in ((1, rows_k1), (3, rows_k3)):
    for path, r in (("per_token", t), ("train", rows)):
      rows_out.append({"item": f"ew_{path}", "rows": r, "K": k,
                       "cpu_calls_ms": cpu_times(_ew_pass(path, k, r, t, v, block_v), z0, x0)})
  for r in rows_out:
    r["cpu_ms"] = float(np.median(r["cpu_calls_ms"]))
  return rows_out


def floor_table(floor_rows: list, t: int, c_of_k: dict) -> list:
  """Per case, the minimal work in CPU ms: head matmuls (count × one pass of
  each kind) plus the path's elementwise passes, for the per-token path (T
  rows, 2(1 + K) logit products), the training path at T rows (its ideal,
  1 + K) and at its chunk of C rows."""
  get = lambda item, rows, k=None: next(r["cpu_ms"] for r in floor_rows
                                        if r["item"] == item and r["rows"] == rows
                                        and r["K"] == k)
  out = []
  for case, k, _ in CASES:
    c = c_of_k[k]
    mm = lambda rows, n_z: n_z * get("mm_z", rows) + get("mm_dh", rows) + get("mm_dw", rows)
    out.append({"case": case, "K": k, "C": c,
                "mm_per_token_ms": mm(t, 2 * (1 + k)), "mm_train_ms": mm(t, 1 + k),
                "mm_train_chunked_ms": mm(c, 1 + k),
                "ew_per_token_ms": get("ew_per_token", t, k), "ew_train_ms": get("ew_train", c, k)})
  for r in out:
    r["floor_per_token_ms"] = r["mm_per_token_ms"] + r["ew_per_token_ms"]
    r["floor_train_ms"] = r["mm_train_ms"] + r["ew_train_ms"]
    r["floor_train_chunked_ms"] = r["mm_train_chunked_ms"] + r["ew_train_ms"]
    r["floor_ratio"] = r["floor_train_ms"] / r["floor_per_token_ms"]
    r["floor_ratio_chunked"] = r["floor_train_chunked_ms"] / r["floor_per_token_ms"]
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes for CI")
  parser.add_argument("--out", default="benchmark_results")
  parser.add_argument("--worker", nargs=6, metavar=("PATH", "CASE", "T", "D", "V", "ITERS"),
                      help=argparse.SUPPRESS)
  parser.add_argument("--floor-worker", nargs=6, metavar=("T", "D", "V", "ITERS", "C1", "C3"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    path, case, *nums = args.worker
    print(json.dumps(worker(path, case, *map(int, nums))))
    return {}
  if args.floor_worker:
    print(json.dumps({"floor_rows": floor_worker(*map(int, args.floor_worker))}))
    return {}

  sizes = QUICK if args.quick else FULL
  rows = []
  for case, _, _ in CASES:
    for path in PATHS:
      row = common.run_isolated("experiments.benchmarks.kl_train", [
          "--worker", path, case, *(str(sizes[n]) for n in ("t", "d", "v", "iters"))])
      row.pop("max_rss_mib", None)  # the child's own peak_rss_mib is exact
      rows.append(row)
  from pallas_kernels import train_loss
  c_of_k = {k: train_loss.balanced_block_t(sizes["t"], train_loss.default_block_t(k, sizes["v"]))
            for k in (1, 3)}
  floor_rows = common.run_isolated("experiments.benchmarks.kl_train", [
      "--floor-worker", *(str(sizes[n]) for n in ("t", "d", "v", "iters")),
      str(c_of_k[1]), str(c_of_k[3])])["floor_rows"]
  floors = floor_table(floor_rows, sizes["t"], c_of_k)
  ratios = []
  for case, k, _ in CASES:
    base, new = (next(r for r in rows if r["path"] == p and r["case"] == case) for p in PATHS)
    # Spread: the ratio of the i-th timed call of each side, over i.
    per_call = [a / b for a, b in zip(new["cpu_calls_ms"], base["cpu_calls_ms"])]
    floor = next(f for f in floors if f["case"] == case)
    ratios.append({
        "case": case, "K": k,
        "time_ratio": new["ms"] / base["ms"],
        "cpu_time_ratio": new["cpu_ms"] / base["cpu_ms"],
        "cpu_time_ratio_min": min(per_call), "cpu_time_ratio_max": max(per_call),
        "floor_ratio": floor["floor_ratio"],
        "floor_ratio_chunked": floor["floor_ratio_chunked"],
        "train_over_floor": new["cpu_ms"] / floor["floor_train_chunked_ms"],
        "per_token_over_floor": base["cpu_ms"] / floor["floor_per_token_ms"],
        "peak_mem_ratio": new["peak_rss_mib"] / base["peak_rss_mib"],
        "transient_mem_ratio": new["transient_rss_mib"] / max(base["transient_rss_mib"], 1e-9),
        "xla_temp_ratio": (new["xla_temp_mib"] / base["xla_temp_mib"]
                           if new["xla_temp_mib"] and base["xla_temp_mib"] else None),
        "loss_rel_diff": abs(new["loss"] - base["loss"]) / abs(base["loss"]),
        "time_target": TARGETS[case],
    })
  for r in ratios:
    r["meets_time"] = r["time_ratio"] <= r["time_target"]
    r["meets_time_cpu"] = r["cpu_time_ratio"] <= r["time_target"]
    r["meets_memory"] = r["peak_mem_ratio"] <= 1.0
  shared, separate = (next(r for r in rows if r["path"] == "train" and r["case"] == c)
                      for c in ("K3_shared", "K3"))
  shared_vs_separate = shared["ms"] / separate["ms"]
  print(f"# fused reverse KL training loss, CPU, value_and_grad, T={sizes['t']} "
        f"Ds=Dt={sizes['d']} V={sizes['v']} float32")
  print(common.format_table(rows, ["path", "case", "ms", "min_ms", "cpu_ms", "peak_rss_mib",
                                   "transient_rss_mib", "xla_temp_mib", "loss"]))
  print()
  print(common.format_table(ratios))
  print("\n# floor: head matmuls and elementwise passes timed alone (CPU ms, median)")
  print(common.format_table(floor_rows, ["item", "rows", "K", "cpu_ms"]))
  print()
  print(common.format_table(floors))
  print(f"\nK=3 shared head / separate heads (train path): time {shared_vs_separate:.3f}")
  payload = {"sizes": {**sizes, "dtype": "float32"}, "rows": rows, "ratios": ratios,
             "floor_rows": floor_rows, "floors": floors, "chunk_rows": c_of_k,
             "shared_vs_separate_time": shared_vs_separate,
             "targets": {"time_ratio_max": TARGETS, "peak_mem_ratio_max": 1.0},
             "quick": args.quick}
  path = common.write_result("kl_train_quick" if args.quick else "kl_train", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
