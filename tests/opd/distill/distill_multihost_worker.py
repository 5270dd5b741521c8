"""Child process for tests/opd/distill/test_distill_multihost.py (not a test module).

Runs 3 OPD steps (student D=32 x 2 layers, two teachers of another width,
routing by domain, diagnostics every step, a held-out eval at the end) with
the train step on a (1, 2, 2) mesh, and writes per-step metrics and the
gathered final student params to ``--out`` (an .npz, process 0 only). With
``--num-processes 2`` it joins a 2-process jax job on localhost (2 CPU
devices each); with 1 it runs alone on 4 devices. The parent sets XLA_FLAGS.

    python tests/opd/distill/distill_multihost_worker.py --num-processes 2 --process-id 0 --port 1234 --out a.npz
"""
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]  # the repo (opd) and tests/ (multihost_util)

import multihost_util  # noqa: E402
from opd.parallel import distributed  # noqa: E402


# Metrics compared between the runs (host metrics exactly, train/eval ones
# within the parent's tolerances).
EXACT = ("response/tokens", "response/length_mean", "opd/masked_rows", "weight/ta", "weight/tb")
CLOSE = ("train/loss", "train/lr", "diag/ta/overlap@8", "diag/tb/overlap@8", "eval/rkl/ta",
         "eval/rkl/tb")


def main():
  args = multihost_util.worker_args()

  import jax
  import numpy as np
  jax.config.update("jax_default_matmul_precision", "highest")
  from opd.distill import OPDConfig, Teacher, TeacherPool, make_heldout_eval, train_opd
  from opd.rollout.batches import RolloutConfig
  from opd.models import ModelConfig, init_params
  from opd.parallel import sharding
  from opd.tasks import Example
  from opd.text.tokenizers import ByteTokenizer
  from opd.training.loop_config import LoopConfig, RunIO, Runtime
  from opd.training.train_step import OptimConfig

  if jax.device_count() != 4:
    raise SystemExit(f"expected 4 global devices, got {jax.device_count()}")
  tok = ByteTokenizer()
  v = tok.vocab_size
  student = ModelConfig(vocab_size=v, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
  wide = ModelConfig(vocab_size=v, d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=96)
  teachers = [Teacher("ta", wide, init_params(wide, jax.random.key(1)), "alpha"),
              Teacher("tb", wide, init_params(wide, jax.random.key(2)), "beta")]

  def prompts(n, split):
    return [Example(d, f"{d}-{split}-{i}", split, 1, f"Say something {d} ({split} {i}).",
                    (("assistant", "x"),), {}) for i in range(n) for d in ("alpha", "beta")]

  cfg = OPDConfig(RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=8, seq_len=64,
                                length_bucket=0), diag_every=1, diag_tokens=64)
  optim = OptimConfig(lr=1e-2, warmup_steps=1, decay_steps=4, schedule="linear", weight_decay=0.1)
  mesh = sharding.make_mesh((1, 2, 2))  # fsdp spans the two processes
  host_mesh = distributed.host_work_mesh(mesh)
  eval_fn = make_heldout_eval(student, TeacherPool(teachers, v, host_mesh), prompts(2, "test"),
                              cfg, tokenizer=tok, mesh=host_mesh)
  run = train_opd(student, None, teachers, prompts(8, "train"), cfg, optim,
                  LoopConfig(3, progress=False), RunIO(eval_fn=eval_fn),
                  runtime=Runtime(mesh, seed=0, tokenizer=tok))
  params = distributed.gather_to_host(run.state.params)
  rows = distributed.process_batch_rows(mesh, sharding.DEFAULT_RULES, cfg.rollout.batch_size)
  if distributed.is_main_process():
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    last = run.history[-1]
    series = {k: np.asarray([m[k] for m in run.history]) for k in EXACT + CLOSE[:4]}
    series.update({k: np.asarray([last[k]]) for k in CLOSE[4:]})
    np.savez(args.out, processes=jax.process_count(), b1=optim.b1, b2=optim.b2,
             weight_decay=optim.weight_decay, vocab=v,
             tokens=np.asarray([m["response/tokens"] for m in run.history]),
             **{f"m:{k}": x for k, x in series.items()}, **{f"p:{k}": x for k, x in flat.items()})
  distributed.sync("done")
  print(f"process {jax.process_index()}: rows {rows}, losses "
        f"{[m['train/loss'] for m in run.history]}", flush=True)


if __name__ == "__main__":
  main()
