"""Achieved FLOP/s of the sharded train step vs this machine's matmul FLOP/s.

Rows:

* ``matmul``: the baseline, a large square fp32 ``jnp.dot`` (N x N x N,
  2 N^3 FLOPs). A sweep over a few N picks the fastest size (XLA:CPU is
  markedly slower at some sizes than at others).
* ``train_step``: ``opd.training.train_step.make_train_step`` with the next-token loss
  and AdamW on a one-device mesh, fp32 compute. FLOPs are counted
  explicitly, backward = 2x forward, the optimizer's elementwise work not
  counted. The headline count (``flops``) counts only the *unmasked* causal
  half of attention: query t scores and mixes t + 1 keys, (T + 1) / 2 on
  average, plus every weight matmul and the LM head. The decoder computes
  the full T x T scores and masks them, so the executed count
  (``flops_dense_attention``, ``3 * ModelConfig.flops_per_token(T) * B * T``)
  is larger; XLA's own cost analysis of the compiled step (``xla_flops``; it
  also counts elementwise ops) is compared with that executed count.

The ratio ``train_step / matmul`` is the model FLOP utilisation relative to
what a plain matmul achieves on the same machine in the same run. On the
shared 2-core reference machine single timings vary by up to 2x with other
users' load, so each train step is paired with matmuls timed right after it
and the reported ratio is the median of the paired ratios.

  python -m experiments.benchmarks.train_step            # D=512, 4 layers, V=4096, 8x256 tokens
  python -m experiments.benchmarks.train_step --quick    # seconds, for the smoke test
"""
from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import common
from opd.parallel import sharding
from opd.models import ModelConfig
from opd.training.train_step import (OptimConfig, abstract_train_state, init_train_state, make_optimizer,
                            make_train_step)
from opd.training.objectives import next_token_loss


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--d_model", type=int, default=512)
  p.add_argument("--n_layers", type=int, default=4)
  p.add_argument("--n_heads", type=int, default=8)
  p.add_argument("--d_ff", type=int, default=1536)
  p.add_argument("--vocab_size", type=int, default=4096)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--matmul_n", type=int, nargs="+", default=[1024, 2048, 4096])
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="tiny sizes, one timed iteration")
  p.add_argument("--out", default="benchmark_results")
  args = p.parse_args(argv)
  if args.quick:
    args.d_model, args.n_layers, args.n_heads, args.d_ff = 64, 1, 4, 192
    args.vocab_size, args.batch, args.seq, args.matmul_n, args.iters = 256, 4, 64, [512], 1
  return args


def _xla_flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
  except Exception:  # cost analysis is best-effort and backend-dependent
    return None


