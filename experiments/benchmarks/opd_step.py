"""One OPD student update vs a materialised-logits step, a recompute-teachers step and tunix.

Every row is one full student update on the same model, batch and
vocabulary (docs/DESIGN.md §3–4): student forward, a reverse-KL loss against
K teachers, backward and AdamW, through ``opd.training.train_step.make_train_step``
on a one-device mesh, float32. The model list (``--archs``, :data:`ARCHS`):
``dense`` (Llama-style GQA + SwiGLU) and ``v4`` (the DeepSeek-V4 architecture,
``ModelConfig.v4``, of the same D, layers and heads: CSA / HCA / sliding layers
in turn, a hash-routed first MoE layer, 8 experts of width F/3 so that the
k = 2 routed plus the shared expert match the dense MLP's width; see
:func:`model_config`); student and teachers share the architecture. Methods:

* ``opd``: what ``opd.distill.trainer.train_opd`` runs. The teachers' last
  hidden states come from ``TeacherPool`` → ``FaultTolerantTeachers`` →
  ``HiddenStateCache`` (stored in ``OPDConfig.cache_dtype``, bf16 by default)
  → ``cache.loss_batch``; the loss is ``make_opd_loss`` with
  ``OPDConfig().loss`` and the pool's heads, as the trainer builds
  it (the fused kernel rebuilds logits tile by tile; the JSON records which
  ``pallas_kernels`` entry ran). The closure holds the teacher heads, so XLA
  embeds them in the program as constants, which ``memory_analysis()`` does
  not count: they are added to this row's peak as ``constant`` bytes.
* ``materialised`` (a): the same step on materialised logits: student
  logits ``[B, T, V]`` from the model's head, teacher logits read from a
  cache of logits (K float32 arrays ``[B, T, V]``, computed once from the
  same cached hidden states: what a run without the hidden-state cache
  must store), loss via plain ``log_softmax``.
* ``recompute`` (b): the same loss with the teachers' full forward passes
  run inside every step (teachers of the student's size, their params passed
  to the step); hidden states are cast to the cache dtype so all three rows
  see the same teacher states, and the loss is ``make_opd_loss`` on them.
* ``tunix_rkl`` / ``tunix_logit`` (c, K = 1 only; tunix's trainer takes one
  teacher): ``experiments.benchmarks.tunix_opd_step`` in ``.venv-tunix``,
  run in this run when that venv exists (``make bench-tunix`` creates it),
  otherwise merged from its JSON, otherwise reported as not run.

Reported per row: the architecture, the student's forward FLOPs per token
(``ModelConfig.flops_per_token(T)``), compile time, median step time over ``iters`` after one
warm-up step, tokens/s (B·T per step), XLA's compiled memory
(``argument + output − alias + temp`` [+ embedded constants]: the donated
state is counted once) and the process's RSS rise during the steps (peak
``VmHWM`` reset after compilation, minus the RSS then), plus the loss and
gradient norm of the first step (same initial state and batch in every
row: the test checks they agree). Ratios per (V, K): time and peak-memory
ratios of ``opd`` against each baseline. Targets (issue 13): at V = 131072
peak memory ≤ 1/3 of (a), and faster than tunix at equal work (``tunix_rkl``
vs ``recompute`` at K = 1: both rerun the teacher every step).
A row whose compiled peak exceeds ``--max_gib`` (default 80% of
``MemAvailable``) is compiled but not run; its memory still comes from
``memory_analysis()``.

    python -m experiments.benchmarks.opd_step            # V=32768,131072, K=1,3 (~15 min)
    python -m experiments.benchmarks.opd_step --quick    # smoke sizes, in-process
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from experiments.benchmarks import common
from experiments.benchmarks import tunix_opd_step as tunix_bench
from opd.distill.cache import HiddenStateCache, loss_batch
from opd.distill.faults import FaultTolerantTeachers
from opd.distill import loss as opd_loss_module
from opd.distill.loss import make_opd_loss
from opd.distill.source import OPDConfig
from opd.distill.teachers import Teacher, TeacherPool
from opd.models import ModelConfig, forward, head_matrix
from opd.models.moe import MoEConfig
from opd.models.v4.config import V4Config
from opd.models.v4.moe import default_tid2eid
from opd.parallel import sharding
from opd.training.train_step import (OptimConfig, abstract_train_state, init_train_state,
                                     make_optimizer, make_train_step)
from pallas_kernels.api import resolve_impl
from pallas_kernels.inputs import normalized_weights

METHODS = ("opd", "materialised", "recompute")
ARCHS = ("dense", "v4")
TUNIX_METHODS = ("tunix_rkl", "tunix_logit")
REPO = pathlib.Path(__file__).resolve().parents[2]
TUNIX_PYTHON = REPO / ".venv-tunix" / "bin" / "python"
TEACHER_NOISE = 0.5  # teacher k = student + TEACHER_NOISE x a fresh random init


def model_config(sizes: dict, vocab: int, arch: str = "dense") -> ModelConfig:
  """The student's (and every teacher's) config of architecture ``arch`` (:data:`ARCHS`).

  ``v4``: head_dim D/H with RoPE on a quarter of it, one key/value head, layers
  cycling CSA (m = 4, top ``T/16`` entries) / HCA (m = 16) / sliding (window
  ``T/4``), the first MoE layer hash-routed, 8 sqrtsoftplus experts of width F/3
  (k = 2 plus the shared one), query and output ranks D/2, 4 mHC streams.
  """
  if arch not in ARCHS:
    raise ValueError(f"arch={arch!r}: expected one of {ARCHS}")
  D, L, H, F, T = (sizes[n] for n in ("d_model", "n_layers", "n_heads", "d_ff", "seq"))
  if arch == "dense":
    return ModelConfig(vocab_size=vocab, d_model=D, n_layers=L, n_heads=H, n_kv_heads=H,
                       d_ff=F)
  cycle = ("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")
  Dh = D // H
  v4 = V4Config(layer_types=tuple(cycle[i % 3] for i in range(L)),
                mlp_layer_types=("hash_moe",) + ("moe",) * (L - 1), q_lora_rank=D // 2,
                rope_dim=Dh // 4, sliding_window=T // 4, o_groups=2, o_lora_rank=D // 2,
                csa_compress_rate=4, hca_compress_rate=16, index_n_heads=2, index_head_dim=Dh,
                index_topk=max(T // 16, 1), n_streams=4)
  moe = MoEConfig(n_routed_experts=8, experts_per_token=2, moe_d_ff=F // 3, n_shared_experts=1,
                  router="sqrtsoftplus")
  return ModelConfig(vocab_size=vocab, d_model=D, n_layers=L, n_heads=H, n_kv_heads=1,
                     head_dim=Dh, d_ff=F // 3, moe=moe, v4=v4)


def host_params(cfg: ModelConfig, seed: int, base: dict | None = None,
                noise: float = TEACHER_NOISE) -> dict:
  """Random float32 params on the host (a jitted random init is slow to compile on CPU).

  Matrices ~ N(0, std²), std = 1/sqrt(fan_in) with fan_in the product of
  all but the last axis; the head has twice that std, so logits have std
  ~2 and the KL is far from 0. Embedding std 1, 1-D params (norm scales) 1,
  a V4 hash table its init's (``default_tid2eid``).
  With ``base``, the result is ``base`` plus ``noise`` times such a draw
  (1-D params copied): a teacher close to the student, so the KL depends
  on which teacher token is paired with which student token.
  """
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  abstract, _ = abstract_train_state(cfg, make_optimizer(OptimConfig()), mesh)
  rng = np.random.default_rng(seed)

  def init(path, a):
    name = jax.tree_util.keystr(path)
    if "tid2eid" in name:  # a V4 hash table: the init's balanced expert ids
      return np.asarray(default_tid2eid(cfg.vocab_size, cfg.moe), np.float32).reshape(a.shape)
    if a.ndim == 1:
      return np.ones(a.shape, np.float32)
    std = 1.0 if "embedding" in name else (2.0 if "lm_head" in name else 1.0) / np.sqrt(
        np.prod(a.shape[:-1]))
    return (std * rng.standard_normal(a.shape, dtype=np.float32)).astype(np.float32)

  fresh = jax.tree_util.tree_map_with_path(init, abstract.params)
  if base is None:
    return fresh
  return jax.tree.map(lambda b, f: b if b.ndim == 1 else (b + noise * f).astype(np.float32),
                      base, fresh)


def materialised_loss(cfg: ModelConfig, temperature: float):
  """``loss_fn`` of (a): the token-mean reverse KL on materialised logits.

  Batch: ``tokens, targets, mask, loss_mask`` [B, T], ``teacher_logits`` K
  arrays [B, T, V] float32, ``teacher_weights`` [B, T, K].
  """
  def loss_fn(params, batch, rng):
    del rng
    b, t = batch["tokens"].shape
    z = forward(cfg, params, batch["tokens"], batch.get("positions"), batch["mask"]).logits
    lp = jax.nn.log_softmax(z.astype(jnp.float32) / temperature, axis=-1)  # [B, T, V]
    p = jnp.exp(lp)
    w = batch["teacher_weights"].astype(jnp.float32)
    keep = (batch["loss_mask"] > 0) & batch["mask"].astype(bool) & (jnp.sum(w, axis=-1) > 0)
    w_hat = normalized_weights(w.reshape(b * t, -1), keep.reshape(-1)).reshape(w.shape)
    per_tok = jnp.zeros((b, t), jnp.float32)
    for k, x in enumerate(batch["teacher_logits"]):
      lq = jax.nn.log_softmax(x.astype(jnp.float32) / temperature, axis=-1)
      kl = jnp.sum(p * (lp - lq), axis=-1)  # KL(p_s ‖ q_k), [B, T]
      per_tok = per_tok + jnp.where(w_hat[..., k] != 0, w_hat[..., k] * kl, 0.0)
    n = jnp.sum(keep.astype(jnp.float32))
    return jnp.sum(per_tok * keep) / jnp.maximum(n, 1.0), {"opd_tokens": n}

  return loss_fn


def recompute_loss(cfg: ModelConfig, teacher_cfgs, loss_config, cache_dtype):
  """``loss_fn`` of (b): each teacher's forward inside the step, then ``make_opd_loss``.

  Batch: the OPD loss batch with ``teacher_params`` (K param trees) in place
  of ``teacher_hidden``.
  """
  def loss_fn(params, batch, rng):
    tparams = jax.lax.stop_gradient(batch["teacher_params"])
    inner = {k: v for k, v in batch.items() if k != "teacher_params"}
    # Same dtype path as TeacherPool (float32) then HiddenStateCache (cache dtype).
    inner["teacher_hidden"] = tuple(
        forward(c, p, batch["tokens"], batch.get("positions"), batch["mask"],
                return_logits=False, return_hidden=True).hidden.astype(jnp.float32)
        .astype(cache_dtype) for c, p in zip(teacher_cfgs, tparams))
    heads = [head_matrix(c, p) for c, p in zip(teacher_cfgs, tparams)]
    return make_opd_loss(cfg, heads, loss_config)(params, inner, rng)

  return loss_fn


def kernel_entries(loss_fn, params, batch, mesh) -> list[str]:
  """The ``pallas_kernels.fused_*`` entries ``loss_fn`` calls (traced once).

  Spies on the names in ``pallas_kernels`` and in ``opd.distill.loss``
  (whether the loss calls ``pallas_kernels.fused_x`` or imported the name).
  """
  modules = (pallas_kernels, opd_loss_module)
  originals = {(m, n): getattr(m, n) for m in modules for n in dir(m)
               if n.startswith("fused_") and callable(getattr(m, n))}
  called = set()

  def spy(name, fn):
    def wrapped(*args, **kwargs):
      called.add(name)
      return fn(*args, **kwargs)
    return wrapped

  try:
    for (m, n), fn in originals.items():
      setattr(m, n, spy(n, fn))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
      jax.eval_shape(jax.value_and_grad(loss_fn, has_aux=True), params, batch,
                     jax.random.key(0))
  finally:
    for (m, n), fn in originals.items():
      setattr(m, n, fn)
  return sorted(called)


def _mem_available_bytes() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  raise ValueError("MemAvailable is not in /proc/meminfo")


def _scales(cfg, params, batch_hidden, heads, teacher_logits, host) -> dict:
  """Magnitudes the test's tolerance is derived from (computed after timing)."""
  h = forward(cfg, params, jnp.asarray(host["tokens"]), None, jnp.asarray(host["mask"]),
              return_logits=False, return_hidden=True).hidden.reshape(-1, cfg.d_model)
  w_s = head_matrix(cfg, params)
  norm_bound = lambda h, w: float(jnp.max(jnp.linalg.norm(h.astype(jnp.float32), axis=-1))
                                  * jnp.max(jnp.linalg.norm(w, axis=0)))
  return {"student_logit_absmax": float(jnp.max(jnp.abs(h @ w_s))),
          "teacher_logit_absmax": max(float(jnp.max(jnp.abs(x))) for x in teacher_logits),
          "student_hw_bound": norm_bound(h, w_s),
          "teacher_hw_bound": max(norm_bound(hk.reshape(-1, hk.shape[-1]), w)
                                  for hk, w in zip(batch_hidden, heads))}


