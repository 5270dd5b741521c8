"""Child process for tests/opd/test_checkpoints.py (not a test module).

``train``: for each ``DIR:N`` of ``--runs``, trains a tiny decoder on a
  (2, 2, 2) mesh with ``opd.training.loop.train`` to N total updates, reading a
  shuffled grain dataset whose iterator position is checkpointed, resuming
  from DIR if it holds a checkpoint. Writes the losses, per-step batch
  checksums and final params of run i to ``{--out}{i}.npz``.
``kill``: saves checkpoint 1, then starts a larger save of step 2 and, once
  the data of step 2 is in its tmp directory but before Orbax commits it
  (renames the tmp directory), writes ``--marker`` and waits to be SIGKILLed.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

CFG_KW = dict(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64)
FAST = {"xla_backend_optimization_level": 0}


def kill_values(step: int, n: int) -> np.ndarray:
  """The array ``kill`` saves at ``step``."""
  return np.arange(n, dtype=np.float32) * (step + 1)


def train(args):
  import grain
  import jax.numpy as jnp

  from opd.parallel import sharding
  from opd.training.checkpoints import CheckpointManager
  from opd.models import ModelConfig
  from opd.training.loop import LoopConfig, RunIO, train
  from opd.training.train_step import (OptimConfig, abstract_train_state, init_train_state, make_optimizer,
                              make_train_step)
  from opd.training.objectives import next_token_loss

  cfg = ModelConfig(**CFG_KW)
  optimizer = make_optimizer(OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=8, schedule="cosine",
                                         weight_decay=0.1))
  mesh = sharding.make_mesh((2, 2, 2))
  abstract, shardings = abstract_train_state(cfg, optimizer, mesh)
  base_loss = next_token_loss(cfg)

  def loss_fn(params, batch, rng):
    loss, metrics = base_loss(params, batch, rng)
    # Identifies the batch, so the test can check the data position resumed.
    metrics["batch_checksum"] = jnp.sum(batch["tokens"] * jnp.arange(1, 18)).astype(jnp.float32)
    return loss, metrics

  step = make_train_step(loss_fn, optimizer, mesh, shardings, compiler_options=FAST)
  rows = np.random.default_rng(3).integers(0, cfg.vocab_size, (24, 17)).astype(np.int32)
  # Several runs share the compiled step; each starts from a fresh state and
  # iterator (or from its directory's latest checkpoint).
  initial = None
  for i, run_spec in enumerate(args.runs.split(",")):
    ckpt, num_steps = run_spec.rsplit(":", 1)
    mngr = CheckpointManager(ckpt, max_to_keep=2)
    if mngr.latest_step() is not None:
      state = abstract  # run() resumes onto these shardings; no init needed
    else:
      if initial is None:
        state, _ = init_train_state(cfg, optimizer, mesh, rng=0, compiler_options=FAST)
        initial = jax.device_get(state)
      state = jax.tree.map(jax.device_put, initial, shardings)
    dataset = (grain.MapDataset.source([{"tokens": r} for r in rows])
               .shuffle(seed=11).repeat(None).batch(8))
    iterator = iter(dataset)
    losses, checksums, steps = [], [], []

    def on_metrics(s, m):
      if "loss" in m:
        steps.append(s)
        losses.append(m["loss"])
        checksums.append(m["batch_checksum"])

    state = train(state, step, iterator,
                  LoopConfig(int(num_steps), save_every=args.save_every, progress=False),
                  RunIO(checkpoint_manager=mngr, config={"model": cfg.to_dict(), "note": "test"},
                        on_metrics=on_metrics)).state
    mngr.close()
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state.params)
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(f"{args.out}{i}.npz", losses=np.asarray(losses), checksums=np.asarray(checksums),
             steps=np.asarray(steps), final_step=int(state.step), **flat)


def kill(args):
  from orbax.checkpoint._src.path import atomicity

  from opd.training.checkpoints import CheckpointManager

  mngr = CheckpointManager(args.ckpt, max_to_keep=3)
  mngr.save(1, {"w": jax.numpy.asarray(kill_values(1, args.small))})

  async def finalize_then_hang(self):
    # Step 2's arrays are in <dir>/2.orbax-checkpoint-tmp; the commit (rename)
    # has not happened. Tell the parent, then wait for SIGKILL.
    with open(args.marker, "w") as f:
      f.write(str(self.get()))
    time.sleep(600)

  atomicity.AtomicRenameTemporaryPath.finalize = finalize_then_hang
  mngr.save(2, {"w": jax.numpy.asarray(kill_values(2, args.large))})
  raise SystemExit("the save of step 2 finished; it should have been killed")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("mode", choices=["train", "kill"])
  ap.add_argument("--ckpt", help="kill: the checkpoint directory")
  ap.add_argument("--runs", help="train: DIR:NUM_STEPS[,DIR:NUM_STEPS...]")
  ap.add_argument("--save-every", type=int, default=5)
  ap.add_argument("--out")
  ap.add_argument("--marker")
  ap.add_argument("--small", type=int, default=1024)
  ap.add_argument("--large", type=int, default=1 << 23)
  args = ap.parse_args()
  train(args) if args.mode == "train" else kill(args)


if __name__ == "__main__":
  main()
