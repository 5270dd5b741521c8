"""One OPD student update in each loss form: the exact reverse KL vs the advantage form.

Every row is one full student update (student forward, loss, backward, AdamW,
through ``opd.training.train_step.make_train_step`` on a one-device mesh,
float32) on the model, teachers, batch and hidden-state cache of
``experiments.benchmarks.opd_step`` (``opd_step.setup``: ``TeacherPool`` →
``FaultTolerantTeachers`` → ``HiddenStateCache`` → ``cache.loss_batch``,
uniform weights), at its vocabulary sizes. Forms (docs/DESIGN.md §3):

* ``exact``: ``OPDConfig().loss_config()``, the full-vocabulary reverse KL
  through ``pallas_kernels.fused_reverse_kl_train``.
* ``advantage``: ``OPDConfig(loss_form="advantage", adv_gamma=1,
  adv_alpha=1, is_cap=2).loss_config()`` (``opd.distill.advantage``): the
  student's sampled-token log-prob (``fused_cross_entropy``), each teacher's
  from the cache (one head column per token plus its logsumexp pass, forward
  only), the discounted sum and the truncated-IS policy gradient.
* ``advantage_logits``: the same objective
  (``opd.distill.advantage.policy_gradient_loss``) with the teachers'
  log-probs read from a cache of their logits (K float32 ``[B, T, V]``
  arrays computed once from the same hidden states, ``log_softmax`` and a
  gather): what reading the hidden-state cache saves in the advantage form.

The advantage rows' batch adds the sampler's ``old_logprobs`` (the student's
own: on-policy) and outcome advantages ``[B]`` (a fixed draw).

Reported per row: compile time, median step time over ``iters`` after one
warm-up step, tokens/s (B·T per step), XLA's compiled peak (``argument +
output − alias + temp`` plus the teacher heads the program embeds as
constants) and the first step's loss and gradient norm (same initial state
and batch in every row). Ratios per (V, K), measured in this run:
``advantage`` against ``exact`` and against ``advantage_logits``.

    python -m experiments.benchmarks.opd_forms            # V=32768,131072, K=1
    python -m experiments.benchmarks.opd_forms --quick    # smoke sizes
"""
from __future__ import annotations

import argparse
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from experiments.benchmarks import common
from experiments.benchmarks import opd_step
from opd.distill import advantage as advantage_lib
from opd.distill.loss import make_opd_loss, token_coefficients
from opd.distill.source import OPDConfig
from opd.models import ModelConfig, forward, head_matrix
from opd.parallel import sharding
from opd.training.train_step import OptimConfig, init_train_state, make_optimizer, make_train_step
from pallas_kernels.inputs import normalized_weights

FORMS = ("exact", "advantage", "advantage_logits")
ADVANTAGE = dict(loss_form="advantage", adv_gamma=1.0, adv_alpha=1.0, is_cap=2.0)


def logits_loss(cfg: ModelConfig, loss_config):
  """``loss_fn`` of ``advantage_logits``: teacher log-probs from cached logits.

  Batch: the advantage form's, with ``teacher_logits`` (K arrays [B, T, V]
  float32) in place of ``teacher_hidden``.
  """
  tau = float(loss_config.grpo_temperature)

  def loss_fn(params, batch, rng):
    del rng
    b, t = batch["tokens"].shape
    h_s = forward(cfg, params, batch["tokens"], batch.get("positions"), batch["mask"],
                  return_logits=False, return_hidden=True).hidden.reshape(b * t, -1)
    w = batch["teacher_weights"].astype(jnp.float32)
    keep = (batch["loss_mask"] > 0) & batch["mask"].astype(bool) & (jnp.sum(w, axis=-1) > 0)
    targets = batch["targets"].reshape(b * t)
    logp = -pallas_kernels.fused_cross_entropy(h_s, head_matrix(cfg, params), targets,
                                               mask=keep.reshape(-1), temperature=tau)
    w_hat = normalized_weights(w.reshape(b * t, -1), keep.reshape(-1))
    lq = sum(w_hat[:, k] * jnp.take_along_axis(
        jax.nn.log_softmax(x.reshape(b * t, -1) / tau, axis=-1), targets[:, None], -1)[:, 0]
        for k, x in enumerate(batch["teacher_logits"]))
    coef = token_coefficients(keep, loss_config.aggregation)
    loss, metrics = advantage_lib.policy_gradient_loss(loss_config, logp.reshape(b, t),
                                                       lq.reshape(b, t), batch, keep, coef)
    return loss, {**metrics, "opd_tokens": jnp.sum(keep.astype(jnp.float32))}

  return loss_fn


