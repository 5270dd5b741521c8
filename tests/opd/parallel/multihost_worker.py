"""Child process for tests/opd/parallel/test_multihost.py (not a test module).

Runs 3 training steps of a tiny decoder on a (1, 2, 2) mesh and writes the
losses, the first step's gradients (keys ``grad[...]``) and the full
parameters after 3 steps (keys ``[...]``), gathered, to ``--out`` (an .npz,
process 0 only). With ``--num-processes 2`` it joins a 2-process jax job on localhost
(2 CPU devices each); with 1 it runs alone on 4 devices. The parent sets
XLA_FLAGS for the device count before this starts.

    python tests/opd/parallel/multihost_worker.py --num-processes 2 --process-id 0 --port 1234 --out a.npz
"""
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]  # the repo (opd) and tests/ (multihost_util)

import multihost_util  # noqa: E402
from opd.parallel import distributed  # noqa: E402
from opd.training.objectives import next_token_loss  # noqa: E402


def main():
  args = multihost_util.worker_args()

  import jax
  import numpy as np
  import jax.numpy as jnp
  import optax
  jax.config.update("jax_default_matmul_precision", "highest")
  from opd.parallel import sharding
  from opd.models import ModelConfig
  from opd.training.train_step import (OptimConfig, init_train_state, make_optimizer, make_train_step,
                              process_batch_rows, shard_batch)

  if jax.device_count() != 4:
    raise SystemExit(f"expected 4 global devices, got {jax.device_count()}")
  cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64)
  opt_cfg = OptimConfig(lr=1e-2, warmup_steps=1, decay_steps=4, schedule="linear", weight_decay=0.1)
  # A first stage that keeps the gradients in its state (sharded like the
  # params), so the parent can compare the gradients the step really computed.
  capture = optax.GradientTransformation(init=lambda p: jax.tree.map(jnp.zeros_like, p),
                                         update=lambda g, s, p=None: (g, g))
  optimizer = optax.chain(capture, make_optimizer(opt_cfg))
  mesh = sharding.make_mesh((1, 2, 2))  # fsdp spans the two processes
  rules = sharding.DEFAULT_RULES
  state, shardings = init_train_state(cfg, optimizer, mesh, rules, rng=0)
  step = make_train_step(next_token_loss(cfg), optimizer, mesh, shardings, rules=rules)
  global_batch = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 8, 17)).astype(np.int32)
  rows = process_batch_rows(mesh, rules, global_batch.shape[1])
  losses, lrs, grads = [], [], None
  for i in range(3):
    batch = shard_batch({"tokens": global_batch[i, rows]}, mesh, rules)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    lrs.append(float(metrics["lr"]))
    if grads is None:
      grads = distributed.gather_to_host(state.opt_state[0])
  params = distributed.gather_to_host(state.params)
  if distributed.is_main_process():
    flat = lambda tree, pre: {pre + jax.tree_util.keystr(p): x
                              for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    np.savez(args.out, losses=np.asarray(losses), lrs=np.asarray(lrs), tokens=global_batch[0].size,
             vocab=cfg.vocab_size, b1=opt_cfg.b1, b2=opt_cfg.b2, weight_decay=opt_cfg.weight_decay,
             rows=np.asarray([rows.start, rows.stop]), processes=jax.process_count(),
             **flat(params, ""), **flat(grads, "grad"))
  distributed.sync("done")
  print(f"process {jax.process_index()}: rows {rows}, losses {losses}", flush=True)


if __name__ == "__main__":
  main()
