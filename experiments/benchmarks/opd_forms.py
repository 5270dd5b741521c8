"""One OPD student update in each loss form: the exact reverse KL vs the advantage form.

Every row is one full student update (student forward, loss, backward, AdamW,
through ``opd.training.train_step.make_train_step`` on a one-device mesh,
float32) on the model, teachers, batch and hidden-state cache of
``experiments.benchmarks.opd_step`` (``opd_step.setup``: ``TeacherPool`` →
``FaultTolerantTeachers`` → ``HiddenStateCache`` → ``cache.loss_batch``,
uniform weights), at its vocabulary sizes. Forms (docs/DESIGN.md §3):

* ``exact``: ``OPDConfig().loss``, the full-vocabulary reverse KL
  through ``pallas_kernels.fused_reverse_kl_train``.
* ``advantage``: ``OPDLossConfig(form="advantage", adv_gamma=1,
  adv_alpha=1, is_cap=2)`` (``opd.distill.advantage``; log-probs at OPD's
  default sampling temperature ``OPDConfig().rollout.temperature``): the
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

Cross-tokenizer rows (``cross_tokenizer`` in the JSON, :func:`xtok_rows`;
docs/DESIGN.md §3): the advantage step with a teacher whose tokenizer is not
the student's (``cross``: ``opd.distill.crosstok``'s span log-ratios) against
the same teacher (same params) reading the student's tokens (``same``), at
each V, K = 1, on real text (:func:`text_host`), for two pairings: a byte
student with a task-BPE teacher (``--bpe``, built by
``opd.tasks.tokenizer.task_tokenizer``) and that BPE student with a byte
teacher; with ``--teacher_bpe`` (e.g. ``bpe:512``: the strong world's
cross-tokenizer teacher) a third, that BPE student with a teacher of the
second BPE. Each row also times the host side separately from the device
step: ``transcode_align_s`` (``CrossTokenizerPool.rows``: transcoding and
alignment; 0 for ``same``) and ``teacher_forward_s`` (the teacher's hidden
states: the cache's for ``same``, ``CrossTokenizerPool.ask`` on the
teacher's own rows for ``cross``), with token, span and trained-token counts.
Ratios per pairing and V: ``cross`` over ``same`` (step time, peak memory,
teacher forward, host + step, teacher tokens) and the transcoding time over
the ``cross`` step.

    python -m experiments.benchmarks.opd_forms            # V=32768,131072, K=1, bpe:1024
    python -m experiments.benchmarks.opd_forms --quick    # smoke sizes
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from experiments.benchmarks import common
from experiments.benchmarks import opd_step
from opd.distill import advantage as advantage_lib
from opd.distill.cache import HiddenStateCache, loss_batch
from opd.distill.crosstok_pool import CrossTokenizerPool, EmptyTeachers, from_teacher
from opd.distill.faults import FaultTolerantTeachers
from opd.distill.loss import OPDLossConfig, make_opd_loss, token_coefficients
from opd.distill.source import OPDConfig
from opd.distill.teachers import Teacher, TeacherPool
from opd.models import ModelConfig, forward, head_matrix
from opd.parallel import sharding
from opd.tasks import mixture_corpus
from opd.tasks.tokenizer import task_tokenizer
from opd.text.tokenizers import ByteTokenizer
from pallas_kernels.inputs import normalized_weights

FORMS = ("exact", "advantage", "advantage_logits")
ADVANTAGE = dict(form="advantage", adv_gamma=1.0, adv_alpha=1.0, is_cap=2.0)
# The sampling temperature T of the advantage form's log-probs: OPD's default rollout's.
TEMPERATURE = OPDConfig().rollout.temperature


def logits_loss(cfg: ModelConfig, loss_config):
  """``loss_fn`` of ``advantage_logits``: teacher log-probs from cached logits.

  Batch: the advantage form's, with ``teacher_logits`` (K arrays [B, T, V]
  float32) in place of ``teacher_hidden``.
  """
  tau = float(TEMPERATURE)

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


def on_policy(cfg: ModelConfig, student, host, batch, loss_config) -> dict:
  """``batch`` plus the student's own ``old_logprobs`` [B, T] (on-policy) and
  outcome advantages [B] (a fixed draw)."""
  b, t = host["tokens"].shape
  h = forward(cfg, student, jnp.asarray(host["tokens"]), None, jnp.asarray(host["mask"]),
              return_logits=False, return_hidden=True).hidden.reshape(b * t, -1)
  old = -pallas_kernels.fused_cross_entropy(h, head_matrix(cfg, student),
                                            jnp.asarray(host["targets"]).reshape(-1),
                                            temperature=TEMPERATURE)
  rng = np.random.default_rng(0)
  return {**batch, "old_logprobs": np.asarray(old).reshape(b, t),
          "advantages": rng.standard_normal(b).astype(np.float32)}


def worker(form: str, su: dict, iters: int) -> dict:
  """Compiles and times one form's step on :func:`opd_step.setup`'s ``su``."""
  if form not in FORMS:
    raise ValueError(f"form={form!r}: expected one of {FORMS}")
  cfg, mesh, pool, batch = su["cfg"], su["mesh"], su["pool"], su["batch"]
  heads = pool.heads
  head_bytes = sum(int(w.size) * w.dtype.itemsize for w in heads)
  if form == "exact":
    loss_fn = make_opd_loss(cfg, heads, OPDConfig().loss, teacher_names=pool.names)
    constant_bytes = head_bytes
  else:
    loss_config = OPDLossConfig(**ADVANTAGE)
    batch = on_policy(cfg, su["student"], su["host"], su["batch"], loss_config)
    if form == "advantage":
      loss_fn = make_opd_loss(cfg, heads, loss_config, teacher_names=pool.names,
                              sampling_temperature=TEMPERATURE)
      constant_bytes = head_bytes
    else:
      logits_of = jax.jit(lambda h, w: jnp.einsum("BTD,DV->BTV", h.astype(jnp.float32), w))
      batch = {**{k: v for k, v in batch.items() if k != "teacher_hidden"},
               "teacher_logits": tuple(logits_of(h, w) for h, w in zip(su["cached"].hidden,
                                                                        heads))}
      loss_fn = logits_loss(cfg, loss_config)
      constant_bytes = 0
  timed, first = time_step(cfg, mesh, su["student"], loss_fn, batch, constant_bytes, iters)
  row = {"form": form, "V": cfg.vocab_size, "K": len(heads), **timed}
  if form != "exact":
    row["adv_abs_mean"] = float(first["adv/abs_mean"])
    row["logit_absmax_bound"] = _logit_bound(su)
  return row


def time_step(cfg: ModelConfig, mesh, student, loss_fn, batch, constant_bytes: int,
              iters: int) -> tuple[dict, dict]:
  """Compiles one student update of ``loss_fn`` on ``batch`` and times it.

  Returns:
    ``(row, first)``: ``row`` has the compile time, median / min step time
    over ``iters`` after one warm-up step, tokens/s, XLA's compiled bytes
    and peak (plus ``constant_bytes`` the program embeds) and the first
    step's loss, gradient norm and ``opd_tokens``; ``first`` is every
    metric of that first step.
  """
  state, batch, compiled, compile_s, xla, peak = opd_step.compile_step(
      cfg, loss_fn, student, batch, mesh, constant_bytes)
  box = {"state": state}

  def one_step():
    box["state"], metrics = compiled(box["state"], batch)
    return jax.block_until_ready(metrics)

  first = one_step()  # warm-up; its loss and gradient norm are recorded
  timing = common.time_fn(one_step, warmup=0, iters=iters)
  b, t = batch["tokens"].shape
  return {"compile_s": compile_s, "step_median_s": timing["median_s"],
          "step_min_s": timing["min_s"], "iters": timing["iters"],
          "tokens_per_s": b * t / timing["median_s"], "xla_bytes": xla, "xla_peak_bytes": peak,
          "xla_peak_gib": peak / 2 ** 30, "loss": float(first["loss"]),
          "grad_norm": float(first["grad_norm"]), "opd_tokens": float(first["opd_tokens"])}, first


def text_host(tok, sizes: dict) -> dict[str, np.ndarray]:
  """The benchmark's batch layout (``tunix_opd_step.host_batch``: row b ends
  with ``b·T // (4B)`` pads, the first T/4 positions are the prompt) on real
  text: the task corpus's conversations (``opd.tasks.mixture_corpus``, seed
  1), each encoded by the student's ``tok``, concatenated and cut into rows."""
  b, t = sizes["batch"], sizes["seq"]
  stream, n = [], 0
  while len(stream) < b * (t + 1):
    n += 64
    stream = [i for text in mixture_corpus(n, seed=1) for i in tok.encode(text)]
  full = np.asarray(stream[:b * (t + 1)], np.int32).reshape(b, t + 1)
  pos = np.arange(t)[None, :]
  mask = pos < t - np.arange(b)[:, None] * t // (4 * b)
  tokens = np.where(mask, full[:, :t], tok.pad_id).astype(np.int32)
  targets = np.where(mask, full[:, 1:], tok.pad_id).astype(np.int32)
  return {"tokens": tokens, "targets": targets, "mask": mask,
          "loss_mask": (mask & (pos >= t // 4)).astype(np.float32)}


def _spec(tok) -> str:
  """A tokenizer's config spec (``ByteTokenizer`` has none: ``"byte"``)."""
  return getattr(tok, "spec", None) or "byte"


def _median_s(fn, iters: int):
  """``fn()``'s result after one warm-up call, and its median time over ``iters`` calls."""
  out, times = fn(), []
  for _ in range(iters):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return out, sorted(times)[len(times) // 2]


def xtok_rows(sizes: dict, v: int, student_tok, teacher_tok, cache_dtype: str) -> list[dict]:
  """One advantage-form step with a teacher of another tokenizer (``cross``)
  and with the same teacher reading the student's tokens (``same``).

  Both rows: the student and teacher of :func:`opd_step.setup` (vocabulary
  V, one teacher, the same params in both rows), the batch of
  :func:`text_host` in the student's tokenizer, ``ADVANTAGE``'s loss. The
  teacher side goes the way ``OPDSource`` takes it, timed on the host
  (median over ``iters`` after a warm-up): ``same`` through ``TeacherPool``
  → ``FaultTolerantTeachers`` → ``HiddenStateCache`` (``cache_dtype``) →
  ``loss_batch``; ``cross`` through ``CrossTokenizerPool.rows``
  (transcoding and alignment, timed alone as ``transcode_align_s``), then
  ``ask`` (the teacher's forward on its own rows, float32 as
  ``crosstok_pool.from_teacher`` keeps them), ``extend`` and
  ``loss_entries`` (``loss_mask`` cut to the trained spans).
  """
  base = opd_step.model_config(sizes, v)
  s_cfg = dataclasses.replace(base, tokenizer=_spec(student_tok))
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  student = opd_step.host_params(s_cfg, seed=0)
  t_params = opd_step.host_params(s_cfg, seed=1, base=student)
  host = text_host(student_tok, sizes)
  b, t = host["tokens"].shape
  loss_config = OPDLossConfig(**ADVANTAGE)
  deadline = OPDConfig.deadline_s
  ones, iters = np.ones((b, t, 1), np.float32), sizes["iters"]
  rows = []
  for path in ("same", "cross"):
    if path == "same":
      teacher = Teacher("t0", s_cfg, t_params)
      pool = TeacherPool([teacher], v, mesh)
      cache = HiddenStateCache(FaultTolerantTeachers.from_pool(pool, deadline_s=deadline),
                               dtype=cache_dtype)
      keys = itertools.count()  # a new key each call: the cache computes every time
      cached, teacher_s = _median_s(lambda: cache.get(next(keys), host["tokens"], host["mask"]),
                                    iters)
      batch, row_ok = loss_batch(host, cached, ones)
      batch["loss_mask"] = host["loss_mask"] * row_ok[:, None]
      extra = {"teacher_tokens": int(host["mask"].sum()), "teacher_T": t,
               "spans": int((host["loss_mask"] > 0).sum()), "partial_tokens": 0,
               "transcode_align_s": 0.0}
    else:
      t_cfg = dataclasses.replace(base, tokenizer=_spec(teacher_tok))
      teacher = Teacher("t0", t_cfg, t_params, tokenizer=teacher_tok)
      xpool = CrossTokenizerPool([from_teacher(teacher)], student_tok, deadline_s=deadline)
      xrows, transcode_s = _median_s(lambda: xpool.rows(host), iters)
      answers, teacher_s = _median_s(lambda: xpool.ask(xrows), iters)
      cached = answers.extend(HiddenStateCache(EmptyTeachers(), dtype=cache_dtype).get(
          0, host["tokens"], host["mask"]))
      batch, row_ok = loss_batch(host, cached, ones)
      batch["loss_mask"] = host["loss_mask"] * row_ok[:, None]
      batch = answers.loss_entries(batch, xpool.names)
      r = xrows["t0"]
      extra = {"teacher_tokens": int(r.mask.sum()), "teacher_T": int(r.tokens.shape[1]),
               "spans": r.spans, "partial_tokens": r.partial_tokens,
               "transcode_align_s": transcode_s}
    loss_fn = make_opd_loss(s_cfg, [teacher.head], loss_config, teacher_names=("t0",),
                            cross_tokenizer=(path == "cross",), sampling_temperature=TEMPERATURE)
    batch = on_policy(s_cfg, student, host, batch, loss_config)
    head_bytes = int(teacher.head.size) * teacher.head.dtype.itemsize
    timed, _ = time_step(s_cfg, mesh, student, loss_fn, batch, head_bytes, iters)
    rows.append({"path": path, "pairing": f"{_spec(student_tok)}->{_spec(teacher_tok)}",
                 "student_tokenizer": _spec(student_tok),
                 "teacher_tokenizer": _spec(student_tok if path == "same" else teacher_tok),
                 "V": v, "K": 1, "student_tokens": int(host["mask"].sum()),
                 "response_tokens": int((host["loss_mask"] > 0).sum()),
                 "teacher_hidden_dtype": str(batch["teacher_hidden"][0].dtype),
                 **extra, "teacher_forward_s": teacher_s, **timed,
                 "host_plus_step_s": extra["transcode_align_s"] + teacher_s
                 + timed["step_median_s"]})
  return rows


def _xtok_ratios(rows: list[dict]) -> list[dict]:
  """Per (student tokenizer, teacher tokenizer, V): ``cross`` over the
  ``same`` row of its own pairing (a student tokenizer in two pairings has a
  ``same`` row in each)."""
  out = []
  for s_tok, x_tok, v in sorted({(r["student_tokenizer"], r["teacher_tokenizer"], r["V"])
                                 for r in rows if r["path"] == "cross"}):
    cross = next(r for r in rows if (r["path"], r["student_tokenizer"], r["teacher_tokenizer"],
                                     r["V"]) == ("cross", s_tok, x_tok, v))
    same = next(r for r in rows if (r["path"], r["pairing"], r["V"])
                == ("same", cross["pairing"], v))
    out.append({"student_tokenizer": s_tok, "teacher_tokenizer": x_tok, "V": v,
                "step_time_ratio": cross["step_median_s"] / same["step_median_s"],
                "peak_mem_ratio": cross["xla_peak_bytes"] / same["xla_peak_bytes"],
                "teacher_forward_ratio": cross["teacher_forward_s"] / same["teacher_forward_s"],
                "host_plus_step_ratio": cross["host_plus_step_s"] / same["host_plus_step_s"],
                "transcode_over_step": cross["transcode_align_s"] / cross["step_median_s"],
                "teacher_tokens_ratio": cross["teacher_tokens"] / same["teacher_tokens"]})
  return out


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
  p.add_argument("--bpe", default="bpe:1024",
                 help="the task BPE (opd.tasks.tokenizer.task_tokenizer) of the cross-tokenizer "
                      "rows: byte student + this teacher, and this student + a byte teacher")
  p.add_argument("--teacher_bpe", default=None,
                 help="a second task BPE: adds the pairing --bpe student + this teacher")
  p.add_argument("--bpe_dir", default=None,
                 help="where the BPE is built or reused (default: a temporary directory)")
  p.add_argument("--out", default="benchmark_results")
  return opd_step.sized_args(p.parse_args(argv))


def cross_tokenizer_payload(args) -> dict:
  """The cross-tokenizer rows of every V, both pairings, and their ratios."""
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    bpe = task_tokenizer(args.bpe, args.bpe_dir or tmp, field="--bpe")
    build_s = time.perf_counter() - t0
    second = (task_tokenizer(args.teacher_bpe, os.path.join(
        args.bpe_dir or tmp, args.teacher_bpe.replace(":", "_")), field="--teacher_bpe")
              if args.teacher_bpe else None)
  byte = ByteTokenizer()
  pairs = ((byte, bpe), (bpe, byte)) + (((bpe, second),) if second is not None else ())
  rows = []
  for v in args.sizes["vocab"]:
    for s_tok, x_tok in pairs:
      rows += xtok_rows(args.sizes, v, s_tok, x_tok, args.cache_dtype)
      for r in rows[-2:]:
        print(f"  xtok {r['path']} {r['student_tokenizer']}->{r['teacher_tokenizer']} V={v}: "
              f"{r['step_median_s']:.3f} s/step, transcode {r['transcode_align_s']:.4f} s",
              flush=True)
  return {"bpe": args.bpe, "teacher_bpe": args.teacher_bpe, "bpe_build_s": build_s, "rows": rows, "ratios": _xtok_ratios(rows),
          "batch": "text_host: the task corpus (seed 1) in the student's tokenizer"}


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
  xtok = cross_tokenizer_payload(args)
  b, t = sizes["batch"], sizes["seq"]
  payload = {"sizes": {**sizes, "K": list(args.teachers), "tokens_per_step": b * t,
                       "cache_dtype": args.cache_dtype, "dtype": "float32",
                       "advantage_config": ADVANTAGE,
                       "optimizer": "make_optimizer(OptimConfig(lr=1e-4, weight_decay=0.1))"},
             "quick": args.quick, "rows": rows, "ratios": ratios, "cross_tokenizer": xtok,
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
  print(f"\n# cross-tokenizer teacher (advantage form, K=1) vs the same teacher on the "
        f"student's tokens; BPE {args.bpe}")
  print(common.format_table(xtok["rows"], [
      "path", "student_tokenizer", "teacher_tokenizer", "V", "teacher_tokens", "spans",
      "transcode_align_s", "teacher_forward_s", "step_median_s", "xla_peak_gib", "loss"]))
  print(common.format_table(xtok["ratios"]))
  path = common.write_result("opd_forms_quick" if args.quick else "opd_forms", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