def _advantage_batch(su: dict, loss_config) -> dict:
  """The shared batch plus on-policy ``old_logprobs`` and fixed outcome advantages."""
  cfg, host = su["cfg"], su["host"]
  b, t = host["tokens"].shape
  h = forward(cfg, su["student"], jnp.asarray(host["tokens"]), None, jnp.asarray(host["mask"]),
              return_logits=False, return_hidden=True).hidden.reshape(b * t, -1)
  old = -pallas_kernels.fused_cross_entropy(h, head_matrix(cfg, su["student"]),
                                            jnp.asarray(host["targets"]).reshape(-1),
                                            temperature=loss_config.grpo_temperature)
  rng = np.random.default_rng(0)
  return {**su["batch"], "old_logprobs": np.asarray(old).reshape(b, t),
          "advantages": rng.standard_normal(b).astype(np.float32)}


def worker(form: str, su: dict, iters: int) -> dict:
  """Compiles and times one form's step on :func:`opd_step.setup`'s ``su``."""
  if form not in FORMS:
    raise ValueError(f"form={form!r}: expected one of {FORMS}")
  cfg, mesh, pool, batch = su["cfg"], su["mesh"], su["pool"], su["batch"]
  heads = pool.heads
  head_bytes = sum(int(w.size) * w.dtype.itemsize for w in heads)
  if form == "exact":
    loss_fn = make_opd_loss(cfg, heads, OPDConfig().loss_config(), teacher_names=pool.names)
    constant_bytes = head_bytes
  else:
    loss_config = OPDConfig(**ADVANTAGE).loss_config()
    batch = _advantage_batch(su, loss_config)
    if form == "advantage":
      loss_fn = make_opd_loss(cfg, heads, loss_config, teacher_names=pool.names)
      constant_bytes = head_bytes
    else:
      logits_of = jax.jit(lambda h, w: jnp.einsum("BTD,DV->BTV", h.astype(jnp.float32), w))
      batch = {**{k: v for k, v in batch.items() if k != "teacher_hidden"},
               "teacher_logits": tuple(logits_of(h, w) for h, w in zip(su["cached"].hidden,
                                                                        heads))}
      loss_fn = logits_loss(cfg, loss_config)
      constant_bytes = 0
  optimizer = make_optimizer(OptimConfig(lr=1e-4, weight_decay=0.1))
  state, shardings = init_train_state(cfg, optimizer, mesh, rng=0, params=su["student"])
  rep = sharding.replicated(mesh)
  batch = jax.device_put(batch, rep)
  step = make_train_step(loss_fn, optimizer, mesh, shardings, rep)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
    compiled = step.jitted_for(batch).lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  m = compiled.memory_analysis()
  xla = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
         "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
         "constant": constant_bytes}
  peak = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"] + constant_bytes
  box = {"state": state}

  def one_step():
    box["state"], metrics = compiled(box["state"], batch)
    return jax.block_until_ready(metrics)

  first = one_step()  # warm-up; its loss and gradient norm are recorded
  timing = common.time_fn(one_step, warmup=0, iters=iters)
  b, t = batch["tokens"].shape
  row = {"form": form, "V": cfg.vocab_size, "K": len(heads), "compile_s": compile_s,
         "step_median_s": timing["median_s"], "step_min_s": timing["min_s"],
         "iters": timing["iters"], "tokens_per_s": b * t / timing["median_s"],
         "xla_bytes": xla, "xla_peak_bytes": peak, "xla_peak_gib": peak / 2 ** 30,
         "loss": float(first["loss"]), "grad_norm": float(first["grad_norm"]),
         "opd_tokens": float(first["opd_tokens"])}
  if form != "exact":
    row["adv_abs_mean"] = float(first["adv/abs_mean"])
    row["logit_absmax_bound"] = _logit_bound(su)
  return row


