"""Child process for tests/opd/training/test_crash_safety.py (not a test module).

Trains a tiny decoder on one device with ``opd.training.loop.train`` for
``--steps`` steps, the way the experiment jobs do: a ``MetricWriter`` on
``--workdir`` fed through ``on_metrics`` (not handed to ``run``),
checkpoints under ``<workdir>/checkpoints`` every ``--save-every`` steps with
keep-best by ``eval/loss`` (eval every ``--eval-every`` steps), a shuffled
grain dataset whose position is checkpointed, and a ``first_metrics`` dict.
Resumes from the directory's latest checkpoint if there is one.

``--die MODE:K`` ends the process at step K:

* ``save:K``: SIGKILL inside the save of step K (its files written, the
  commit, Orbax's rename, not yet done);
* ``row:K``: SIGKILL in the middle of writing step K's ``metrics.jsonl``
  line (half of it written and flushed: a torn line);
* ``step:K``: SIGKILL right after step K's metrics are reported;
* ``term:K``: SIGTERM sent to itself after step K's metrics are reported
  (the loop checkpoints and exits).

At the end, writes ``--out`` (JSON): the final step, the checksums of the
final state and ``first_metrics``.
"""
import argparse
import json
import logging
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

CFG_KW = dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32)
FAST = {"xla_backend_optimization_level": 0}


def _kill_self(sig=signal.SIGKILL):
  os.kill(os.getpid(), sig)


def _arm(mode: str, at: int):
  """Patches the point where ``mode`` kills the process at step ``at``."""
  if mode == "save":
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_or_die(self, *a, **k):
      if os.path.basename(str(self.get())).split(".")[0] == str(at):
        _kill_self()
      return await finalize(self, *a, **k)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die
  elif mode == "row":
    from opd.training.metrics_writer import MetricWriter
    write = MetricWriter._write_pending

    def write_or_tear(self):
      if self._pending["step"] == at:
        line = json.dumps(self._pending) + "\n"
        self._jsonl.write(line[:len(line) // 2])
        self._jsonl.flush()
        _kill_self()
      write(self)

    MetricWriter._write_pending = write_or_tear


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--steps", type=int, required=True)
  ap.add_argument("--save-every", type=int, default=2)
  ap.add_argument("--eval-every", type=int, default=5)
  ap.add_argument("--die", default="")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  logging.basicConfig(level=logging.WARNING, stream=sys.stdout)

  import grain
  import jax.numpy as jnp

  from opd.models import ModelConfig
  from opd.parallel import sharding
  from opd.training.checkpoints import CheckpointManager
  from opd.training.integrity import tree_checksums
  from opd.training.loop import LoopConfig, RunIO, train
  from opd.training.metrics_writer import MetricWriter
  from opd.training.objectives import next_token_loss
  from opd.training.train_step import (OptimConfig, abstract_train_state, init_train_state,
                                       make_optimizer, make_train_step)

  mode, at = (args.die.split(":")[0], int(args.die.split(":")[1])) if args.die else ("", -1)
  _arm(mode, at)
  cfg = ModelConfig(**CFG_KW)
  optimizer = make_optimizer(OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=8,
                                         schedule="cosine", weight_decay=0.1))
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  loss_fn = next_token_loss(cfg)
  ckpt = os.path.join(args.workdir, "checkpoints")
  mngr = CheckpointManager(ckpt, max_to_keep=2, keep_best=1, best_metric="eval/loss")
  if mngr.latest_step() is not None:
    state, shardings = abstract_train_state(cfg, optimizer, mesh)
  else:
    state, shardings = init_train_state(cfg, optimizer, mesh, rng=0, compiler_options=FAST)
  step_fn = make_train_step(loss_fn, optimizer, mesh, shardings, compiler_options=FAST)
  rows = np.random.default_rng(3).integers(0, cfg.vocab_size, (24, 9)).astype(np.int32)
  held = {"tokens": np.random.default_rng(4).integers(0, cfg.vocab_size, (4, 9)).astype(np.int32)}
  eval_loss = jax.jit(lambda p: loss_fn(p, held, jax.random.key(0))[0])
  dataset = (grain.MapDataset.source([{"tokens": r} for r in rows])
             .shuffle(seed=11).repeat(None).batch(4))
  first = {}
  with MetricWriter(args.workdir, tensorboard=False) as writer:

    def on_metrics(step, metrics):
      writer.write_scalars(step, metrics)
      if step == at and mode == "step":
        _kill_self()
      if step == at and mode == "term":
        _kill_self(signal.SIGTERM)

    state = train(state, step_fn, iter(dataset),
                  LoopConfig(args.steps, save_every=args.save_every, eval_every=args.eval_every,
                             progress=False),
                  RunIO(checkpoint_manager=mngr, eval_fn=lambda p: {"loss": eval_loss(p)},
                        config={"model": cfg.to_dict(),
                                "experiment": {"train": {"steps": args.steps}}},
                        on_metrics=on_metrics, first_metrics=first)).state
  mngr.close()
  with open(args.out, "w") as f:
    json.dump({"step": int(state.step), "checksums": tree_checksums(state),
               "first_metrics": {str(k): v for k, v in first.items()},
               "train_loss_first": first[1]["loss"]}, f)


if __name__ == "__main__":
  main()
