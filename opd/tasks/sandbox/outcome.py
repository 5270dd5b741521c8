"""The caller's side of one run: reading the child's output and classifying the outcome.

Trust: a run is an infrastructure error (``sandbox_error:...``) only on the
word of the launcher's private status pipe or of the caller itself (launch
failure, no status at all). The pipe's write end is held by the launcher and
its supervisor, never by the program (the worker closes its copy before the
program starts; the supervisor is non-dumpable and, with namespaces or a
uid drop, out of the program's reach). Reasons that score the program as
failed (``exit_code``, ``memory_limit``, ``forbidden``...) may come from its
stderr or exit status, since imitating them can only cost it reward.
"""
import math
import os
import selectors
import signal
import subprocess
import time

from opd.tasks.sandbox.guard import FORBIDDEN_EXIT, GUARD_MARK


def collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
  """Reads stdout/stderr until EOF, the deadline or the output cap.

  Once the launcher has exited its process group is killed, so pipes held
  open by stragglers (possible in "rlimits" mode) cannot stall the run.
  """
  bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
  sel = selectors.DefaultSelector()
  for pipe in bufs:
    os.set_blocking(pipe.fileno(), False)
    sel.register(pipe, selectors.EVENT_READ)
  killed, total, reaped = None, 0, False
  try:
    while sel.get_map() and killed is None:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        killed = "wall_time_limit"
        break
      for key, _ in sel.select(timeout=min(remaining, 0.05)):
        chunk = os.read(key.fd, 65536)
        if not chunk:
          sel.unregister(key.fileobj)
          continue
        bufs[key.fileobj] += chunk[:max(0, cap - total)]
        total += len(chunk)
        if total > cap:
          killed = "output_limit"
          break
      if not reaped and proc.poll() is not None:
        reaped = True
        kill_group(proc.pid)
    if killed is None:
      try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        killed = "wall_time_limit"
  finally:
    sel.close()
    if killed:
      kill_group(proc.pid)
    for pipe in bufs:
      pipe.close()
  return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), killed


def kill_group(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def read_all(fd: int) -> str:
  os.set_blocking(fd, False)
  chunks = []
  while True:
    try:
      chunk = os.read(fd, 4096)
    except BlockingIOError:
      break
    if not chunk:
      break
    chunks.append(chunk)
  return b"".join(chunks).decode("utf-8", "replace")


def classify(killed: str | None, status: str, stderr: str, *, cpu_limit_s: float,
             oom_kills: int, supervisor_reachable: bool) -> tuple[str, int | None]:
  """(reason, returncode) of a run.

  Args:
    killed: the caller's own verdict (``"wall_time_limit"``, ``"output_limit"``) or None.
    status: text of the private status pipe: ``setup_error MSG`` lines from
      the launcher or worker before the program started, ``started`` when
      it did, then the supervisor's ``exit|signal N CPU_S`` (or ``disrupted
      MSG`` when the supervisor itself met an exception while the program ran).
    stderr: the program's stderr (only for reasons charged to the program).
    cpu_limit_s: ``SandboxLimits.cpu_s``.
    oom_kills: processes the run's cgroup killed for memory (0 without one).
    supervisor_reachable: the program runs as the supervisor's uid without
      namespaces, so it could kill it: a lost status is then its doing.
  """
  if killed:
    return killed, None
  lines = status.splitlines()
  setup = [ln for ln in lines if ln.startswith("setup_error ")]
  if setup:
    return f"sandbox_error:{setup[0][len('setup_error '):]}", None
  if any(ln.startswith("disrupted ") for ln in lines):
    # The supervisor met an exception while the program ran: only the program
    # can have caused it (docs/DESIGN.md §7), so the run is its failure.
    return "supervisor_disrupted", None
  final = [ln.split() for ln in lines if ln.startswith(("exit ", "signal "))]
  if not final:
    if "started" not in lines:
      return "sandbox_error:no status from the launcher", None
    if oom_kills:
      return "memory_limit", None
    if supervisor_reachable:
      return "supervisor_killed", None
    return "sandbox_error:the supervisor vanished while the program ran", None
  kind, value, cpu = final[-1][0], int(final[-1][1]), float(final[-1][2])
  returncode = -value if kind == "signal" else value
  if oom_kills:
    return "memory_limit", returncode
  tail = stderr[-2000:]
  if kind == "signal":
    if value == signal.SIGXCPU or (value == signal.SIGKILL and cpu >= math.ceil(cpu_limit_s) - 0.05):
      return "cpu_time_limit", returncode
    if value == signal.SIGXFSZ:
      return "file_size_limit", returncode
    try:
      return f"signal:{signal.Signals(value).name}", returncode
    except ValueError:
      return f"signal:{value}", returncode
  if value == 0:
    return "ok", 0
  if value == FORBIDDEN_EXIT and GUARD_MARK in stderr:
    return f"forbidden:{(stderr.rsplit(GUARD_MARK, 1)[1].split() or ['?'])[0]}", value
  if "MemoryError" in tail or "Cannot allocate memory" in tail:
    return "memory_limit", value
  if "File too large" in tail:
    return "file_size_limit", value
  return f"exit_code:{value}", value
