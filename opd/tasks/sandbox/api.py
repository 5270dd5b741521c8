"""Sandbox for executing model-written programs (docs/DESIGN.md §7 "Sandbox", §9 code domain).

A program runs in a fresh subprocess with CPU-time, wall-time, memory,
output-size, file-size, open-file and process-count limits, in a private
temporary directory, and is killed with its whole process group when it
exceeds the wall time or the output cap. The caller is never affected: every
hazard comes back as a failed ``SandboxResult`` with a reason.

Isolation levels (``Sandbox.isolation``; ``"auto"`` picks the first that
works here, probed once per process; ``Sandbox.enforced`` lists the layers):

``"namespaces-root"`` (the caller is root with CAP_SYS_ADMIN)
  New mount, pid, network, IPC and UTS namespaces. Every mount is made
  read-only recursively (``mount_setattr``, Linux >= 5.12) and the work
  directory is a size-limited tmpfs, the only writable place. The network
  namespace has only a down loopback, so no connection can be made. The
  program runs as pid >= 2 under a tiny init; when init exits the kernel
  kills every process of the namespace, so nothing outlives the run. The
  program runs as an unprivileged uid, by default a fresh one per run drawn
  from ``[UID_BASE, UID_BASE + 2**20)`` (a range no real account uses): no
  capabilities, other users' files protected by permissions, and RLIMIT_NPROC
  enforced per run (the kernel exempts uid 0 from it and counts per uid, so a
  fresh uid is what makes the limit real and private to the run). If the
  interpreter lives under a directory that uid may not enter (pyenv under a
  0700 ``/root``), that directory is covered by an empty tmpfs in the
  namespace and only the interpreter prefix is bound back.
``"namespaces-user"`` (unprivileged user namespaces)
  The same inside a new user namespace mapping the caller's uid to 0 (a root
  caller first switches to the per-run uid); the program's capabilities are
  dropped with ``capset`` before it runs, and RLIMIT_NPROC counts per
  (user namespace, uid), i.e. per run.
``"rlimits"`` (no namespaces)
  Resource limits, a private work directory, process-group kill and, for a
  root caller whose interpreter other users can read, the uid drop. The
  kernel does NOT enforce here: network isolation, a read-only file system,
  or killing processes that leave the process group with ``setsid``.

Python guard (``python_guard=True``; Python programs only; every level): an
audit hook (``sys.addaudithook``; Python code cannot remove it) terminates the
program on process creation (``os.fork``, ``os.system``, ``os.exec*``,
``os.posix_spawn``, ``subprocess``), signals, sockets, ``ctypes``,
``resource.setrlimit`` and file-system writes (open for writing, rename,
remove, mkdir, chmod, ...) outside the work directory. It is defence in depth,
not a boundary: introspection can defeat Python-level hooks, so the kernel
layers above are the boundary wherever they are available.

Reads are restricted only by file permissions (and, as root, by the covering
tmpfs described above). The child side (namespaces, mounts, uid drop, rlimits, the guard) lives in
``opd.tasks.sandbox.launcher``, run as ``python -I -S sandbox_launcher.py CONFIG``
and kept to light imports because its start-up is paid on every run.
"""
import dataclasses
import marshal
import math
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

from opd.config.fields import check_float, check_int, set_field
from opd.tasks.sandbox import launcher as sandbox_launcher
from opd.tasks.sandbox.launcher import _FORBIDDEN_EXIT, _GUARD_MARK, _SETUP_EXIT, _blocked_ancestor

