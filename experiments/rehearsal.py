"""The OPD pipeline at a real model shape, random weights (docs/SCALING.md).

``python -m experiments.rehearsal`` runs a reduced shape (seconds on CPU);
``--full`` runs the issue's rehearsal: a Qwen3-0.6B-shape student (V 151936,
D 1024, 28 layers, 16 q / 8 kv heads of 128, FFN 3072, tied head) and two
teachers at Qwen3-1.7B's (D 2048, FFN 6144) and 0.6B's shapes, bf16 compute.

Stages: rollouts from the sampler (``opd.rollout.sampler.generate``); the
teachers' hidden states into ``opd.distill.cache.HiddenStateCache``, one
teacher at a time (its weights are created, run and dropped before the next
one's exist; only its ``[D_k, V]`` head stays, for the fused loss); then
``steps`` OPD updates with the full-vocabulary estimator
(``opd.distill.loss.make_opd_loss``). Prints each stage's wall time (each
teacher's and each step's too; the first step compiles), the peak RSS and the
resident set after each stage (a teacher's entry is taken while its weights are
resident), the cache's bytes against an fp32 logit cache's and the memory
model's per-device estimate (``opd.parallel.memory``). The same code runs on an
accelerator: the mesh is ``(1, n, 1)`` over the visible devices (fsdp).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opd.distill.cache import HiddenStateCache, loss_batch
from opd.distill.faults import TeacherAnswers
from opd.distill.loss import OPDLossConfig, make_opd_loss
from opd.models import ModelConfig, forward, head_matrix, init_kind, init_params
from opd.models.decoder import param_logical_axes
from opd.models.layers import INIT_STD
from opd.models.lora import LoRAConfig, lora_init, lora_loss
from opd.parallel import memory
from opd.parallel.sharding import DEFAULT_RULES, make_mesh, tree_shardings
from opd.rollout.sampler import SamplingConfig, generate
from opd.training.optim import OptimConfig, make_optimizer
from opd.training.train_step import (LossWithFrozen, abstract_train_state, init_train_state,
                                    make_train_step)

_QWEN3 = dict(vocab_size=151936, n_heads=16, n_kv_heads=8, head_dim=128, qk_norm=True,
              tie_embeddings=True, rope_theta=1_000_000.0, norm_eps=1e-6)
FULL = {"student": dict(_QWEN3, d_model=1024, n_layers=28, d_ff=3072),
        "teacher_1.7b": dict(_QWEN3, d_model=2048, n_layers=28, d_ff=6144),
        "teacher_0.6b": dict(_QWEN3, d_model=1024, n_layers=28, d_ff=3072)}
_SMALL = dict(vocab_size=1024, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True,
              tie_embeddings=True)
REDUCED = {"student": dict(_SMALL, d_model=64, n_layers=2, d_ff=128),
           "teacher_wide": dict(_SMALL, d_model=128, n_layers=2, d_ff=256),
           "teacher_same": dict(_SMALL, d_model=64, n_layers=2, d_ff=128)}


def _peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rss_gib() -> dict[str, float]:
  """The process's resident set now and its peak so far (GiB; Linux)."""
  with open("/proc/self/statm") as f:
    resident_pages = int(f.read().split()[1])
  return {"now": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30, "peak": _peak_rss_gib()}


def _record(stage: str, t0: float, times: dict, rss: dict) -> None:
  """Stores the stage's seconds and resident set, and reports them on stderr as it goes."""
  times[stage] = time.perf_counter() - t0
  rss[stage] = _rss_gib()
  print(f"rehearsal: {stage} {times[stage]:.1f} s, resident {rss[stage]['now']:.2f} GiB "
        f"(peak {rss[stage]['peak']:.2f})", file=sys.stderr, flush=True)


def _configs(full: bool, dtype: str) -> dict[str, ModelConfig]:
  shapes = FULL if full else REDUCED
  return {name: ModelConfig(**kw, dtype=dtype, param_dtype="float32" if name == "student"
                            else dtype) for name, kw in shapes.items()}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(key, kind: str, shape: tuple[int, ...], dtype):
  if kind == "normal":
    return (jax.random.normal(key, shape, jnp.float32) * INIT_STD).astype(dtype)
  return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)


def random_weights(cfg: ModelConfig, key) -> dict:
  """Random weights of ``cfg`` as ``init_params`` draws them (N(0, 0.02²), norm
  scales ones), one parameter per program.

  ``init_params`` draws a whole model in one XLA program; on the CPU backend
  that program holds every parameter's fp32 draw at once (compiled temp
  15.1 GB for the Qwen3-1.7B shape under XLA CPU's default scheduler, more
  than the teacher's 3.4 GB of bf16
  weights), so the rehearsal's teachers are drawn a parameter at a time: the
  transient is the largest parameter's fp32 draw.
  """
  abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  values = [_draw(jax.random.fold_in(key, i), init_kind(path[-1].key), x.shape, x.dtype)
            for i, (path, x) in enumerate(leaves)]
  return jax.tree_util.tree_unflatten(treedef, values)


