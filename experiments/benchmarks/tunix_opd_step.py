"""tunix's logit-distillation training step on the OPD-step benchmark's model and batch.

Runs in its own virtualenv (``make bench-tunix`` creates ``.venv-tunix`` with
``google-tunix`` and this repo's jax / flax / optax pins; nothing of this
repo is installed there), so it imports no ``opd`` module. The batch and the
sizes are defined here, in plain numpy (:func:`host_batch`, :data:`FULL`,
:data:`QUICK`), and ``experiments.benchmarks.opd_step`` imports them, so
both sides train on the same tokens (the JSON records their sha256).

Model: tunix's own ``Llama3`` (``tunix.models.llama3``), the same shape as
the OPD benchmark's student and teacher (RMSNorm, RoPE, SwiGLU, untied head;
D, layers, heads, F, V as in :data:`FULL`), float32. One teacher (tunix's
``DistillationTrainer`` takes one ``teacher_model``), recomputed every step
by the trainer (``_prepare_inputs`` runs the strategy's teacher forward, then
the jitted step runs student forward + loss + backward + AdamW): the two
calls ``PeftTrainer.train`` makes per step, timed back to back without its
logging. Rows per V:

* ``tunix_logit``: tunix's stock ``LogitStrategy`` (temperature 1, alpha 1):
  forward KL ``KL(q ‖ p)`` of the materialised logits plus the cross-entropy
  terms it always computes (one-hot labels ``[B, T, V]``, student and
  teacher CE as metrics);
* ``tunix_rkl``: the same trainer with a ``BaseStrategy`` whose loss is the
  masked reverse KL ``KL(p ‖ q)`` averaged over response tokens, i.e. the
  OPD loss at K = 1 on materialised logits: the equal-work row.

Memory: the compiled programs' ``memory_analysis()`` (teacher forward and
train step; the peak is the larger of the two programs' argument + output -
alias + temp bytes plus what stays resident beside it) and the process's
peak RSS during the timed steps (``VmHWM`` after resetting it once
compilation is done, minus the RSS at that moment).

    make bench-tunix                                   # FULL sizes
    .venv-tunix/bin/python -m experiments.benchmarks.tunix_opd_step --quick
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

FULL = dict(d_model=256, n_layers=4, n_heads=4, d_ff=768, batch=8, seq=256,
            vocab=[32768, 131072], iters=3)
QUICK = dict(d_model=64, n_layers=2, n_heads=4, d_ff=192, batch=2, seq=64, vocab=[1024],
             iters=2)
SEED = 0
RESULT_NAME = "tunix_opd_step"


def host_batch(batch: int, seq: int, vocab: int, seed: int = SEED) -> dict[str, np.ndarray]:
  """The benchmark's batch, identical in both virtualenvs.

  Row b has ``b * seq // (4 * batch)`` padding tokens at its end; the first
  ``seq // 4`` positions are the prompt, the rest of the real tokens the
  response (trained).

  Returns:
    ``tokens, targets`` [B, T] int32 (targets = next tokens), ``mask`` [B, T]
    bool (real tokens), ``loss_mask`` [B, T] float32 (response targets).
  """
  full = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
  pos = np.arange(seq)[None, :]
  length = seq - np.arange(batch)[:, None] * seq // (4 * batch)
  mask = pos < length
  loss_mask = (mask & (pos >= seq // 4)).astype(np.float32)
  return {"tokens": full[:, :seq], "targets": full[:, 1:], "mask": mask, "loss_mask": loss_mask}


def tokens_sha256(tokens: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise ValueError(f"field={field!r} is not in /proc/self/status")


def reset_peak_rss() -> float:
  """Resets the process's peak RSS (``VmHWM``); returns the current RSS (MiB)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return _status_kib("VmRSS") / 1024


def peak_rss_mib() -> float:
  """Peak RSS (MiB) since the last :func:`reset_peak_rss`."""
  return _status_kib("VmHWM") / 1024


