"""Sandbox for executing model-written programs (docs/DESIGN.md §7 "Sandbox", §9 code domain).

A program runs in a fresh subprocess with CPU-time, wall-time, memory,
output-size, file-size, open-file and process-count limits, and is killed
with everything it started when it exceeds the wall time or the output cap.
The caller is never affected: every hazard comes back as a failed
``SandboxResult`` with a reason.

Isolation levels (``Sandbox.isolation``; ``"auto"`` picks the first that
works here, probed once per process; ``Sandbox.enforced`` lists the layers,
``Sandbox.provides`` the kernel-enforced properties of ``KERNEL_ISOLATION``):

``"namespaces-root"`` (the caller is root with CAP_SYS_ADMIN)
  New mount, pid, network, IPC and UTS namespaces and a minimal root built
  the way bubblewrap builds one: a small tmpfs holding read-only binds of
  ``/usr`` (with the ``/bin``, ``/lib*`` links or directories), the
  dynamic-linker cache and the interpreter's prefix; ``/dev`` with only
  ``null``, ``zero`` and ``urandom``; a fresh procfs of the run's pid
  namespace (only the run's own processes are visible); and the work
  directory ``/sandbox``, a size-limited tmpfs and the only writable place.
  The host root is detached (``pivot_root``): no ``/tmp``, ``/run``, home,
  ``workdirs``, or socket file of the host exists for the program, and the
  network namespace has only a down loopback (abstract Unix sockets are per
  network namespace too), so no connection can be made. The program runs as
  pid >= 2 under a tiny init; when init exits the kernel kills every process
  of the namespace. It runs as an unprivileged uid, by default a fresh one
  per run from ``[UID_BASE, UID_BASE + 2**20)`` (a range no real account
  uses): no capabilities, and RLIMIT_NPROC per run (the kernel exempts uid 0
  and counts per uid).
``"namespaces-user"`` (unprivileged user namespaces)
  The same root and namespaces inside a new user namespace mapping the
  caller's uid (a root caller first switches to the per-run uid) to 0; the
  program's capabilities are dropped with ``capset`` before it runs.
``"rlimits"`` (no namespaces; weaker, see below)
  Resource limits, a private work directory, process-group kill and the
  uid drop. It never runs a program as root: for a root caller whose
  interpreter the per-run uid cannot read (pyenv under a 0700 ``/root``)
  the level is unavailable. The kernel does NOT enforce here: file-system
  or network isolation, or killing processes that leave the process group
  with ``setsid`` (a per-run cgroup, where there is one, still kills them).

Fail closed: a ``Sandbox`` requires ``KERNEL_ISOLATION`` unless told
otherwise (``require=``; ``CodeTask`` requires it too) and raises
``IsolationUnavailable`` at construction when the level lacks any of it,
naming what is missing and how to get it, unless ``allow_weaker=True``,
which logs a warning naming the level and runs with what is there. Asking for
``isolation="rlimits"`` by name is the other explicit opt-in (also logged).

Seccomp filter (every level; ``opd.tasks.sandbox.seccomp``): loaded by the
worker before the program's code runs, it denies the kernel interfaces a
program never needs and that would reach beyond the run (ptrace, keyrings,
bpf, perf, io_uring, mounts, namespaces, non-Unix sockets, signals to the
supervisor). It is the layer that holds when the Python guard does not; a
level whose filter cannot be built here is unavailable.

Memory and processes per run: where the caller may create a cgroup (v2
with ``memory`` and ``pids`` delegated, else the v1 hierarchies; see
``opd.tasks.sandbox.cgroup``) every process of the run, launcher included,
shares one ``memory_bytes`` budget and one pids budget, and the kernel's
OOM kills are reported as ``memory_limit``. Elsewhere only per-process
RLIMIT_AS applies (a run of n processes may use n x ``memory_bytes``), and
``enforced`` says ``rlimit_address_space_per_process`` without the
``cgroup_*`` layers.

Trusted status: set-up failures and the program's end come only through a
private pipe the program never holds (``opd.tasks.sandbox.outcome``); a
program printing a set-up error and exiting with any code is scored as a
failed program, never as an infrastructure error.

Python guard (``python_guard=True``; Python programs only; every level): an
audit hook (``opd.tasks.sandbox.guard``) that ends the program with a
readable ``forbidden:<event>`` on process creation, signals, sockets,
``ctypes``, ``resource.setrlimit``, new threads, object-graph introspection
(``gc``) and file-system writes outside the work directory. It is a fast,
friendly first layer inside the program's own interpreter, not a boundary:
no property in ``provides`` rests on it.

The child side (namespaces, root, uid drop, rlimits) lives in
``opd.tasks.sandbox.launcher``, run as ``python -I -S launcher.py CONFIG``
and kept to light imports because its start-up is paid on every run.
"""
import dataclasses
import logging
import marshal
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