ISOLATION_LEVELS = ("namespaces-root", "namespaces-user", "rlimits")
UID_BASE = 0x5A000000  # per-run uids come from [UID_BASE, UID_BASE + 2**20)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Per-run resource limits.

  Attributes:
    cpu_s: CPU seconds (RLIMIT_CPU, rounded up to whole seconds; SIGKILL one
      second after SIGXCPU).
    wall_s: wall-clock seconds for the whole run, set-up included.
    memory_bytes: address-space limit of the program (RLIMIT_AS).
    output_bytes: stdout + stderr bytes kept; one more byte kills the run.
    file_bytes: largest file the program may write (RLIMIT_FSIZE) and, with
      namespaces, the size of the tmpfs work directory.
    max_processes: processes and threads the program's uid may have
      (RLIMIT_NPROC).
    max_open_files: RLIMIT_NOFILE.
  """
  cpu_s: float = 1.0
  wall_s: float = 2.0
  memory_bytes: int = 256 * 2**20
  output_bytes: int = 64 * 2**10
  file_bytes: int = 2**20
  max_processes: int = 8
  max_open_files: int = 64

  def __post_init__(self):
    for name in ("cpu_s", "wall_s"):
      set_field(self, name, check_float("SandboxLimits", name, getattr(self, name), min_value=0,
                                        min_exclusive=True))
    for name in ("memory_bytes", "output_bytes", "file_bytes", "max_processes",
                 "max_open_files"):
      set_field(self, name, check_int("SandboxLimits", name, getattr(self, name), min_value=1))
    if self.memory_bytes < 32 * 2**20:
      raise ValueError("SandboxLimits.memory_bytes must be >= 32 MiB (the interpreter alone "
                       f"maps about that much), got {self.memory_bytes}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome of one run.

  Attributes:
    ok: the program exited with status 0 and hit no limit.
    reason: ``"ok"``, ``"wall_time_limit"``, ``"cpu_time_limit"``,
      ``"memory_limit"``, ``"output_limit"``, ``"file_size_limit"``,
      ``"forbidden:<audit event>"``, ``"exit_code:<n>"``, ``"signal:<NAME>"``,
      or ``"sandbox_error:<message>"`` when the sandbox itself failed (an
      infrastructure error, not the program's fault).
    returncode: exit status, ``-signal`` if a signal ended it, ``None`` if it
      never ran or the parent killed it.
    stdout, stderr: captured output (UTF-8, undecodable bytes replaced).
    wall_s: seconds from launch to reaping.
    enforced: the isolation layers that applied.
    run_id: unique id; it is in the command line of every process of the run.
  """
  ok: bool
  reason: str
  returncode: int | None
  stdout: str
  stderr: str
  wall_s: float
  enforced: tuple[str, ...]
  run_id: str

  @property
  def infrastructure_error(self) -> bool:
    return self.reason.startswith("sandbox_error")