def setup(sizes: dict, vocab: int, k: int, cache_dtype: str, arch: str = "dense") -> dict:
  """Model, teachers, batch and cached teacher states shared by the methods of one (V, K).

  The cached states go through the trainer's path: ``TeacherPool`` →
  ``FaultTolerantTeachers`` → ``HiddenStateCache`` → ``cache.loss_batch``
  (uniform weights).
  """
  cfg = model_config(sizes, vocab, arch)
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  opd_cfg = OPDConfig(cache_dtype=cache_dtype)
  student = host_params(cfg, seed=0)
  teachers = [Teacher(f"t{i}", cfg, host_params(cfg, seed=1 + i, base=student))
              for i in range(k)]
  pool = TeacherPool(teachers, vocab, mesh)
  cache = HiddenStateCache(FaultTolerantTeachers.from_pool(pool, deadline_s=opd_cfg.deadline_s),
                           dtype=opd_cfg.cache_dtype)
  host = tunix_bench.host_batch(sizes["batch"], sizes["seq"], vocab)
  cached = cache.get(0, host["tokens"], host["mask"])
  b, t = host["tokens"].shape
  batch, _ = loss_batch(host, cached, np.ones((b, t, k), np.float32))
  return {"cfg": cfg, "mesh": mesh, "opd_cfg": opd_cfg, "teachers": teachers, "pool": pool,
          "host": host, "cached": cached, "batch": batch, "student": student}