from opd.config.fields import check_float, check_int, set_field
from opd.tasks.sandbox import cgroup, outcome, seccomp
from opd.tasks.sandbox import launcher as sandbox_launcher
from opd.tasks.sandbox.launcher import blocked_ancestor

ISOLATION_LEVELS = ("namespaces-root", "namespaces-user", "rlimits")
UID_BASE = 0x5A000000  # per-run uids come from [UID_BASE, UID_BASE + 2**20)
# What a task may require (``Sandbox(require=...)``), each enforced by the kernel.
KERNEL_ISOLATION = ("filesystem", "network", "processes")
_PROVIDES = {"namespaces-root": KERNEL_ISOLATION, "namespaces-user": KERNEL_ISOLATION,
             "rlimits": ()}
_HOW_TO_GET = ("kernel isolation needs a namespaces level: 'namespaces-root' runs the caller as "
               "root (CAP_SYS_ADMIN); 'namespaces-user' needs unprivileged user namespaces "
               "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 on "
               "Debian kernels, kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu >= "
               "23.10); or pass allow_weaker=True to run with what is there (logged)")
_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Per-run resource limits.

  Attributes:
    cpu_s: CPU seconds (RLIMIT_CPU, rounded up to whole seconds; SIGKILL one
      second after SIGXCPU).
    wall_s: wall-clock seconds for the whole run, set-up included.
    memory_bytes: address-space limit of each process of the program
      (RLIMIT_AS) and, where a per-run cgroup is available
      (``"cgroup_memory_per_run"`` in ``Sandbox.enforced``), the memory of
      the whole run.
    output_bytes: stdout + stderr bytes kept; one more byte kills the run.
    file_bytes: largest file the program may write (RLIMIT_FSIZE) and, with
      namespaces, the size of the tmpfs work directory.
    max_processes: processes and threads the program may have (RLIMIT_NPROC
      of its uid and, with a cgroup, the run's pids.max plus the launcher's two).
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
      ``"supervisor_killed"`` (only where the program can reach it, see
      ``opd.tasks.sandbox.outcome``), ``"supervisor_disrupted"`` (the
      supervisor met an exception while the program ran: charged to the
      program), or ``"sandbox_error:<message>"`` when
      the sandbox itself failed (an infrastructure error, not the program's
      fault; only ever on the word of the private status pipe).
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


class IsolationUnavailable(ValueError):
  """The sandbox cannot give the isolation a caller requires (see ``Sandbox``)."""


