"""Mixture-of-experts layer: forward + backward tokens/s against its baselines.

Rows (all fp32, one jitted ``value_and_grad`` of ``sum(y · c)`` over the
layer's params and input, c a fixed random cotangent):

* ``dense``: the SwiGLU MLP with the MoE's *active* width, ``d_ff = (k + S)
  · Fe`` (equal active parameters, router aside).
* ``moe_ragged``: ``opd.models.moe.MoEMLP``, dropless grouped matmul
  (``jax.lax.ragged_dot`` over tokens sorted by expert).
* ``moe_onehot``: the same block through the dense one-hot reference (every
  expert on every token, E / k times the expert FLOPs).
* ``replicated`` / ``expert_parallel``: the ragged block on all local
  devices, tokens split over them; experts replicated on a ``data`` mesh, or
  sharded over the ``expert`` axis (tokens all-gathered over the expert
  group, partial sums reduce-scattered back).

Ratios (same run): ``moe_ragged_vs_dense``, ``ragged_vs_onehot`` and
``expert_parallel_vs_replicated`` (tokens/s over tokens/s). On CPU, fake
devices share the host's cores: run with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for the two sharded
rows (with one device they coincide).

  python -m experiments.benchmarks.moe            # D=512, E=16, k=2, Fe=256, 4096 tokens
  python -m experiments.benchmarks.moe --quick    # seconds, for the smoke test
"""
from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import common
from opd.models import ModelConfig, MoEConfig
from opd.models.decoder import MLP
from opd.models.moe import MoEMLP
from opd.parallel import sharding


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--d_model", type=int, default=512)
  p.add_argument("--experts", type=int, default=16)
  p.add_argument("--top_k", type=int, default=2)
  p.add_argument("--moe_d_ff", type=int, default=256)
  p.add_argument("--shared", type=int, default=0)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=512)
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="tiny sizes, two timed iterations")
  p.add_argument("--out", default="benchmark_results")
  args = p.parse_args(argv)
  if args.quick:
    args.d_model, args.experts, args.moe_d_ff, args.batch, args.seq, args.iters = (
        32, 8, 16, 8, 16, 2)
  return args


def _step(module, x, cot):
  """Jitted fwd + bwd of ``module`` and its params (boxed, for their logical axes)."""
  boxed = module.init(jax.random.key(0), x)["params"]
  params = nn.meta.unbox(boxed)

  def loss(p, x):
    y = module.apply({"params": p}, x)
    y = y[0] if isinstance(y, tuple) else y
    return jnp.sum(y * cot)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, nn.get_partition_spec(boxed)


def _time(fn, *args, iters):
  run = lambda: jax.block_until_ready(fn(*args))
  return common.time_fn(run, warmup=1, iters=iters)["median_s"]


def main(argv=None) -> dict:
  args = _parse(argv)
  D, E, k, Fe, S = args.d_model, args.experts, args.top_k, args.moe_d_ff, args.shared
  B, T = args.batch, args.seq
  moe = MoEConfig(n_routed_experts=E, experts_per_token=k, moe_d_ff=Fe, n_shared_experts=S)
  cfg = ModelConfig(d_model=D, n_heads=1, n_kv_heads=1, d_ff=(k + S) * Fe, n_layers=1, moe=moe)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  rows = []

  def add(name, fn, params, x, note, mesh=None, rules=sharding.DEFAULT_RULES):
    if mesh is None:
      s = _time(fn, params, x, iters=args.iters)
    else:
      with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        s = _time(fn, params, x, iters=args.iters)
    rows.append({"layer": name, "seconds": s, "tokens_per_s": B * T / s, "note": note})

  dense_fn, dense_p, _ = _step(MLP(cfg), x, cot)
  add("dense", dense_fn, dense_p, x, f"d_ff=(k+S)*Fe={(k + S) * Fe}")
  ragged_fn, moe_p, specs = _step(MoEMLP(cfg), x, cot)
  add("moe_ragged", ragged_fn, moe_p, x, f"E={E} k={k} Fe={Fe} S={S}")
  onehot = cfg.replace(moe=MoEConfig(**{**moe.__dict__, "dispatch": "onehot"}))
  onehot_fn, _, _ = _step(MoEMLP(onehot), x, cot)
  add("moe_onehot", onehot_fn, moe_p, x, "every expert on every token")

  n = jax.device_count()
  while E % n or B % n:  # the largest device count that splits experts and rows
    n -= 1
  devices = jax.devices()[:n]
  rules = tuple((a, ("data", "expert") if a == "batch" else t) for a, t in sharding.DEFAULT_RULES)
  for name, shape in (("replicated", (n, 1, 1, 1)), ("expert_parallel", (1, 1, n, 1))):
    mesh = sharding.make_mesh(shape, devices)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      fn, _, _ = _step(MoEMLP(cfg), x, cot)
    placed = jax.device_put(moe_p, sharding.tree_shardings(specs, moe_p, mesh, rules))
    xs = jax.device_put(x, sharding.batch_sharding(mesh, rules, 3))
    add(name, fn, placed, xs, f"{n} devices, mesh {dict(mesh.shape)}", mesh, rules)

  tps = {r["layer"]: r["tokens_per_s"] for r in rows}
  payload = {
      "sizes": {"d_model": D, "experts": E, "top_k": k, "moe_d_ff": Fe, "shared": S,
                "batch": B, "seq": T, "tokens": B * T, "iters": args.iters, "quick": args.quick,
                "devices": n},
      "params": {"dense": sum(a.size for a in jax.tree.leaves(dense_p)),
                 "moe_total": sum(a.size for a in jax.tree.leaves(moe_p)),
                 "moe_active": 3 * D * (k + S) * Fe + D * E},
      "timing": "median over iters of one jitted value_and_grad (after one warm-up call)",
      "rows": rows,
      "ratios": {"moe_ragged_vs_dense": tps["moe_ragged"] / tps["dense"],
                 "ragged_vs_onehot": tps["moe_ragged"] / tps["moe_onehot"],
                 "expert_parallel_vs_replicated": tps["expert_parallel"] / tps["replicated"]},
  }
  print(f"MoE layer fwd+bwd on {jax.devices()[0].device_kind} ({B * T} tokens, D={D})")
  print(common.format_table(rows, ["layer", "seconds", "tokens_per_s", "note"]))
  print("ratios: " + ", ".join(f"{k}={v:.3f}" for k, v in payload["ratios"].items()))
  path = common.write_result("moe", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main()
