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
import math
import os

import numpy as np
import pytest

import multihost_util
from opd.parallel import distributed

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
TIMEOUT_S = 240


def test_two_processes_match_one_process(tmp_path):
  multi, single, logs = multihost_util.run_two_vs_one(WORKER, tmp_path, TIMEOUT_S)
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
  # Params: within the AdamW drift bound (multihost_util.adamw_bound).
  bound = multihost_util.adamw_bound(single["lrs"], float(single["b1"]), float(single["b2"]),
                                     float(single["weight_decay"]))
  names = sorted(k for k in single.files if k.startswith("["))
  assert names and names == sorted(k for k in multi.files if k.startswith("["))
  for name in names:
    np.testing.assert_allclose(multi[name], single[name], rtol=0, atol=bound, err_msg=name)
  # ... and most elements (gradients well above the noise) far closer than that.
  gaps = np.concatenate([np.abs(multi[k] - single[k]).ravel() for k in names])
  assert np.median(gaps) <= bound * 3 * reorder_rtol
  # Both logs show process 1 took part with its own rows.
  assert "process 1: rows slice(4, 8" in multihost_util.read_log(logs[1])


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