def main(argv=None) -> dict:
  args = _parse(argv)
  device = jax.devices()[0]
  mesh = sharding.make_mesh((1, 1, 1), [device])

  matmul = jax.jit(jnp.dot)
  operands = {n: (jax.random.normal(jax.random.key(1), (n, n), jnp.float32),
                  jax.random.normal(jax.random.key(2), (n, n), jnp.float32))
              for n in args.matmul_n}

  def time_matmul(n, reps=3):
    a, b = operands[n]
    return common.time_fn(lambda: matmul(a, b).block_until_ready(), warmup=1, iters=reps)["min_s"]

  # Pick the fastest size once; it is re-timed next to every train step.
  sweep = {n: time_matmul(n) for n in args.matmul_n}
  n = max(sweep, key=lambda k: 2.0 * k ** 3 / sweep[k])
  mm_flops = 2.0 * n ** 3

  cfg = ModelConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                    n_heads=args.n_heads, n_kv_heads=args.n_heads, d_ff=args.d_ff)
  optimizer = make_optimizer(OptimConfig(lr=1e-4, weight_decay=0.1))
  # Host-side init: the random init's compile is slow on CPU and not what is measured.
  abstract, _ = abstract_train_state(cfg, optimizer, mesh)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: np.ones(a.shape, np.float32) if a.ndim == 1 else
                        (0.02 * rng.standard_normal(a.shape)).astype(np.float32), abstract.params)
  state, shardings = init_train_state(cfg, optimizer, mesh, rng=0, params=params)
  step = make_train_step(next_token_loss(cfg), optimizer, mesh, shardings)
  B, T = args.batch, args.seq
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
  batch = {"tokens": jax.device_put(tokens, sharding.batch_sharding(mesh, ndim=2))}

  t0 = time.perf_counter()
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
    compiled = step.jitted_for(batch).lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  box = {"state": state}

  def one_step():  # the compiled executable of `step` itself
    box["state"], metrics = compiled(box["state"], batch)
    jax.block_until_ready(metrics)

  one_step()  # warm-up
  # Interleave: each train step is paired with matmuls timed right after it,
  # so both sides of a ratio see the same machine load.
  step_s, mm_s, ratios = [], [], []
  # Attention is the part of flops_per_token linear in the key count; the
  # causal mask leaves (T + 1) / 2 keys per query on average.
  dense_flops = 3.0 * cfg.flops_per_token(T) * B * T
  attn_dense = 3.0 * (cfg.flops_per_token(T) - cfg.flops_per_token(0)) * B * T
  step_flops = dense_flops - attn_dense * (T - 1) / (2 * T)
  for _ in range(args.iters):
    t0 = time.perf_counter()
    one_step()
    step_s.append(time.perf_counter() - t0)
    mm_s.append(time_matmul(n))
    ratios.append((step_flops / step_s[-1]) / (mm_flops / mm_s[-1]))
  ratio = float(np.median(ratios))
  step_med, mm_best = float(np.median(step_s)), float(min(mm_s))
  xla = _xla_flops(compiled)

  rows = [
      *[{"op": "matmul (sweep)", "size": f"{k}x{k}x{k} fp32", "seconds": t, "flops": 2.0 * k ** 3,
         "gflop_per_s": 2.0 * k ** 3 / t / 1e9} for k, t in sorted(sweep.items())],
      {"op": "matmul (paired)", "size": f"{n}x{n}x{n} fp32", "seconds": mm_best,
       "flops": mm_flops, "gflop_per_s": mm_flops / mm_best / 1e9},
      {"op": "train_step", "size": f"B={B} T={T} D={cfg.d_model} L={cfg.n_layers} "
                                   f"V={cfg.vocab_size} fp32",
       "seconds": step_med, "flops": step_flops, "gflop_per_s": step_flops / step_med / 1e9,
       "ratio": ratio},
  ]
  payload = {
      "sizes": {"batch": B, "seq": T, "tokens": B * T, "matmul_n": list(args.matmul_n),
                "iters": args.iters,
                "quick": args.quick, "params": cfg.num_params(), "mesh": [1, 1, 1]},
      "model": cfg.to_dict(),
      "flop_count": ("explicit, causal: 3 * B * T * (weight matmuls + LM head + attention "
                     "over (T + 1) / 2 keys per query); the masked half of attention is NOT "
                     "counted"),
      "flops_dense_attention": dense_flops,
      "flops_dense_formula": "3 * ModelConfig.flops_per_token(T) * B * T (full T x T attention, "
                             "as executed)",
      "xla_flops": xla,
      "xla_vs_dense": xla / dense_flops if xla else None,
      "compile_s": compile_s,
      "rows": rows,
      "timing": ("one warm-up step; then per iteration one train step followed by the best "
                 "of 3 matmuls; ratio = median over iterations of the paired FLOP/s ratios"),
      "paired": {"step_s": step_s, "matmul_s": mm_s, "ratios": ratios},
      "ratios": {"train_step_vs_matmul_flops": ratio,
                 "best_step_vs_best_matmul": (step_flops / min(step_s)) / (mm_flops / mm_best)},
  }
  print(f"train step FLOP/s vs matmul FLOP/s on {device.device_kind} "
        f"({cfg.num_params() / 1e6:.1f}M params, {B * T} tokens/step)")
  print(common.format_table(rows, ["op", "size", "seconds", "flops", "gflop_per_s", "ratio"]))
  print(f"train-step FLOP/s / matmul FLOP/s (N={n}), median of {args.iters} paired timings: "
        f"{ratio:.3f} (per pair: {', '.join(f'{r:.3f}' for r in ratios)})")
  print(f"FLOPs count only the unmasked causal half of attention ({step_flops:.4g} per step); "
        f"the decoder executes full T x T attention: {dense_flops:.4g} "
        f"({dense_flops / step_flops:.3f}x)")
  if xla:
    print(f"XLA cost analysis: {xla:.4g} FLOPs per step "
          f"({xla / dense_flops:.2f}x the executed count, {xla / step_flops:.2f}x the causal one)")
  path = common.write_result("train_step", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main()