class Sandbox:
  """Runs programs under ``limits`` at one isolation level. Thread-safe."""

  def __init__(self, limits: SandboxLimits | None = None, *, isolation: str = "auto",
               python_guard: bool = True, sandbox_uid: int | None = None,
               require: Sequence[str] | None = None, allow_weaker: bool = False):
    """Creates a sandbox.

    Args:
      limits: resource limits (default ``SandboxLimits()``).
      isolation: ``"auto"`` or one of ``ISOLATION_LEVELS``; a level that does
        not work on this machine raises ``IsolationUnavailable`` (a
        ValueError) with the reason.
      python_guard: install the audit-hook guard in Python programs.
      sandbox_uid: uid (and gid) programs run as when the caller is root;
        None draws a fresh one per run from ``[UID_BASE, UID_BASE + 2**20)``,
        so concurrent runs never share an RLIMIT_NPROC budget.
      require: properties of ``KERNEL_ISOLATION`` the caller needs enforced
        by the kernel; a level without them raises ``IsolationUnavailable``.
        None (the default) requires all of them, except where the caller
        names ``isolation="rlimits"`` itself: that explicit choice of the
        weaker level runs, with a warning naming it.
      allow_weaker: run anyway when ``require`` is not met, with a logged
        warning naming the level (an explicit opt-in; never the default).
    """
    self.limits = SandboxLimits() if limits is None else limits
    if not isinstance(self.limits, SandboxLimits):
      raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    explicit_weak = require is None and isolation == "rlimits"
    if require is None:
      require = () if explicit_weak else KERNEL_ISOLATION
    if isinstance(require, str) or not set(require) <= set(KERNEL_ISOLATION):
      raise ValueError(f"require must be a subset of {KERNEL_ISOLATION}, got {require!r}")
    if sandbox_uid is not None and (not isinstance(sandbox_uid, int) or sandbox_uid <= 0):
      raise ValueError(f"sandbox_uid must be a positive int or None, got {sandbox_uid!r}")
    if isolation == "auto":
      isolation = probe_isolation()
      if isolation is None:
        raise IsolationUnavailable(f"no isolation level works here: {isolation_report()}. "
                                   f"{_HOW_TO_GET}")
    elif isolation not in ISOLATION_LEVELS:
      raise ValueError(f"isolation must be 'auto' or one of {ISOLATION_LEVELS}, got {isolation!r}")
    elif problem := _level_problem(isolation, sandbox_uid):
      raise IsolationUnavailable(f"isolation={isolation!r} is not available here: {problem}")
    missing = [r for r in require if r not in _PROVIDES[isolation]]
    if missing:
      message = (f"isolation={isolation!r} does not give kernel-enforced {', '.join(missing)} "
                 f"isolation, which is required here. {_HOW_TO_GET}. Levels here: "
                 f"{isolation_report()}")
      if not allow_weaker:
        raise IsolationUnavailable(message)
      _LOG.warning("allow_weaker=True, running anyway: %s", message)
    if explicit_weak:
      _LOG.warning("isolation='rlimits' chosen explicitly: programs run without kernel-enforced "
                   "%s isolation (see opd.tasks.sandbox.api)", ", ".join(KERNEL_ISOLATION))
    self.isolation = isolation
    self.python_guard = bool(python_guard)
    self.sandbox_uid = sandbox_uid
    self._drops_uid = _drops_uid(isolation)
    # A cgroup the program's own uid could write is no limit (rlimits, no uid drop).
    self._cgroup = cgroup.problem() is None and (isolation != "rlimits" or self._drops_uid)

  @property
  def provides(self) -> tuple[str, ...]:
    """The properties of ``KERNEL_ISOLATION`` the kernel enforces at this level."""
    return _PROVIDES[self.isolation]

  @property
  def enforced(self) -> tuple[str, ...]:
    """The layers every run gets (see the module docstring)."""
    layers = ["rlimit_cpu", "rlimit_address_space_per_process", "rlimit_file_size",
              "rlimit_open_files", "wall_timeout_kill_process_group", "output_cap",
              "private_workdir", "no_new_privs", "trusted_status_pipe"]
    if self._cgroup:
      layers += ["cgroup_memory_per_run", "cgroup_pids_per_run", "cgroup_kill"]
    if self._drops_uid:
      layers.append("uid_drop")
    if self.isolation != "rlimits":
      layers += ["minimal_root", "fresh_proc", "pid_namespace", "network_namespace",
                 "ipc_namespace", "readonly_root", "tmpfs_workdir", "capabilities_dropped"]
    if self._drops_uid or self.isolation == "namespaces-user":
      layers.append("rlimit_nproc")
    else:
      # A non-root caller's uid: shared with its own processes, the limit is
      # set to their current count + max_processes.
      layers.append("rlimit_nproc_shared_with_caller")
    layers.append("seccomp_filter")
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

  def _run(self, program: dict, stdin: str, files: Mapping[str, str] | None, launch=None):
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
      return self._run_in(base, run_id, program, stdin, files, launch or self._launch)
    finally:
      shutil.rmtree(base, ignore_errors=True)

  def _run_in(self, base, run_id, program, stdin, files, launch):
    """Directories, uid and cgroup of a run around ``launch`` (``_launch`` or a batch's)."""
    start = time.monotonic()
    drop_uid = None
    if self._drops_uid:
      drop_uid = self.sandbox_uid or UID_BASE + random.randrange(2**20)
      os.chmod(base, 0o711)  # the launcher reaches its directories by path after the drop
    workdir = os.path.join(base, "work")
    if self.isolation == "rlimits":
      os.mkdir(workdir, 0o700)
      if drop_uid is not None:
        os.chown(workdir, drop_uid, drop_uid)
    else:
      os.mkdir(os.path.join(base, "root"), 0o755)  # the mount point of the program's root
    group = None
    if self._cgroup:
      try:
        group = cgroup.RunCgroup.create(f"opd-sandbox-{run_id}", self.limits.memory_bytes,
                                        self.limits.max_processes + 2)
      except OSError as e:
        return SandboxResult(False, f"sandbox_error:cgroup: {e}", None, "", "",
                             time.monotonic() - start, self.enforced, run_id)
    try:
      return launch(base, run_id, program, stdin, files, workdir, drop_uid, group, start)
    finally:
      if group is not None:
        group.remove()

  def _launch(self, base, run_id, program, stdin, files, workdir, drop_uid, group,
              start) -> SandboxResult:
    run = self._execute(base, run_id, program, stdin, files, workdir, drop_uid, group,
                        start + self.limits.wall_s, self.limits.output_bytes)
    if isinstance(run, str):
      return SandboxResult(False, run, None, "", "", time.monotonic() - start, self.enforced,
                           run_id)
    out, err, killed, status = run
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    reason, returncode = outcome.classify(
        killed, status, stderr, cpu_limit_s=self.limits.cpu_s,
        oom_kills=group.oom_kills() if group else 0,
        supervisor_reachable=self.isolation == "rlimits" and not self._drops_uid)
    return SandboxResult(reason == "ok", reason, returncode, stdout, stderr,
                         time.monotonic() - start, self.enforced, run_id)

  def _execute(self, base, run_id, program, stdin, files, workdir, drop_uid, group,
               deadline: float, cap: int) -> tuple[bytes, bytes, str | None, str] | str:
    """``(stdout, stderr, killed, status text)`` of the launcher, or why it did not start."""
    status_r, status_w = os.pipe()
    cfg = {"mode": self.isolation, "workdir": workdir, "base": base, "program": program,
           "stdin": stdin, "files": files, "status_fd": status_w, "drop_uid": drop_uid,
           "guard": self.python_guard, "limits": dataclasses.asdict(self.limits),
           "seccomp": seccomp.program_filter(),
           "root_plan": _root_plan(), "cgroup_procs": group.procs_files if group else []}
    cfg_path = os.path.join(base, "config.marshal")
    with open(os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
      marshal.dump(cfg, f)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
           "TMPDIR": workdir, "PYTHONIOENCODING": "utf-8"}
    try:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-B", os.path.abspath(sandbox_launcher.__file__), cfg_path, run_id],
          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          pass_fds=(status_w,), start_new_session=True, env=env, cwd=base)
    except OSError as e:
      os.close(status_r)
      return f"sandbox_error:launch failed: {e}"
    finally:
      os.close(status_w)
    try:
      out, err, killed = outcome.collect(proc, deadline, cap)
    finally:
      outcome.kill_group(proc.pid)
      if group is not None:
        group.kill()
      proc.wait()
      status = outcome.read_all(status_r)
      os.close(status_r)
    return out, err, killed, status