class Sandbox:
  """Runs programs under ``limits`` at one isolation level. Thread-safe."""

  def __init__(self, limits: SandboxLimits | None = None, *, isolation: str = "auto",
               python_guard: bool = True, sandbox_uid: int | None = None):
    """Creates a sandbox.

    Args:
      limits: resource limits (default ``SandboxLimits()``).
      isolation: ``"auto"`` or one of ``ISOLATION_LEVELS``; a level that does
        not work on this machine raises ValueError with the reason.
      python_guard: install the audit-hook guard in Python programs.
      sandbox_uid: uid (and gid) programs run as when the caller is root;
        None draws a fresh one per run from ``[UID_BASE, UID_BASE + 2**20)``,
        so concurrent runs never share an RLIMIT_NPROC budget.
    """
    self.limits = SandboxLimits() if limits is None else limits
    if not isinstance(self.limits, SandboxLimits):
      raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    if isolation == "auto":
      isolation = probe_isolation()
    elif isolation not in ISOLATION_LEVELS:
      raise ValueError(f"isolation must be 'auto' or one of {ISOLATION_LEVELS}, got {isolation!r}")
    elif problem := _level_problem(isolation):
      raise ValueError(f"isolation={isolation!r} is not available here: {problem}")
    self.isolation = isolation
    self.python_guard = bool(python_guard)
    if sandbox_uid is not None and (not isinstance(sandbox_uid, int) or sandbox_uid <= 0):
      raise ValueError(f"sandbox_uid must be a positive int or None, got {sandbox_uid!r}")
    self.sandbox_uid = sandbox_uid
    self._drops_uid = _drops_uid(isolation, sandbox_uid)

  @property
  def enforced(self) -> tuple[str, ...]:
    """The layers every run gets (see the module docstring)."""
    layers = ["rlimit_cpu", "rlimit_address_space", "rlimit_file_size", "rlimit_open_files",
              "wall_timeout_kill_process_group", "output_cap", "private_workdir", "no_new_privs"]
    if self._drops_uid:
      layers.append("uid_drop")
    if self.isolation != "rlimits":
      layers += ["pid_namespace", "network_namespace", "mount_namespace_readonly_root",
                 "tmpfs_workdir", "capabilities_dropped"]
    if self._drops_uid or self.isolation == "namespaces-user":
      layers.append("rlimit_nproc")
    elif os.geteuid() != 0:
      # Shared with the caller's own processes: the limit is set to their
      # current count + max_processes.
      layers.append("rlimit_nproc_shared_with_caller")
    # (else root keeping uid 0: the kernel exempts it from RLIMIT_NPROC.)
    if self.python_guard:
      layers.append("python_audit_guard")
    return tuple(layers)

  def run_python(self, source: str, *, stdin: str = "",
                 files: Mapping[str, str] | None = None) -> SandboxResult:
    """Runs Python ``source`` as ``__main__`` (standard library only).

    Args:
      source: program text.
      stdin: text on the program's standard input.
      files: extra files ``{relative path: text}`` placed in the work directory.
    """
    if not isinstance(source, str):
      raise ValueError(f"source must be str, got {type(source).__name__}")
    return self._run({"python": source}, stdin, files)

  def run(self, argv: Sequence[str], *, stdin: str = "",
          files: Mapping[str, str] | None = None) -> SandboxResult:
    """Runs an executable found on PATH; the Python guard does not apply."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
      raise ValueError(f"argv must be a non-empty sequence of str, got {argv!r}")
    return self._run({"argv": list(argv)}, stdin, files)

  def _run(self, program: dict, stdin: str, files: Mapping[str, str] | None) -> SandboxResult:
    if not isinstance(stdin, str):
      raise ValueError(f"stdin must be str, got {type(stdin).__name__}")
    files = dict(files or {})
    for name, text in files.items():
      if (not isinstance(name, str) or not name or name.startswith(("/", ".sandbox"))
          or ".." in name.split("/")):
        raise ValueError(f"files: {name!r} must be a relative path inside the work directory")
      if not isinstance(text, str):
        raise ValueError(f"files[{name!r}] must be str, got {type(text).__name__}")
    run_id = uuid.uuid4().hex
    base = tempfile.mkdtemp(prefix=f"opd-sandbox-{run_id}-")
    try:
      return self._run_in(base, run_id, program, stdin, files)
    finally:
      shutil.rmtree(base, ignore_errors=True)

  def _run_in(self, base, run_id, program, stdin, files) -> SandboxResult:
    workdir = os.path.join(base, "work")
    os.mkdir(workdir, 0o700)
    drop_uid = None
    if self._drops_uid:
      drop_uid = self.sandbox_uid or UID_BASE + random.randrange(2**20)
    if drop_uid is not None:
      os.chmod(base, 0o711)  # the dropped uid must reach its directory by path
      if self.isolation != "namespaces-root":  # (there, the tmpfs gets the owner)
        os.chown(workdir, drop_uid, drop_uid)
    status_r, status_w = os.pipe()
    cfg = {"mode": self.isolation, "workdir": workdir, "base": base, "program": program,
           "stdin": stdin, "files": files, "status_fd": status_w, "drop_uid": drop_uid,
           "guard": self.python_guard, "limits": dataclasses.asdict(self.limits),
           "python_prefixes": [os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)]}
    cfg_path = os.path.join(base, "config.marshal")
    with open(os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
      marshal.dump(cfg, f)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
           "TMPDIR": workdir, "PYTHONIOENCODING": "utf-8"}
    start = time.monotonic()
    try:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-B", os.path.abspath(sandbox_launcher.__file__), cfg_path, run_id],
          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          pass_fds=(status_w,), start_new_session=True, env=env, cwd=base)
    except OSError as e:
      os.close(status_r)
      return SandboxResult(False, f"sandbox_error:launch failed: {e}", None, "", "",
                           time.monotonic() - start, self.enforced, run_id)
    finally:
      os.close(status_w)
    try:
      out, err, killed = _collect(proc, start + self.limits.wall_s, self.limits.output_bytes)
    finally:
      _kill_group(proc.pid)
      proc.wait()
      status = _read_all(status_r)
      os.close(status_r)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    reason, returncode = _classify(killed, status, proc.returncode, stderr, self.limits)
    return SandboxResult(reason == "ok", reason, returncode, stdout, stderr,
                         time.monotonic() - start, self.enforced, run_id)


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
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
        _kill_group(proc.pid)
    if killed is None:
      try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        killed = "wall_time_limit"
  finally:
    sel.close()
    if killed:
      _kill_group(proc.pid)
    for pipe in bufs:
      pipe.close()
  return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), killed


def _kill_group(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _read_all(fd: int) -> str:
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


def _classify(killed: str | None, status: str, launcher_rc: int | None, stderr: str,
              limits: SandboxLimits) -> tuple[str, int | None]:
  """(reason, returncode) from the parent's kill, the status line and stderr."""
  if killed:
    return killed, None
  lines = status.strip().splitlines()
  if not lines:
    return f"sandbox_error:no status (launcher exit {launcher_rc}): {stderr[-300:]!r}", None
  kind, _, rest = lines[-1].partition(" ")
  if kind == "setup_error":
    return f"sandbox_error:{rest}", None
  value, cpu = rest.split()
  value, cpu = int(value), float(cpu)
  tail = stderr[-2000:]
  if kind == "signal":
    if value == signal.SIGXCPU or (value == signal.SIGKILL and cpu >= math.ceil(limits.cpu_s) - 0.05):
      return "cpu_time_limit", -value
    if value == signal.SIGXFSZ:
      return "file_size_limit", -value
    try:
      return f"signal:{signal.Signals(value).name}", -value
    except ValueError:
      return f"signal:{value}", -value
  if value == 0:
    return "ok", 0
  if value == _FORBIDDEN_EXIT and _GUARD_MARK in stderr:
    return f"forbidden:{(stderr.rsplit(_GUARD_MARK, 1)[1].split() or ['?'])[0]}", value
  if value == _SETUP_EXIT and "sandbox worker set-up failed" in tail:
    return f"sandbox_error:{tail.strip().splitlines()[-1]}", value
  if "MemoryError" in tail or "Cannot allocate memory" in tail:
    return "memory_limit", value
  if "File too large" in tail:
    return "file_size_limit", value
  return f"exit_code:{value}", value