def worker(method: str, sizes: dict, vocab: int, k: int, cache_dtype: str,
           max_bytes: int | None, shared: dict | None = None, arch: str = "dense") -> dict:
  """Compiles and times one method's step (``shared``: a :func:`setup` of ``arch`` to reuse)."""
  if method not in METHODS:
    raise ValueError(f"method={method!r}: expected one of {METHODS}")
  su = shared if shared is not None else setup(sizes, vocab, k, cache_dtype, arch)
  cfg, mesh, opd_cfg, teachers, pool = (su[n] for n in ("cfg", "mesh", "opd_cfg", "teachers",
                                                        "pool"))
  host, cached, batch = su["host"], su["cached"], su["batch"]
  b, t = host["tokens"].shape
  heads = pool.heads
  teacher_logits = None
  if method == "opd":
    loss_fn = make_opd_loss(cfg, heads, opd_cfg.loss, teacher_names=pool.names)
    constant_bytes = sum(int(w.size) * w.dtype.itemsize for w in heads)
  elif method == "materialised":
    logits_of = jax.jit(lambda h, w: jnp.einsum("BTD,DV->BTV", h.astype(jnp.float32), w))
    teacher_logits = tuple(logits_of(h, w) for h, w in zip(cached.hidden, heads))
    batch = {**{key: v for key, v in batch.items() if key != "teacher_hidden"},
             "teacher_logits": teacher_logits}
    loss_fn = materialised_loss(cfg, opd_cfg.loss.temperature)
    constant_bytes = 0
  else:
    batch = {**{key: v for key, v in batch.items() if key != "teacher_hidden"},
             "teacher_params": tuple(tc.params for tc in teachers)}
    loss_fn = recompute_loss(cfg, [tc.cfg for tc in teachers], opd_cfg.loss,
                             jnp.dtype(opd_cfg.cache_dtype))
    constant_bytes = 0
  state, batch, compiled, compile_s, xla, peak = compile_step(
      cfg, loss_fn, su["student"], batch, mesh, constant_bytes)
  entries = kernel_entries(loss_fn, state.params, batch, mesh)
  row = {"method": method, "arch": arch, "V": vocab, "K": k, "kernel_entries": entries,
         "flops_per_token": cfg.flops_per_token(t),
         "kernel_impl": resolve_impl(opd_cfg.loss.impl) if entries else None,
         "compile_s": compile_s, "xla_bytes": xla, "xla_peak_bytes": peak,
         "xla_peak_gib": peak / 2 ** 30}
  if max_bytes is not None and peak > max_bytes:
    row.update(ran=False, reason=f"compiled peak {peak / 2**30:.2f} GiB > limit "
                                 f"{max_bytes / 2**30:.2f} GiB: not executed")
    return row

  box = {"state": state}

  def one_step():
    box["state"], metrics = compiled(box["state"], batch)
    return jax.block_until_ready(metrics)

  rss_base = tunix_bench.reset_peak_rss()
  first = one_step()  # warm-up; the first step's loss / grad norm are the check
  times = []
  for _ in range(sizes["iters"]):
    t0 = time.perf_counter()
    one_step()
    times.append(time.perf_counter() - t0)
  rss_delta = tunix_bench.peak_rss_mib() - rss_base
  times.sort()
  median = times[len(times) // 2]
  row.update(ran=True, step_median_s=median, step_min_s=times[0], iters=len(times),
             tokens_per_s=b * t / median, rss_base_mib=rss_base, rss_step_delta_mib=rss_delta,
             loss=float(first["loss"]), grad_norm=float(first["grad_norm"]),
             opd_tokens=float(first["opd_tokens"]))
  if method == "materialised":
    row["scales"] = _scales(cfg, su["student"], cached.hidden, heads, teacher_logits, host)
  return row


def _run_tunix(sizes: dict, quick: bool, out: str, mode: str) -> tuple[dict | None, str]:
  """tunix's payload and how it was obtained (or why not)."""
  name = tunix_bench.RESULT_NAME + ("_quick" if quick else "")
  path = pathlib.Path(out) / f"{name}.json"
  if mode == "off":
    return None, "tunix not run: --tunix off"
  if TUNIX_PYTHON.exists():
    cmd = [str(TUNIX_PYTHON), "-m", "experiments.benchmarks.tunix_opd_step", "--out", out,
           "--vocab", *map(str, sizes["vocab"])] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
      return None, f"tunix not run: {' '.join(cmd)} failed: {proc.stderr[-1500:]}"
    how = "run in this run"
  elif path.exists():
    how = f"merged from {path} (an earlier `make bench-tunix`)"
  else:
    return None, (f"tunix not run: {TUNIX_PYTHON.relative_to(REPO)} is missing (make "
                  f"bench-tunix creates it) and there is no {path}")
  payload = json.loads(path.read_text())
  want = {str(v): tunix_bench.tokens_sha256(tunix_bench.host_batch(
      sizes["batch"], sizes["seq"], v)["tokens"]) for v in sizes["vocab"]}
  if any(payload.get("tokens_sha256", {}).get(v) != s for v, s in want.items()):
    return None, f"tunix not run: {path} was measured on another batch or vocabulary"
  return payload, how


def _ratios(rows: list[dict]) -> list[dict]:
  find = lambda m, a, v, k: next((r for r in rows if (r["method"], r.get("arch", "dense"),
                                                      r["V"], r["K"]) == (m, a, v, k)), None)
  out = []
  for a, v, k in sorted({(r["arch"], r["V"], r["K"]) for r in rows if r["method"] == "opd"}):
    ours = find("opd", a, v, k)
    entry = {"arch": a, "V": v, "K": k}
    for base in ("materialised", "recompute") + TUNIX_METHODS:
      other = find(base, a, v, k)
      if other is None or "xla_peak_bytes" not in other or "xla_peak_bytes" not in ours:
        continue
      r = {"peak_mem_ratio": other["xla_peak_bytes"] / ours["xla_peak_bytes"]}
      if ours.get("ran") and other.get("ran"):
        r.update(time_ratio=ours["step_median_s"] / other["step_median_s"],
                 tokens_per_s_ratio=ours["tokens_per_s"] / other["tokens_per_s"])
      entry[f"vs_{base}"] = r
    rec, tunix = find("recompute", a, v, k), find("tunix_rkl", a, v, k)
    if rec is not None and tunix is not None and rec.get("ran"):
      # Equal work: both rerun the teacher forward every step.
      entry["recompute_vs_tunix_rkl"] = {
          "time_ratio": rec["step_median_s"] / tunix["step_median_s"],
          "peak_mem_ratio": tunix["xla_peak_bytes"] / rec["xla_peak_bytes"]}
    out.append(entry)
  return out


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="smoke sizes, rows run in-process")
  p.add_argument("--vocab", type=int, nargs="+", help="override the V list")
  p.add_argument("--teachers", type=int, nargs="+", default=[1, 3], help="the K list")
  p.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS),
                 help="the model list (tunix runs the dense one only)")
  p.add_argument("--cache_dtype", default=OPDConfig.cache_dtype,
                 help="hidden-state cache dtype (OPDConfig.cache_dtype)")
  p.add_argument("--max_gib", type=float, default=None,
                 help="compile but do not run a row above this (default: 80%% of MemAvailable)")
  p.add_argument("--tunix", choices=("auto", "off"), default="auto",
                 help="auto: run .venv-tunix if present, else merge its JSON")
  p.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                 help="one subprocess per row (auto: yes unless --quick)")
  p.add_argument("--out", default="benchmark_results")
  p.add_argument("--worker", nargs=4, metavar=("METHOD", "ARCH", "V", "K"),
                 help=argparse.SUPPRESS)
  return sized_args(p.parse_args(argv))