def run(*, full: bool = False, batch: int = 4, prompt_len: int = 16, new_tokens: int = 16,
        steps: int = 2, dtype: str = "bfloat16", seed: int = 0, devices=None,
        device_gib: float | None = None, master_dtype: str = "float32") -> dict:
  """Runs the rehearsal and returns its table (see the module docstring).

  ``master_dtype``: the student's stored weights and AdamW moments (float32,
  or bfloat16 to halve the step's state where host memory is short).

  ``device_gib``: refuse (``opd.parallel.memory.DoesNotFitError``, before
  anything is created or compiled) when the memory model's per-device
  estimate exceeds it.

  Raises:
    ValueError: naming a non-positive ``batch``, ``prompt_len``, ``new_tokens``
      or ``steps``, a ``batch`` the devices do not divide, or a
      ``master_dtype`` other than float32 / bfloat16.
  """
  if master_dtype not in ("float32", "bfloat16"):
    raise ValueError(f"rehearsal: master_dtype={master_dtype!r} must be float32 or bfloat16")
  for name, value in (("batch", batch), ("prompt_len", prompt_len),
                      ("new_tokens", new_tokens), ("steps", steps)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"rehearsal: {name}={value!r} must be a positive int")
  cfgs = _configs(full, dtype)
  student = cfgs.pop("student").replace(param_dtype=master_dtype)
  devices = list(jax.devices() if devices is None else devices)
  if batch % len(devices):
    raise ValueError(f"rehearsal: batch={batch} is not divisible by the {len(devices)} devices")
  seq_len = prompt_len + new_tokens - 1
  model_kw = dict(fused_loss=True, master_bytes=jnp.dtype(master_dtype).itemsize,
                  teachers=memory.TeacherMemory(dims=tuple(c.d_model for c in cfgs.values())),
                  rollout=memory.RolloutMemory(batch=batch, cache_len=seq_len + 1))
  if device_gib is not None:
    memory.check_fits(student, (1, len(devices), 1), batch, seq_len, device_gib * 2**30,
                      **model_kw)
  mesh = make_mesh((1, len(devices), 1), devices)
  times: dict[str, float] = {}
  rss: dict[str, dict[str, float]] = {}  # after each stage
  t0 = time.perf_counter()
  optimizer = make_optimizer(OptimConfig(lr=1e-5))
  state, shardings = init_train_state(student, optimizer, mesh, rng=seed,
                                      master_dtype=jnp.dtype(master_dtype))
  jax.block_until_ready(state)
  _record("init_student", t0, times, rss)

  t0 = time.perf_counter()
  rng = np.random.default_rng(seed)
  prompts = jnp.asarray(rng.integers(0, student.vocab_size, (batch, prompt_len)), jnp.int32)
  prompt_mask = jnp.ones((batch, prompt_len), bool)
  sample = generate(student, state.params, prompts, prompt_mask, jax.random.key(seed),
                    SamplingConfig(max_new_tokens=new_tokens, temperature=1.0), mesh=mesh)
  seq = np.concatenate([np.asarray(prompts), np.asarray(sample.tokens)], axis=1)
  seq_mask = np.concatenate([np.ones((batch, prompt_len), bool), np.asarray(sample.mask)], 1)
  _record("rollout", t0, times, rss)
  arrays = {"tokens": seq[:, :-1], "targets": seq[:, 1:], "mask": seq_mask[:, :-1],
            "loss_mask": (np.arange(seq.shape[1] - 1)[None] >= prompt_len - 1)
            * seq_mask[:, 1:].astype(np.float32)}

  heads = {}

  def teachers(tokens, mask):
    """Each teacher in turn: create, run, keep the head, drop the weights."""
    hidden = {}
    for k, (name, cfg) in enumerate(cfgs.items()):
      t_teacher = time.perf_counter()
      params = random_weights(cfg, jax.random.key(seed + 1 + k))
      out = forward(cfg, params, tokens, mask=mask, return_logits=False, return_hidden=True)
      hidden[name] = jax.block_until_ready(out.hidden)
      _record(f"teacher/{name}", t_teacher, times, rss)
      heads[name] = head_matrix(cfg, params)
      del params, out  # the next teacher's weights are created after this one's are gone
    return TeacherAnswers(hidden=hidden, available=np.ones((tokens.shape[0], len(cfgs)), bool),
                          skipped={}, messages={})

  t0 = time.perf_counter()
  cache = HiddenStateCache(teachers, dtype="bfloat16")
  cached = cache.get(0, jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["mask"]))
  _record("teachers", t0, times, rss)
  weights = np.full(arrays["tokens"].shape + (len(cfgs),), 1.0 / len(cfgs), np.float32)
  opd_batch, _ = loss_batch(arrays, cached, weights)

  t0 = time.perf_counter()
  loss_fn = make_opd_loss(student, [heads[n] for n in cached.names],
                          OPDLossConfig(estimator="full"), teacher_names=cached.names)
  step = make_train_step(loss_fn, optimizer, mesh, shardings)
  losses, step_seconds = [], []
  for _ in range(steps):
    t_step = time.perf_counter()
    state, metrics = step(state, opd_batch)
    losses.append(float(metrics["loss"]))
    step_seconds.append(time.perf_counter() - t_step)  # the first one compiles
  _record("opd_steps", t0, times, rss)

  per_token = cache.bytes_per_token(student.vocab_size)
  tokens = int(np.prod(arrays["tokens"].shape))
  cache_bytes = tokens * sum(v for k, v in per_token.items() if k.startswith("cache/"))
  logit_bytes = tokens * per_token["logits"] * len(cfgs)
  est = memory.estimate_memory(student, (1, len(devices), 1), batch, seq_len, **model_kw)
  return {"shape": "full" if full else "reduced", "master_dtype": master_dtype,
          "student_params": student.num_params(),
          "teacher_params": {n: c.num_params() for n, c in cfgs.items()},
          "tokens": tokens, "xla_flags": os.environ.get("XLA_FLAGS", ""), "seconds": times, "step_seconds": step_seconds,
          "rss_gib_after": rss, "peak_rss_gib": _peak_rss_gib(),
          "hidden_cache_bytes": cache_bytes, "logit_cache_bytes": logit_bytes,
          "losses": losses, "steps_applied": int(state.step),
          "model_estimate_gib": {k: v / 2**30 for k, v in est.terms().items()}}


