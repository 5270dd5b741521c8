"""Two jax processes on localhost (2 CPU devices each, gloo collectives) must
train like one process with 4 devices, up to float32 reduction order (gloo's
cross-process sums need not add in XLA's order): the same first-step
gradients within an eps-derived relative tolerance, and params after 3 AdamW
steps within a bound derived from the learning rates (see
tests/opd/training/test_train_step.py and docs/DEVELOPING.md, "Choosing
tolerances").

Both runs are fresh subprocesses of tests/opd/parallel/multihost_worker.py (conftest's
8 devices do not apply to them). Each process of the 2-process job feeds only
its own rows of the batch; the mesh (1, 2, 2) puts the fsdp axis across the
two processes, so parameter all-gathers and gradient reduce-scatters cross
the process boundary.
"""
import os
import subprocess
import sys

import math

import numpy as np
import pytest

from opd.parallel import distributed

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
TIMEOUT_S = 240


def _env(devices):
  env = os.environ.copy()
  # Level 0: compile time dominates this tiny model, and all three processes
  # use the same setting.
  env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                      "--xla_backend_optimization_level=0")
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _launch(args, devices, log_path):
  log = open(log_path, "w")
  proc = subprocess.Popen([sys.executable, WORKER, *args], env=_env(devices), stdout=log,
                          stderr=subprocess.STDOUT)
  return proc, log


def _wait_all(procs):
  try:
    for proc, log in procs:
      proc.wait(timeout=TIMEOUT_S)
  finally:
    for proc, log in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      log.close()


def _read(path):
  with open(path) as f:
    return f.read()[-3000:]


def test_two_processes_match_one_process(tmp_path):
  port = distributed.free_port()
  logs = [tmp_path / f"p{i}.log" for i in range(2)] + [tmp_path / "ref.log"]
  procs = [
      _launch(["--num-processes", "2", "--process-id", str(i), "--port", str(port),
               "--out", str(tmp_path / "multi.npz")], 2, logs[i]) for i in range(2)]
  procs.append(_launch(["--num-processes", "1", "--out", str(tmp_path / "single.npz")], 4, logs[2]))
  _wait_all(procs)
  for (proc, _), log in zip(procs, logs):
    assert proc.returncode == 0, f"{log.name} exited {proc.returncode}:\n{_read(log)}"

  multi, single = np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz")
  assert int(multi["processes"]) == 2 and int(single["processes"]) == 1
  # Process 0 fed rows [0, 4) only; the single process fed all 8.
  assert multi["rows"].tolist() == [0, 4] and single["rows"].tolist() == [0, 8]
  # Loss and gradient elements are sums of <= n = tokens * V rounded terms
  # (V = 128, the longest contraction); reordered float32 sums differ by
  # ~sqrt(n) eps relative, and the backward chains ~8 sums in quadrature (x3).
  eps = float(np.finfo(np.float32).eps)
  reorder_rtol = math.sqrt(int(single["tokens"]) * int(single["vocab"])) * eps
  np.testing.assert_allclose(multi["losses"][0], single["losses"][0], rtol=reorder_rtol)
  grad_names = sorted(k for k in single.files if k.startswith("grad["))
  assert grad_names and grad_names == sorted(k for k in multi.files if k.startswith("grad["))
  diff = math.sqrt(sum(np.sum(np.square(multi[k] - single[k], dtype=np.float64)) for k in grad_names))
  norm = math.sqrt(sum(np.sum(np.square(single[k], dtype=np.float64)) for k in grad_names))
  assert diff < 3 * reorder_rtol * norm
  # AdamW moves an element by at most lr_t * |m_hat / sqrt(v_hat)| <= lr_t * A_t
  # per step (Cauchy-Schwarz on the bias-corrected moment weights), whatever
  # its gradient, so two runs from equal params differ by <= 2 lr_t A_t per
  # step: a noise-level gradient may flip sign between the runs.
  b1, b2, wd = float(single["b1"]), float(single["b2"]), float(single["weight_decay"])
  bound = 0.0
  for t, lr in enumerate(single["lrs"], start=1):
    i = np.arange(1, t + 1)
    a_t = math.sqrt(np.sum(((1 - b1) * b1 ** (t - i) / (1 - b1 ** t)) ** 2
                           / ((1 - b2) * b2 ** (t - i) / (1 - b2 ** t))))
    bound = bound * (1 + lr * wd) + 2 * lr * a_t
  names = sorted(k for k in single.files if k.startswith("["))
  assert names and names == sorted(k for k in multi.files if k.startswith("["))
  for name in names:
    np.testing.assert_allclose(multi[name], single[name], rtol=0, atol=bound, err_msg=name)
  # ... and most elements (gradients well above the noise) far closer than that.
  gaps = np.concatenate([np.abs(multi[k] - single[k]).ravel() for k in names])
  assert np.median(gaps) <= bound * 3 * reorder_rtol
  # Both logs show process 1 took part with its own rows.
  assert "process 1: rows slice(4, 8" in _read(logs[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(coordinator_address="127.0.0.1:1", num_processes=0, process_id=0), "num_processes"),
    (dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2),
     r"process_id .*\[0, 2\)"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0), "host:port"),
    (dict(coordinator_address="h:99999", num_processes=2, process_id=0), "host:port"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=0, cpu_collectives="nccl"),
     "cpu_collectives"),
])
def test_initialize_validates_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    distributed.initialize(**kwargs)


def test_single_process_helpers():
  distributed.initialize(None, 1, 0)  # a no-op with one process
  assert distributed.is_main_process() and distributed.process_count() == 1
  import jax.numpy as jnp
  out = distributed.gather_to_host({"x": jnp.arange(4)})
  np.testing.assert_array_equal(out["x"], np.arange(4))
