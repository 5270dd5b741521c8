"""Out-of-process teachers: a SIGKILLed teacher server costs skipped batches, never the caller."""
import json
import os
import shutil
import signal
import tempfile
import threading
import time

import numpy as np
import pytest

import jax

from opd.distill import FaultTolerantTeachers, Teacher, TeacherPool
from opd.distill.server import RemoteTeacher, launch
from opd.models import ModelConfig
from opd.parallel import sharding

EPS32 = np.finfo(np.float32).eps
V, B, T = 64, 2, 6
CFG = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
DELAY = 2.0  # the server sleeps this long before each answer: time to kill it mid-call


def test_sigkill_mid_call_is_an_error_skip_and_the_local_teacher_carries_on():
  # Unix socket paths are limited to ~100 bytes: keep it short.
  tmp = tempfile.mkdtemp(prefix="opd", dir="/tmp")
  sock = os.path.join(tmp, "t.sock")
  proc = launch(sock, "remote", json.dumps(CFG.to_dict()), seed=3, delay_s=DELAY)
  try:
    remote = RemoteTeacher(sock, timeout_s=1.0)
    with pytest.raises(ValueError, match="vocab_size=64 but the student has vocab_size=65"):
      remote.width(V + 1)
    pool = TeacherPool([Teacher.random("local", CFG, 1), Teacher.random("same", CFG, 3)], V,
                       sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    killers = []

    def remote_call(t, m):
      if killers:  # armed: SIGKILL the server while it works on this very call
        killers[0].start()
      return remote(t, m)

    ft = FaultTolerantTeachers(
        {"local": lambda t, m: pool.hidden_one("local", t, m), "remote": remote_call},
        {"local": CFG.d_model, "remote": remote.width(V)}, deadline_s=60.0)
    tokens = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    first = ft(tokens, mask)
    assert first.available.all() and not first.skipped
    # The server holds the same teacher as the in-process "same": same hidden states
    # up to the float32 rounding of another process's compilation.
    ref = np.asarray(pool.hidden_one("same", tokens, mask))
    np.testing.assert_allclose(first.hidden["remote"], ref, rtol=0,
                               atol=16 * CFG.d_model * EPS32 * np.abs(ref).max())

    killers.append(threading.Timer(DELAY / 2, os.kill, (proc.pid, signal.SIGKILL)))
    second = ft(tokens, mask)
    killers.pop().join()
    assert proc.wait(10) == -signal.SIGKILL
    assert second.skipped == {"remote": "error"}
    assert "EOFError" in second.messages["remote"]  # the connection died mid-call
    assert second.available[:, 0].all() and not second.available[:, 1].any()
    np.testing.assert_array_equal(second.hidden["remote"], 0.0)
    third = ft(tokens, mask)  # nobody listens any more: refused, skipped again
    assert third.skipped == {"remote": "error"} and third.batch_ok
    assert "ConnectionRefusedError" in third.messages["remote"]
    assert ft.counter.metrics(ft.names)["skips/remote/error"] == 2
    assert ft.counter.metrics(ft.names)["skips/local/error"] == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)


def _open_fds() -> int:
  return len(os.listdir("/proc/self/fd"))


def _settles(baseline, within_s):
  """Polls until (threads, fds) is back to ``baseline``; returns the last reading."""
  end = time.monotonic() + within_s
  while True:
    now = (threading.active_count(), _open_fds())
    if now == baseline or time.monotonic() > end:
      return now
    time.sleep(0.05)


def test_a_hung_server_is_survived_and_its_threads_and_sockets_are_reclaimed(caplog):
  """The server sleeps HANG s before every answer (hung, not dead). Read
  timeout below the deadline: each call is an ``"error"`` skip (TimeoutError)
  ending by itself; read timeout above a shorter deadline: a ``"timeout"``
  skip whose thread ends at the read timeout. Either way the thread count and
  the open descriptors return to their values before the calls (the old
  client blocked in recv until the server answered: HANG s per call)."""
  hang = 60.0
  tmp = tempfile.mkdtemp(prefix="opd", dir="/tmp")
  sock = os.path.join(tmp, "h.sock")
  proc = launch(sock, "hung", json.dumps(CFG.to_dict()), seed=3, delay_s=hang)
  try:
    pool = TeacherPool([Teacher.random("local", CFG, 1)], V,
                       sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    tokens = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    local = lambda t, m: pool.hidden_one("local", t, m)
    local(tokens, mask)  # compile before the baseline
    baseline = (threading.active_count(), _open_fds())

    remote = RemoteTeacher(sock, timeout_s=0.5, read_timeout_s=0.5)
    ft = FaultTolerantTeachers({"local": local, "remote": remote},
                               {"local": CFG.d_model, "remote": CFG.d_model}, deadline_s=5.0)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="opd.distill.faults"):
      for _ in range(3):  # the 2nd and 3rd queue behind the 1st in the accept backlog
        answers = ft(tokens, mask)
        assert answers.skipped == {"remote": "error"} and answers.available[:, 0].all()
        assert "TimeoutError" in answers.messages["remote"]
    assert time.monotonic() - start < 3 * (0.5 + 0.5) + 5  # bounded by the timeouts
    assert "'remote' skipped (error): TimeoutError" in caplog.text
    assert ft.abandoned == 0
    assert _settles(baseline, 5.0) == baseline

    slow_read = RemoteTeacher(sock, timeout_s=0.5, read_timeout_s=1.5)
    short = FaultTolerantTeachers({"remote": slow_read}, {"remote": CFG.d_model},
                                  deadline_s=0.2)
    answers = short(tokens, mask)
    assert answers.skipped == {"remote": "timeout"} and short.abandoned == 1
    assert short.abandoned_alive() == 1  # still waiting on the socket ...
    assert _settles(baseline, 5.0) == baseline  # ... until its read timeout closes it
    assert short.abandoned_alive() == 0
    assert proc.poll() is None  # the server is hung, not dead
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