def _xla_bytes(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
          "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes}


def _tree_bytes(tree) -> int:
  import jax
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def worker(strategy_name: str, sizes: dict, vocab: int) -> dict:
  """Builds the tunix student / teacher pair and times one strategy's step."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from tunix.distillation import distillation_trainer as dt
  from tunix.distillation.strategies import base_strategy, logit
  from tunix.models.llama3 import model as llama3
  from tunix.sft import utils as sft_utils

  cfg = llama3.ModelConfig(
      num_layers=sizes["n_layers"], vocab_size=vocab, embed_dim=sizes["d_model"],
      hidden_dim=sizes["d_ff"], num_heads=sizes["n_heads"],
      head_dim=sizes["d_model"] // sizes["n_heads"], num_kv_heads=sizes["n_heads"],
      rope_theta=10_000, norm_eps=1e-6)
  student = llama3.Llama3(cfg, rngs=nnx.Rngs(1))
  teacher = llama3.Llama3(cfg, rngs=nnx.Rngs(2))
  host = host_batch(sizes["batch"], sizes["seq"], vocab)
  prompt_len = sizes["seq"] // 4

  def forward(model, input_tokens, input_mask):
    positions = sft_utils.build_positions_from_mask(input_mask)
    logits, _ = model(input_tokens, positions, None, sft_utils.make_causal_attn_mask(input_mask))
    return logits

  class ReverseKLStrategy(base_strategy.BaseStrategy):
    """Masked token-mean reverse KL(p_s ‖ q) on materialised logits."""

    def compute_loss(self, student_output, teacher_output, labels):
      lp = jax.nn.log_softmax(student_output.astype(jnp.float32), axis=-1)
      lq = jax.nn.log_softmax(teacher_output.astype(jnp.float32), axis=-1)
      kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)  # [B, T]
      loss = jnp.sum(kl * labels) / jnp.maximum(jnp.sum(labels), 1.0)
      return loss, {"kl": loss}

    def compute_eval_loss(self, student_output, labels):
      return jnp.zeros(()), {}

  if strategy_name == "tunix_rkl":
    def labels_fn(input_tokens, input_mask):  # the response-token mask [B, T]
      del input_tokens
      pos = jnp.arange(input_mask.shape[1])[None, :]
      return (input_mask & (pos >= prompt_len)).astype(jnp.float32)
    strategy = ReverseKLStrategy(forward, forward, labels_fn)
  elif strategy_name == "tunix_logit":
    def labels_fn(input_tokens, input_mask):  # one-hot next tokens [B, T, V]
      del input_mask
      return jax.nn.one_hot(jnp.roll(input_tokens, -1, axis=1), vocab)
    strategy = logit.LogitStrategy(forward, forward, labels_fn, temperature=1.0, alpha=1.0)
  else:
    raise ValueError(f"strategy_name={strategy_name!r}: expected 'tunix_rkl' or 'tunix_logit'")

  optimizer = optax.adamw(1e-4, weight_decay=0.1)
  trainer = dt.DistillationTrainer(
      student, teacher, strategy, optimizer,
      dt.TrainingConfig(eval_every_n_steps=10 ** 9, max_steps=None,
                        pbar_description=None))
  example = dt.TrainingInput(input_tokens=jnp.asarray(host["tokens"]),
                             input_mask=jnp.asarray(host["mask"]))
  train_step, _ = trainer.jit_train_and_eval_step()

  # Compiled memory of the two programs, lowered from the same functions.
  prepared = trainer._prepare_inputs(example)  # teacher forward (compiles it)
  inputs = trainer.gen_model_input_fn(example)["inputs"]
  teacher_mem = _xla_bytes(strategy._teacher_forward_fn.lower(teacher, **inputs).compile())
  step_mem = _xla_bytes(nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",))
                        .lower(trainer.model, trainer.optimizer, prepared).compile())
  student_state = _tree_bytes(nnx.state(trainer.model)) + _tree_bytes(
      nnx.state(trainer.optimizer))
  teacher_params = _tree_bytes(nnx.state(teacher))
  program = lambda m: m["argument"] + m["output"] - m["alias"] + m["temp"]
  peak = max(program(teacher_mem) + student_state, program(step_mem) + teacher_params)

  def one_step():
    batch = trainer._prepare_inputs(example)
    loss, aux, grad_norm = train_step(batch)
    jax.block_until_ready((loss, grad_norm))
    return float(loss), float(grad_norm)

  t0 = time.perf_counter()
  first_loss, first_grad_norm = one_step()  # compiles the train step
  compile_s = time.perf_counter() - t0
  rss_base = reset_peak_rss()
  one_step()  # warm-up
  times = []
  for _ in range(sizes["iters"]):
    t0 = time.perf_counter()
    one_step()
    times.append(time.perf_counter() - t0)
  times.sort()
  tokens = sizes["batch"] * sizes["seq"]
  return {
      "method": strategy_name, "V": vocab, "K": 1, "ran": True,
      "compile_s": compile_s, "step_median_s": times[len(times) // 2], "step_min_s": times[0],
      "iters": len(times), "tokens_per_s": tokens / times[len(times) // 2],
      "xla_teacher_forward": teacher_mem, "xla_train_step": step_mem,
      "resident_bytes": {"student_state": student_state, "teacher_params": teacher_params},
      "xla_peak_bytes": peak,
      "rss_base_mib": rss_base, "rss_step_delta_mib": peak_rss_mib() - rss_base,
      "loss": first_loss, "grad_norm": first_grad_norm,
  }


def _versions() -> dict[str, str]:
  from importlib import metadata
  return {p: metadata.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")}


def run(argv=None) -> dict:
  """Command line; not a ``run_all`` entry (``opd_step`` runs it in ``.venv-tunix``)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="smoke sizes")
  parser.add_argument("--vocab", type=int, nargs="+", help="override the V list")
  parser.add_argument("--out", default="benchmark_results")
  parser.add_argument("--worker", nargs=2, metavar=("STRATEGY", "V"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  sizes = dict(QUICK if args.quick else FULL)
  if args.vocab:
    sizes["vocab"] = list(args.vocab)
  if args.worker:
    print(json.dumps(worker(args.worker[0], sizes, int(args.worker[1]))))
    return {}

  from experiments.benchmarks import common  # stdlib only at import
  rows = []
  for v in sizes["vocab"]:
    for name in ("tunix_rkl", "tunix_logit"):
      argv_w = ["--worker", name, str(v)] + (["--quick"] if args.quick else [])
      try:
        row = common.run_isolated("experiments.benchmarks.tunix_opd_step", argv_w)
        row.pop("max_rss_mib", None)
      except RuntimeError as e:  # recorded, not fatal: the merge reports the reason
        row = {"method": name, "V": v, "K": 1, "ran": False, "reason": str(e)[-2000:]}
      rows.append(row)
  host = host_batch(sizes["batch"], sizes["seq"], sizes["vocab"][0])
  payload = {"sizes": sizes, "quick": args.quick, "versions": _versions(),
             "tokens_sha256": {str(v): tokens_sha256(host_batch(
                 sizes["batch"], sizes["seq"], v)["tokens"]) for v in sizes["vocab"]},
             "loss_mask_tokens": float(host["loss_mask"].sum()), "rows": rows}
  print(f"# tunix {payload['versions']['google-tunix']} logit distillation, CPU, "
        f"B={sizes['batch']} T={sizes['seq']} D={sizes['d_model']} L={sizes['n_layers']}")
  print(common.format_table(rows, ["method", "V", "compile_s", "step_median_s", "tokens_per_s",
                                   "xla_peak_bytes", "rss_step_delta_mib", "loss"]))
  path = common.write_result(RESULT_NAME + ("_quick" if args.quick else ""), payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  run(sys.argv[1:])