def compile_step(cfg, loss_fn, params, batch, mesh, constant_bytes: int):
  """One OPD training step of ``cfg`` from ``params``, compiled for ``batch``
  (replicated on ``mesh``): ``(state, device batch, compiled step, compile
  seconds, XLA byte counts, peak bytes)``; the peak is argument + output −
  alias + temp + the ``constant_bytes`` the program embeds (shared with the
  other OPD step benchmarks)."""
  optimizer = make_optimizer(OptimConfig(lr=1e-4, weight_decay=0.1))
  state, shardings = init_train_state(cfg, optimizer, mesh, rng=0, params=params)
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
  return state, batch, compiled, compile_s, xla, peak


def sized_args(args):
  """``args.sizes`` from ``--quick`` / ``--vocab``, and ``--teachers`` checked
  (shared with the other OPD step benchmarks)."""
  args.sizes = dict(tunix_bench.QUICK if args.quick else tunix_bench.FULL)
  if args.vocab:
    args.sizes["vocab"] = list(args.vocab)
  for k in args.teachers:
    if k < 1:
      raise ValueError(f"--teachers={args.teachers}: each K must be >= 1")
  return args


def main(argv=None) -> dict:
  args = _parse(argv)
  max_bytes = (int(args.max_gib * 2 ** 30) if args.max_gib is not None
               else int(0.8 * _mem_available_bytes()))
  if args.worker:
    method, arch, v, k = args.worker
    print(json.dumps(worker(method, args.sizes, int(v), int(k), args.cache_dtype, max_bytes,
                            arch=arch)))
    return {}
  isolate = args.isolate == "yes" or (args.isolate == "auto" and not args.quick)
  sizes = args.sizes
  rows = []
  for arch, v, k in ((a, v, k) for a in args.archs for v in sizes["vocab"]
                      for k in args.teachers):
    shared = None if isolate else setup(sizes, v, k, args.cache_dtype, arch)
    for method in METHODS:
      if isolate:
        flags = ["--quick"] if args.quick else []
        try:
          row = common.run_isolated("experiments.benchmarks.opd_step", [
              "--worker", method, arch, str(v), str(k), "--cache_dtype", args.cache_dtype,
              "--max_gib", str(max_bytes / 2 ** 30), *flags,
              *(["--vocab", *map(str, sizes["vocab"])] if args.vocab else [])])
          row.pop("max_rss_mib", None)  # the row's own RSS figures are exact
        except RuntimeError as e:  # e.g. killed for memory: recorded, the others still run
          row = {"method": method, "arch": arch, "V": v, "K": k, "ran": False,
                 "reason": str(e)[-1500:]}
      else:
        row = worker(method, sizes, v, k, args.cache_dtype, max_bytes, shared, arch)
      rows.append(row)
      print(f"  {method} {arch} V={v} K={k}: " + (f"{row['step_median_s']:.3f} s/step"
                                                  if row.get("ran") else row.get("reason", "")),
            flush=True)
  tunix, tunix_status = _run_tunix(sizes, args.quick, args.out, args.tunix)
  if tunix is not None:
    rows += [{**r, "arch": "dense", "xla_peak_gib": r["xla_peak_bytes"] / 2 ** 30}
             for r in tunix["rows"] if r.get("ran")]
  b, t = sizes["batch"], sizes["seq"]
  itemsize = jnp.dtype(args.cache_dtype).itemsize
  cache_bytes = [{"V": v, "K": k, "hidden_cache_bytes": k * b * t * sizes["d_model"] * itemsize,
                  "logit_cache_bytes": k * b * t * v * 4,
                  "ratio": v * 4 / (sizes["d_model"] * itemsize)}
                 for v in sizes["vocab"] for k in args.teachers]
  ratios = _ratios(rows)
  big = max(sizes["vocab"])
  targets = {"V": big, "peak_mem_vs_materialised_min": 3.0,
             "time_vs_tunix_equal_work": "opd and recompute step time < tunix_rkl (K = 1)"}
  for r in ratios:
    if r["V"] == big:
      r["meets_memory"] = r.get("vs_materialised", {}).get("peak_mem_ratio", 0) >= 3.0
      if "recompute_vs_tunix_rkl" in r:
        r["meets_tunix_time"] = (r["vs_tunix_rkl"]["time_ratio"] < 1.0
                                 and r["recompute_vs_tunix_rkl"]["time_ratio"] < 1.0)
  entries = sorted({e for r in rows if r["method"] == "opd" for e in r["kernel_entries"]})
  payload = {"sizes": {**sizes, "K": list(args.teachers), "archs": list(args.archs),
                       "tokens_per_step": b * t,
                       "cache_dtype": args.cache_dtype, "dtype": "float32",
                       "optimizer": "make_optimizer(OptimConfig(lr=1e-4, weight_decay=0.1))"},
             "quick": args.quick, "isolated": isolate, "max_run_bytes": max_bytes,
             "kernel_entry": entries, "rows": rows, "ratios": ratios,
             "cache_bytes": cache_bytes, "targets": targets,
             "tunix": {"status": tunix_status,
                       "versions": tunix["versions"] if tunix is not None else None,
                       "K>1": "no row: tunix's DistillationTrainer takes one teacher_model"},
             "memory": ("xla_peak_bytes = argument + output - alias + temp (+ constants the "
                        "program embeds) of the compiled step; rss_step_delta_mib = peak RSS "
                        "during warm-up + timed steps minus the RSS after compilation")}
  print(f"# OPD step, CPU, B={b} T={t} D={sizes['d_model']} L={sizes['n_layers']} float32, "
        f"cache {args.cache_dtype}; kernel entry: {', '.join(entries)}")
  print(common.format_table(rows, ["method", "arch", "V", "K", "compile_s", "step_median_s",
                                   "tokens_per_s", "xla_peak_gib", "rss_step_delta_mib",
                                   "loss", "ran"]))
  print()
  print(common.format_table([{"arch": r["arch"], "V": r["V"], "K": r["K"], **{
      f"{base}: {m}": r[f"vs_{base}"].get(m) for base in ("materialised", "recompute",
                                                           "tunix_rkl")
      if f"vs_{base}" in r for m in ("time_ratio", "peak_mem_ratio")},
      **({"recompute/tunix_rkl time": r["recompute_vs_tunix_rkl"]["time_ratio"]}
         if "recompute_vs_tunix_rkl" in r else {})} for r in ratios]))
  print(common.format_table(cache_bytes))
  print(tunix_status if tunix is None else f"tunix: {tunix_status}")
  path = common.write_result("opd_step_quick" if args.quick else "opd_step", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
