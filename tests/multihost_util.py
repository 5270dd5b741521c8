"""Shared by the local multi-process jax tests and their workers (not a test module).

``run_two_vs_one`` starts a worker script as a 2-process jax job on
localhost (2 CPU devices each, gloo collectives) and as one process with 4
devices, waits for all three and returns their ``.npz`` outputs;
``worker_args`` is the workers' command line (and joins the job);
``adamw_bound`` bounds how far two AdamW runs from equal params can drift.
Used by tests/opd/parallel/test_multihost.py and
tests/opd/distill/test_distill_multihost.py.
"""
import argparse
import math
import subprocess
import sys

import numpy as np


def _env(devices):
  # The caller's XLA flags (conftest's fast-compile flags, perturbed-tests'
  # ISA) with this device count; all three processes use the same setting.
  from subprocess_env import device_env
  return device_env(devices, JAX_PLATFORMS="cpu")


def read_log(path) -> str:
  with open(path) as f:
    return f.read()[-3000:]


def run_two_vs_one(worker: str, tmp_path, timeout_s: float):
  """``(multi, single, logs)``: the 2-process job's and the 1-process run's
  ``np.load``ed outputs and the three log paths (process 0, 1, single)."""
  from opd.parallel import distributed
  port = distributed.free_port()
  logs = [tmp_path / f"p{i}.log" for i in range(2)] + [tmp_path / "ref.log"]
  runs = [(["--num-processes", "2", "--process-id", str(i), "--port", str(port), "--out",
            str(tmp_path / "multi.npz")], 2) for i in range(2)]
  runs.append((["--num-processes", "1", "--out", str(tmp_path / "single.npz")], 4))
  procs = []
  for (args, devices), log_path in zip(runs, logs):
    log = open(log_path, "w")
    procs.append((subprocess.Popen([sys.executable, worker, *args], env=_env(devices),
                                   stdout=log, stderr=subprocess.STDOUT), log))
  try:
    for proc, _ in procs:
      proc.wait(timeout=timeout_s)
  finally:
    for proc, log in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      log.close()
  for (proc, _), log in zip(procs, logs):
    assert proc.returncode == 0, f"{log.name} exited {proc.returncode}:\n{read_log(log)}"
  return np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz"), logs


def worker_args():
  """Parses a worker's ``--num-processes/--process-id/--port/--out`` and
  joins the jax job (before anything creates jax backends)."""
  from opd.parallel import distributed
  ap = argparse.ArgumentParser()
  ap.add_argument("--num-processes", type=int, required=True)
  ap.add_argument("--process-id", type=int, default=0)
  ap.add_argument("--port", type=int, default=0)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id)
  return args


def adamw_bound(lrs, b1: float, b2: float, weight_decay: float) -> float:
  """Largest per-element gap two AdamW runs from equal params can open.

  AdamW moves an element by at most lr_t * |m_hat / sqrt(v_hat)| <= lr_t * A_t
  per step (Cauchy-Schwarz on the bias-corrected moment weights), whatever
  its gradient, so two runs differ by <= 2 lr_t A_t per step (a noise-level
  gradient may flip sign between them), grown by weight decay's (1 + lr wd).
  """
  bound = 0.0
  for t, lr in enumerate(lrs, start=1):
    i = np.arange(1, t + 1)
    a_t = math.sqrt(np.sum(((1 - b1) * b1 ** (t - i) / (1 - b1 ** t)) ** 2
                           / ((1 - b2) * b2 ** (t - i) / (1 - b2 ** t))))
    bound = bound * (1 + lr * weight_decay) + 2 * lr * a_t
  return bound
