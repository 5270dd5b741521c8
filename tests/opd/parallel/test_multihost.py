"""Two jax processes on localhost (2 CPU devices each, gloo collectives) must
train exactly like one process with 4 devices.

Both runs are fresh subprocesses of tests/opd/multihost_worker.py (conftest's
8 devices do not apply to them). Each process of the 2-process job feeds only
its own rows of the batch; the mesh (1, 2, 2) puts the fsdp axis across the
two processes, so parameter all-gathers and gradient reduce-scatters cross
the process boundary.
"""
import os
import subprocess
import sys

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
  np.testing.assert_allclose(multi["losses"], single["losses"], rtol=0, atol=1e-5)
  names = sorted(k for k in single.files if k.startswith("["))
  assert names and names == sorted(k for k in multi.files if k.startswith("["))
  for name in names:
    np.testing.assert_allclose(multi[name], single[name], rtol=0, atol=1e-5, err_msg=name)
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
