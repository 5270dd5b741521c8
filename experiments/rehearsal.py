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
import json
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from opd.distill.cache import HiddenStateCache, loss_batch
from opd.distill.faults import TeacherAnswers
from opd.distill.loss import OPDLossConfig, make_opd_loss
from opd.models import ModelConfig, forward, head_matrix, init_params
from opd.parallel import memory
from opd.parallel.sharding import make_mesh
from opd.rollout.sampler import SamplingConfig, generate
from opd.training.optim import OptimConfig, make_optimizer
from opd.training.train_step import init_train_state, make_train_step

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


def _configs(full: bool, dtype: str) -> dict[str, ModelConfig]:
  shapes = FULL if full else REDUCED
  return {name: ModelConfig(**kw, dtype=dtype, param_dtype="float32" if name == "student"
                            else dtype) for name, kw in shapes.items()}


def run(*, full: bool = False, batch: int = 4, prompt_len: int = 16, new_tokens: int = 16,
        steps: int = 2, dtype: str = "bfloat16", seed: int = 0, devices=None,
        device_gib: float | None = None) -> dict:
  """Runs the rehearsal and returns its table (see the module docstring).

  ``device_gib``: refuse (``opd.parallel.memory.DoesNotFitError``, before
  anything is created or compiled) when the memory model's per-device
  estimate exceeds it.

  Raises:
    ValueError: naming a non-positive ``batch``, ``prompt_len``, ``new_tokens``
      or ``steps``, or a ``batch`` the devices do not divide.
  """
  for name, value in (("batch", batch), ("prompt_len", prompt_len),
                      ("new_tokens", new_tokens), ("steps", steps)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"rehearsal: {name}={value!r} must be a positive int")
  cfgs = _configs(full, dtype)
  student = cfgs.pop("student")
  devices = list(jax.devices() if devices is None else devices)
  if batch % len(devices):
    raise ValueError(f"rehearsal: batch={batch} is not divisible by the {len(devices)} devices")
  seq_len = prompt_len + new_tokens - 1
  model_kw = dict(fused_loss=True,
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
  state, shardings = init_train_state(student, optimizer, mesh, rng=seed)
  jax.block_until_ready(state)
  times["init_student"] = time.perf_counter() - t0
  rss["init_student"] = _rss_gib()

  t0 = time.perf_counter()
  rng = np.random.default_rng(seed)
  prompts = jnp.asarray(rng.integers(0, student.vocab_size, (batch, prompt_len)), jnp.int32)
  prompt_mask = jnp.ones((batch, prompt_len), bool)
  sample = generate(student, state.params, prompts, prompt_mask, jax.random.key(seed),
                    SamplingConfig(max_new_tokens=new_tokens, temperature=1.0), mesh=mesh)
  seq = np.concatenate([np.asarray(prompts), np.asarray(sample.tokens)], axis=1)
  seq_mask = np.concatenate([np.ones((batch, prompt_len), bool), np.asarray(sample.mask)], 1)
  times["rollout"] = time.perf_counter() - t0
  rss["rollout"] = _rss_gib()
  arrays = {"tokens": seq[:, :-1], "targets": seq[:, 1:], "mask": seq_mask[:, :-1],
            "loss_mask": (np.arange(seq.shape[1] - 1)[None] >= prompt_len - 1)
            * seq_mask[:, 1:].astype(np.float32)}

  heads = {}

  def teachers(tokens, mask):
    """Each teacher in turn: create, run, keep the head, drop the weights."""
    hidden = {}
    for k, (name, cfg) in enumerate(cfgs.items()):
      t_teacher = time.perf_counter()
      params = init_params(cfg, jax.random.key(seed + 1 + k))
      out = forward(cfg, params, tokens, mask=mask, return_logits=False, return_hidden=True)
      hidden[name] = jax.block_until_ready(out.hidden)
      times[f"teacher/{name}"] = time.perf_counter() - t_teacher
      rss[f"teacher/{name}"] = _rss_gib()
      heads[name] = head_matrix(cfg, params)
      del params, out  # the next teacher's weights are created after this one's are gone
    return TeacherAnswers(hidden=hidden, available=np.ones((tokens.shape[0], len(cfgs)), bool),
                          skipped={}, messages={})

  t0 = time.perf_counter()
  cache = HiddenStateCache(teachers, dtype="bfloat16")
  cached = cache.get(0, jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["mask"]))
  times["teachers"] = time.perf_counter() - t0
  rss["teachers"] = _rss_gib()
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
  times["opd_steps"] = time.perf_counter() - t0
  rss["opd_steps"] = _rss_gib()

  per_token = cache.bytes_per_token(student.vocab_size)
  tokens = int(np.prod(arrays["tokens"].shape))
  cache_bytes = tokens * sum(v for k, v in per_token.items() if k.startswith("cache/"))
  logit_bytes = tokens * per_token["logits"] * len(cfgs)
  est = memory.estimate_memory(student, (1, len(devices), 1), batch, seq_len, **model_kw)
  return {"shape": "full" if full else "reduced", "student_params": student.num_params(),
          "teacher_params": {n: c.num_params() for n, c in cfgs.items()},
          "tokens": tokens, "seconds": times, "step_seconds": step_seconds,
          "rss_gib_after": rss, "peak_rss_gib": _peak_rss_gib(),
          "hidden_cache_bytes": cache_bytes, "logit_cache_bytes": logit_bytes,
          "losses": losses, "steps_applied": int(state.step),
          "model_estimate_gib": {k: v / 2**30 for k, v in est.terms().items()}}


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
  args = parser.parse_args(argv)
  table = run(full=args.full, batch=args.batch, prompt_len=args.prompt_len,
              new_tokens=args.new_tokens, steps=args.steps, dtype=args.dtype,
              device_gib=args.device_gib)
  print(json.dumps(table, indent=1))
  return table


if __name__ == "__main__":
  main()