def _logit_bound(su: dict) -> float:
  """max over tokens of ‖h‖·max_v ‖W_v‖, student and teachers: bounds every
  |logit| (the test's tolerance is derived from it)."""
  cfg, host = su["cfg"], su["host"]
  h = forward(cfg, su["student"], jnp.asarray(host["tokens"]), None, jnp.asarray(host["mask"]),
              return_logits=False, return_hidden=True).hidden
  pairs = [(h, head_matrix(cfg, su["student"]))] + list(zip(su["cached"].hidden, su["pool"].heads))
  return max(float(jnp.max(jnp.linalg.norm(x.astype(jnp.float32), axis=-1))
                   * jnp.max(jnp.linalg.norm(w, axis=0))) for x, w in pairs)


def _ratios(rows: list[dict]) -> list[dict]:
  """Per (V, K): ``advantage`` time and peak memory over each other form's."""
  out = []
  for v, k in sorted({(r["V"], r["K"]) for r in rows}):
    by = {r["form"]: r for r in rows if (r["V"], r["K"]) == (v, k)}
    ours = by["advantage"]
    entry = {"V": v, "K": k}
    for other in ("exact", "advantage_logits"):
      entry[f"advantage_vs_{other}"] = {
          "time_ratio": ours["step_median_s"] / by[other]["step_median_s"],
          "peak_mem_ratio": ours["xla_peak_bytes"] / by[other]["xla_peak_bytes"]}
    out.append(entry)
  return out


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="smoke sizes")
  p.add_argument("--vocab", type=int, nargs="+", help="override the V list")
  p.add_argument("--teachers", type=int, nargs="+", default=[1], help="the K list")
  p.add_argument("--cache_dtype", default=OPDConfig.cache_dtype,
                 help="hidden-state cache dtype (OPDConfig.cache_dtype)")
  p.add_argument("--out", default="benchmark_results")
  return opd_step.sized_args(p.parse_args(argv))


def main(argv=None) -> dict:
  args = _parse(argv)
  sizes = args.sizes
  rows = []
  for v in sizes["vocab"]:
    for k in args.teachers:
      su = opd_step.setup(sizes, v, k, args.cache_dtype)
      for form in FORMS:
        rows.append(worker(form, su, sizes["iters"]))
        print(f"  {form} V={v} K={k}: {rows[-1]['step_median_s']:.3f} s/step", flush=True)
  ratios = _ratios(rows)
  b, t = sizes["batch"], sizes["seq"]
  payload = {"sizes": {**sizes, "K": list(args.teachers), "tokens_per_step": b * t,
                       "cache_dtype": args.cache_dtype, "dtype": "float32",
                       "advantage_config": ADVANTAGE,
                       "optimizer": "make_optimizer(OptimConfig(lr=1e-4, weight_decay=0.1))"},
             "quick": args.quick, "rows": rows, "ratios": ratios,
             "memory": ("xla_peak_bytes = argument + output - alias + temp (+ the teacher "
                        "heads the program embeds as constants) of the compiled step"),
             "teacher_logprob": ("advantage: one head column per token plus the teacher's "
                                 "logsumexp over V (fused_cross_entropy, forward only); "
                                 "advantage_logits: log_softmax of cached [B, T, V] logits")}
  print(f"# OPD step by loss form, CPU, B={b} T={t} D={sizes['d_model']} "
        f"L={sizes['n_layers']} float32, cache {args.cache_dtype}")
  print(common.format_table(rows, ["form", "V", "K", "compile_s", "step_median_s",
                                   "tokens_per_s", "xla_peak_gib", "loss", "grad_norm"]))
  print()
  print(common.format_table([{"V": r["V"], "K": r["K"], **{
      f"advantage/{o}: {m}": r[f"advantage_vs_{o}"][m] for o in ("exact", "advantage_logits")
      for m in ("time_ratio", "peak_mem_ratio")}} for r in ratios]))
  path = common.write_result("opd_forms_quick" if args.quick else "opd_forms", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
