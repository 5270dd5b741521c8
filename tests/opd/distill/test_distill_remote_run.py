"""A whole ``train_opd`` run whose out-of-process teacher is SIGKILLed mid-run.

Two teachers: ``ta`` in process and ``tr`` served by ``opd.distill.server``
(its head still comes from the in-process pool, built from the same seed).
After step K the server is killed; the run finishes every step, ``tr``'s
skips (reason ``"error"``) count up from step K + 1, and ``ta`` carries all
of the weight from then on.
"""
import json
import os
import shutil
import signal
import tempfile

import numpy as np
import pytest

from opd.distill.server import RemoteTeacher, launch
from opd.distill.teachers import Teacher, TeacherPool
from opd.training.metrics_writer import read_metrics

from test_distill_trainer import (OPD, WIDE, V, _run, favouring_teacher, LOWER,  # noqa: F401
                                  mesh, student)

STEPS, KILL_AFTER, SEED = 4, 2, 5


def test_a_sigkilled_teacher_server_costs_skips_never_the_run(mesh, student, tmp_path):
  tmp = tempfile.mkdtemp(prefix="opd", dir="/tmp")  # Unix socket paths are short
  sock = os.path.join(tmp, "tr.sock")
  proc = launch(sock, "tr", json.dumps(WIDE.to_dict()), seed=SEED)
  try:
    remote = RemoteTeacher(sock, timeout_s=1.0)
    assert remote.width(V) == WIDE.d_model
    pool = TeacherPool([favouring_teacher("ta", 1, "alpha", LOWER),
                        Teacher.random("tr", WIDE, SEED)], V, mesh)
    killed_at = []

    def kill_after_k(step, metrics):
      if step == KILL_AFTER:
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        killed_at.append(step)

    run = _run(student, pool, mesh, STEPS, cfg=OPD.replace(weighting=dict(schedule="uniform")),
               teacher_fns={"tr": remote}, on_metrics=kill_after_k, workdir=tmp_path)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
  assert killed_at == [KILL_AFTER] and int(run.state.step) == STEPS
  assert pool.forward_count["tr"] == 0  # every "tr" answer came from the server
  rows = read_metrics(tmp_path)
  assert len(rows) == len(run.history) == STEPS
  want_skips = [max(0, s - KILL_AFTER) for s in range(1, STEPS + 1)]
  assert [r["skips/tr/error"] for r in rows] == want_skips
  assert [r["skips/ta/error"] for r in rows] == [0] * STEPS
  for s, r in enumerate(rows, start=1):
    alive = s <= KILL_AFTER
    assert r["weight/ta"] == pytest.approx(0.5 if alive else 1.0)
    assert r["weight/tr"] == pytest.approx(0.5 if alive else 0.0, abs=1e-7)
    assert r["opd/skipped_step"] == 0 and r["opd/masked_rows"] == 0
    assert np.isfinite(r["train/loss"]) and r["train/opd_tokens"] > 0