def _xla_bytes(compiled, constant_bytes: int = 0) -> dict[str, int]:
  m = compiled.memory_analysis()
  out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
         "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
         "constant": constant_bytes}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + constant_bytes
  return out


def _lora_step(student: ModelConfig, loss_fn, optimizer, mesh, rank: int):
  """``(step, abstract state, abstract bf16 base, LoRAMemory)`` of a LoRA
  student of rank ``rank`` (alpha 2·rank, all seven projections), abstract:
  the step ``opd.training.lora_state`` builds, nothing created."""
  lora = LoRAConfig(rank=rank, alpha=2.0 * rank)
  state, shardings = abstract_train_state(lambda r: lora_init(student, lora, r, boxed=True),
                                          optimizer, mesh, master_dtype=None)
  base_cfg = student.replace(param_dtype="bfloat16")
  shapes = jax.eval_shape(lambda: init_params(base_cfg, jax.random.key(0)))
  base = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                      tree_shardings(param_logical_axes(base_cfg), shapes, mesh, DEFAULT_RULES))
  step = make_train_step(LossWithFrozen(lora_loss(loss_fn, lora, dtype=student.compute_dtype),
                                        base), optimizer, mesh, shardings)
  return step, state, base, memory.LoRAMemory(lora, base_bytes=2)


