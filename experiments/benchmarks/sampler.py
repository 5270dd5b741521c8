"""Decode throughput of ``opd.rollout.sampler.generate`` (KV cache) vs full recomputation.

Both sides are single jitted programs that decode greedily in lockstep:

* ``kv_cache``: ``opd.rollout.sampler.generate`` — one prefill, then one-token steps
  against a ``[B, P + N]`` KV cache.
* ``recompute``: the no-cache baseline — each step runs the decoder over the
  whole padded ``[B, P + N]`` buffer (causal mask, unwritten tail masked
  out) and applies the LM head only at the current position, in a
  ``lax.fori_loop`` inside one ``jit``.

Both return the same greedy tokens (checked, ``tokens_match``). The head is
scaled up so that greedy argmax has no near-ties between the two numerical
paths; speed does not depend on parameter values.

  python -m experiments.benchmarks.sampler            # B=8, P=32, N=256
  python -m experiments.benchmarks.sampler --quick    # seconds, for the smoke test
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import common
from opd.models import ModelConfig, forward, head_matrix, init_params
from opd.rollout.sampler import SamplingConfig, generate, left_align


@functools.partial(jax.jit, static_argnames=("cfg", "new_tokens"))
def recompute_greedy(params, prompt_tokens, prompt_mask, *, cfg: ModelConfig, new_tokens: int):
  """Greedy decoding without a cache: [B, P] prompts -> [B, N] tokens.

  Every step runs the full ``[B, P + N]`` buffer through the decoder; keys
  past the current position are masked out, so step t sees exactly the
  prompt and the t tokens generated so far.
  """
  B, P = prompt_tokens.shape
  tokens, mask = left_align(prompt_tokens, prompt_mask)
  seq = jnp.concatenate([tokens, jnp.zeros((B, new_tokens), jnp.int32)], axis=1)
  seq_mask = jnp.concatenate([mask, jnp.zeros((B, new_tokens), bool)], axis=1)
  head = head_matrix(cfg, params).astype(cfg.compute_dtype)

  def step(t, carry):
    seq, seq_mask = carry
    hidden = forward(cfg, params, seq, mask=seq_mask, return_logits=False,
                     return_hidden=True).hidden  # [B, P + N, D]
    # Left-aligned rows all have their last real token at column P + t - 1.
    current = jax.lax.dynamic_index_in_dim(hidden, P + t - 1, axis=1, keepdims=False)
    logits = jnp.einsum("BD,DV->BV", current, head, preferred_element_type=jnp.float32)
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    seq = jax.lax.dynamic_update_index_in_dim(seq, nxt, P + t, axis=1)
    seq_mask = jax.lax.dynamic_update_index_in_dim(seq_mask, jnp.ones((B,), bool), P + t, axis=1)
    return seq, seq_mask

  seq, _ = jax.lax.fori_loop(0, new_tokens, step, (seq, seq_mask))
  return seq[:, P:]


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--new_tokens", type=int, default=256)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--n_layers", type=int, default=2)
  p.add_argument("--vocab_size", type=int, default=512)
  p.add_argument("--iters", type=int, default=3)
  p.add_argument("--quick", action="store_true", help="tiny sizes, one timed iteration")
  p.add_argument("--out", default="benchmark_results")
  args = p.parse_args(argv)
  if args.quick:
    args.batch, args.prompt_len, args.new_tokens, args.iters = 4, 8, 16, 1
  return args


def main(argv=None) -> dict:
  args = _parse(argv)
  cfg = ModelConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                    n_heads=4, n_kv_heads=2, d_ff=3 * args.d_model)
  params = init_params(cfg, jax.random.key(0))
  params["lm_head"] = params["lm_head"] * 40.0  # peaked logits: no argmax near-ties
  B, P, N = args.batch, args.prompt_len, args.new_tokens
  rs = np.random.RandomState(0)
  prompt = jnp.asarray(rs.randint(0, cfg.vocab_size, (B, P)), jnp.int32)
  # Mixed prompt lengths (right padding) so padding handling is in the timed path.
  lengths = rs.randint(P // 2, P + 1, (B,))
  prompt_mask = jnp.asarray(np.arange(P)[None] < lengths[:, None])
  sampling = SamplingConfig(max_new_tokens=N, temperature=0.0)

  runs = {
      "kv_cache": lambda: generate(cfg, params, prompt, prompt_mask, 0, sampling).tokens,
      "recompute": lambda: recompute_greedy(params, prompt, prompt_mask, cfg=cfg, new_tokens=N),
  }
  rows, outputs = [], {}
  for name, fn in runs.items():
    t0 = time.perf_counter()
    outputs[name] = np.asarray(jax.block_until_ready(fn()))
    compile_s = time.perf_counter() - t0
    stats = common.time_fn(lambda: jax.block_until_ready(fn()), warmup=0, iters=args.iters)
    rows.append({"method": name, "median_s": stats["median_s"], "min_s": stats["min_s"],
                 "tokens_per_s": B * N / stats["median_s"], "first_call_s": compile_s})
  base = next(r for r in rows if r["method"] == "recompute")
  for r in rows:
    r["speedup"] = base["median_s"] / r["median_s"]
  tokens_match = float((outputs["kv_cache"] == outputs["recompute"]).mean())

  payload = {
      "sizes": {"batch": B, "prompt_len": P, "new_tokens": N, "cache_slots": P + N,
                "quick": args.quick, "iters": args.iters},
      "model": cfg.to_dict(),
      "rows": rows,
      "ratios": {"kv_cache_vs_recompute_speedup": base["median_s"] /
                 next(r for r in rows if r["method"] == "kv_cache")["median_s"]},
      "tokens_match": tokens_match,
  }
  print(f"sampler decode, B={B} P={P} N={N}, D={cfg.d_model} L={cfg.n_layers} "
        f"V={cfg.vocab_size}, {jax.devices()[0].device_kind}")
  print(common.format_table(rows, ["method", "median_s", "min_s", "tokens_per_s", "speedup",
                                   "first_call_s"]))
  print(f"greedy tokens equal between methods: {tokens_match:.2%}")
  path = common.write_result("sampler", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main()