# ----------------------------------------------------------------------------
# Which isolation level works here (probed once per process).

_PROBE_LOCK = threading.Lock()
_PROBE_CACHE: dict[str, str | None] = {}


def _drops_uid(level: str) -> bool:
  """Whether programs at ``level`` run under a uid of their own (always, for root)."""
  return os.geteuid() == 0


def _root_plan() -> list[list[str]]:
  """``[kind, host path, link target]`` entries of the program's root (see the docstring)."""
  plan = []
  for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
               "/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/urandom"):
    if os.path.islink(path):
      plan.append(["symlink", path, os.readlink(path)])
    elif os.path.exists(path):
      plan.append(["bind", path, ""])
  bound = [path for kind, path, _ in plan if kind == "bind"]
  for prefix in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}):
    if not any(prefix == b or prefix.startswith(b + "/") for b in bound):
      plan.append(["bind", prefix, ""])
      bound.append(prefix)
  return plan


def _level_problem(level: str, sandbox_uid: int | None = None) -> str | None:
  """None when ``level`` works here, else why not."""
  if problem := seccomp.problem():
    return problem  # every level loads the filter; none runs a program without it
  if level == "rlimits" and os.geteuid() == 0:
    # No mount namespace to expose the interpreter with: the per-run uid must
    # read it as it is, since rlimits never runs a program as root.
    for prefix in {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}:
      if blocked := blocked_ancestor(prefix, sandbox_uid or UID_BASE):
        return (f"it would have to run programs as root: the sandbox uid cannot enter {blocked}, "
                f"which holds the interpreter {prefix} (use a Python other users can read, or "
                "a namespaces level)")
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
  sandbox.sandbox_uid, sandbox._drops_uid, sandbox._cgroup = None, _drops_uid(level), False
  # Importing a module the launcher has not loaded proves the program can
  # still read the standard library inside its root after the uid drop.
  result = sandbox.run_python("import fractions; print('probe-ok')")
  if result.ok and result.stdout.strip() == "probe-ok":
    return None
  return f"{result.reason} {result.stderr[-300:]!r}"


def probe_isolation() -> str | None:
  """The strongest isolation level that works on this machine (None: none does)."""
  order = ("namespaces-root",) if os.geteuid() == 0 else ()
  return next((level for level in order + ("namespaces-user", "rlimits")
               if _level_problem(level) is None), None)


def isolation_report() -> dict[str, str]:
  """``{level: "available" or the reason it is not}`` for every level."""
  return {level: _level_problem(level) or "available" for level in ISOLATION_LEVELS}