def compiled_memory(*, full: bool = False, batch: int = 4, prompt_len: int = 16,
                    new_tokens: int = 16, dtype: str = "bfloat16", lora_rank: int = 0) -> dict:
  """XLA's compiled memory of the rehearsal's programs against the memory model.

  Compile only, one device, nothing but the teachers' heads created: the OPD
  step (the step ``run`` takes, from an abstract ``TrainState``) and each
  teacher's hidden-state forward. The heads are closure constants that
  ``memory_analysis()`` leaves out, so the step's peak adds their bytes
  (``constant``). Predicted: ``estimate_memory``'s total for the step
  (minus ``teacher_params``, 0 here), and for a teacher forward
  ``forward_memory``'s weights + hidden states + one layer's transient.
  ``lora_rank`` > 0 adds ``opd_step_lora``: the same step for a LoRA student
  of that rank on a bf16 base (``LoRAMemory``).
  """
  cfgs = _configs(full, dtype)
  student = cfgs.pop("student")
  seq_len = prompt_len + new_tokens - 1
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  optimizer = make_optimizer(OptimConfig(lr=1e-5))
  state, shardings = abstract_train_state(student, optimizer, mesh)
  heads = [jnp.zeros((c.d_model, student.vocab_size), c.storage_dtype) for c in cfgs.values()]
  loss_fn = make_opd_loss(student, heads, OPDLossConfig(estimator="full"),
                          teacher_names=tuple(cfgs))
  step = make_train_step(loss_fn, optimizer, mesh, shardings)
  steps = {"opd_step": (step, (state,), None)}
  if lora_rank:
    lora_step, lora_state, base, lora_mem = _lora_step(student, loss_fn, optimizer, mesh,
                                                       lora_rank)
    steps["opd_step_lora"] = (lora_step, (lora_state, base), lora_mem)
  shape = (batch, seq_len)
  opd_batch = {"tokens": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
               "mask": np.ones(shape, bool), "loss_mask": np.ones(shape, np.float32),
               "teacher_hidden": tuple(jnp.zeros(shape + (c.d_model,), jnp.bfloat16)
                                       for c in cfgs.values()),
               "teacher_weights": np.full(shape + (len(cfgs),), 1 / len(cfgs), np.float32)}
  out = {}
  for name, (fn, (train_state, *frozen), lora_mem) in steps.items():
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
      compiled = fn.jitted_for(opd_batch).lower(train_state, opd_batch, *frozen).compile()
    est = memory.estimate_memory(student, (1, 1, 1), batch, seq_len, fused_loss=True,
                                 teachers=memory.TeacherMemory(dims=tuple(
                                     c.d_model for c in cfgs.values())), lora=lora_mem)
    measured = _xla_bytes(compiled, sum(h.size * h.dtype.itemsize for h in heads))
    predicted = est.total + measured["constant"]
    out[name] = {"xla": measured, "predicted": predicted,
                 "terms": est.terms(), "ratio": predicted / measured["peak"],
                 "compile_s": time.perf_counter() - t0}
  del heads, loss_fn, step, steps, compiled
  for name, cfg in cfgs.items():
    t0 = time.perf_counter()
    params = jax.eval_shape(lambda c=cfg: init_params(c, jax.random.key(0)))
    fwd = jax.jit(lambda p, t, m, c=cfg: forward(c, p, t, mask=m, return_logits=False,
                                                 return_hidden=True).hidden)
    compiled = fwd.lower(params, jax.ShapeDtypeStruct(shape, jnp.int32),
                         jax.ShapeDtypeStruct(shape, jnp.bool_)).compile()
    measured = _xla_bytes(compiled)
    fm = memory.forward_memory(cfg, (1, 1, 1), batch, seq_len)
    predicted = fm.total + batch * seq_len * (4 + 1)  # + the int32 tokens and bool mask
    out[f"forward/{name}"] = {"xla": measured, "predicted": predicted, "terms": fm.terms(),
                              "ratio": predicted / measured["peak"],
                              "compile_s": time.perf_counter() - t0}
  return out


# XLA's CPU backend schedules for concurrency by default, which starts every
# bf16 weight's conversion to fp32 (its matmuls run in fp32) before the first
# layer: 1.76 GB of compiled temp for the Qwen3-0.6B shape's forward at 4 x 31
# tokens, 17 MB with this scheduler off (docs/SCALING.md). xla_cpu_ flags are
# DebugOptions every backend parses and only the CPU one reads.
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _set_cpu_scheduler_flag() -> None:
  """Adds ``CPU_SCHEDULER_FLAG`` to XLA_FLAGS unless the flag is set there
  (read when the backend starts: call before anything runs)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if CPU_SCHEDULER_FLAG.split("=")[0] not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--full", action="store_true", help="Qwen3-0.6B / 1.7B shapes")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=16)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--device_gib", type=float, default=None,
                      help="refuse before compiling if the memory model exceeds this")
  parser.add_argument("--master_dtype", default="float32", choices=("float32", "bfloat16"),
                      help="the student's stored weights and AdamW moments")
  parser.add_argument("--compile_only", action="store_true",
                      help="XLA's compiled memory of the step and teacher forwards vs the model")
  parser.add_argument("--lora_rank", type=int, default=0,
                      help="with --compile_only: also the step of a LoRA student of this rank")
  args = parser.parse_args(argv)
  _set_cpu_scheduler_flag()
  if args.compile_only:
    table = compiled_memory(full=args.full, batch=args.batch, prompt_len=args.prompt_len,
                            new_tokens=args.new_tokens, dtype=args.dtype,
                            lora_rank=args.lora_rank)
    print(json.dumps(table, indent=1))
    return table
  table = run(full=args.full, batch=args.batch, prompt_len=args.prompt_len,
              new_tokens=args.new_tokens, steps=args.steps, dtype=args.dtype,
              master_dtype=args.master_dtype,
              device_gib=args.device_gib)
  print(json.dumps(table, indent=1))
  return table


if __name__ == "__main__":
  main()