# ----------------------------------------------------------------------------
# Which isolation level works here (probed once per process).

_PROBE_LOCK = threading.Lock()
_PROBE_CACHE: dict[str, str | None] = {}


def _drops_uid(level: str, sandbox_uid: int | None) -> bool:
  """Whether programs at ``level`` run under a uid of their own."""
  if os.geteuid() != 0:
    return False
  if level == "rlimits":
    # No mount namespace to expose the interpreter with: it must be readable as is.
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    return not any(_blocked_ancestor(p, sandbox_uid or UID_BASE) for p in prefixes)
  return True


def _level_problem(level: str) -> str | None:
  """None when ``level`` works here, else why not."""
  with _PROBE_LOCK:
    if level not in _PROBE_CACHE:
      _PROBE_CACHE[level] = _try_level(level)
    return _PROBE_CACHE[level]


def _try_level(level: str) -> str | None:
  if level == "rlimits":
    return None
  if not sys.platform.startswith("linux"):
    return f"namespaces need Linux, this is {sys.platform}"
  if level == "namespaces-root" and os.geteuid() != 0:
    return "not running as root"
  sandbox = object.__new__(Sandbox)
  sandbox.limits, sandbox.isolation, sandbox.python_guard = SandboxLimits(wall_s=10.0), level, False
  sandbox.sandbox_uid = None
  sandbox._drops_uid = _drops_uid(level, None)
  # Importing a module the launcher has not loaded proves the program can
  # still read the standard library after the uid drop.
  result = sandbox.run_python("import fractions; print('probe-ok')")
  if result.ok and result.stdout.strip() == "probe-ok":
    return None
  return f"{result.reason} {result.stderr[-300:]!r}"


def probe_isolation() -> str:
  """The strongest isolation level that works on this machine."""
  order = ("namespaces-root", "namespaces-user") if os.geteuid() == 0 else ("namespaces-user",)
  return next((level for level in order if _level_problem(level) is None), "rlimits")


def isolation_report() -> dict[str, str]:
  """``{level: "available" or the reason it is not}`` for every level."""
  return {level: _level_problem(level) or "available" for level in ISOLATION_LEVELS}
