"""Sandbox for executing model-written programs (SPEC §7 "Sandbox", §9 code domain).

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
tmpfs described above). The module has two halves: the launcher, run as
``python -I -S sandbox.py CONFIG`` and kept to light imports because its
start-up is paid on every run, and the parent-side API below it.
"""
import marshal
import math
import os
import sys

# ----------------------------------------------------------------------------
# Launcher (child side). Imports here stay light: json, signal, subprocess and
# dataclasses pull in re/enum/inspect, which would triple the start-up time.

_FORBIDDEN_EXIT = 86  # the guard stopped the program; stderr names the event
_GUARD_MARK = "sandbox-guard: forbidden "
_SETUP_EXIT = 87
_SIGKILL = 9
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 1
_SYS_MOUNT_SETATTR = 442  # same on every architecture (syscalls >= 424 are unified)
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38


def _libc():
  import ctypes
  return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str):
  if ret != 0:
    import ctypes
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _write_proc(path: str, text: str):
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def _become(uid: int):
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)


def _enter_namespaces(cfg: dict):
  """unshare() in the launcher; its next child becomes pid 1."""
  _, libc = _libc()
  flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
  if cfg["mode"] == "namespaces-root":
    _check(libc.unshare(flags), "unshare")
    return
  if cfg["drop_uid"] is not None:
    # Root without CAP_SYS_ADMIN: leave uid 0 before creating the namespace
    # (RLIMIT_NPROC exempts kuid 0); setuid clears "dumpable", which would
    # make /proc/self/uid_map unwritable.
    _become(cfg["drop_uid"])
    _check(libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(DUMPABLE)")
  uid, gid = os.getuid(), os.getgid()
  _check(libc.unshare(flags | _CLONE_NEWUSER), "unshare")
  _write_proc("/proc/self/setgroups", "deny")
  _write_proc("/proc/self/uid_map", f"0 {uid} 1")
  _write_proc("/proc/self/gid_map", f"0 {gid} 1")


def _blocked_ancestor(path: str, uid: int) -> str | None:
  """The highest directory on ``path`` that ``uid`` may not traverse, if any."""
  parts = [p for p in path.split("/") if p]
  for i in range(len(parts) + 1):
    d = "/" + "/".join(parts[:i])
    st = os.stat(d)
    bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == uid else 0o001
    if not st.st_mode & bit:
      return d
  return None


def _expose_python(cfg: dict, libc):
  """Covers directories hiding the interpreter; binds its prefix back."""
  uid = cfg["drop_uid"]
  plan = [(p, _blocked_ancestor(p, uid)) for p in sorted(set(cfg["python_prefixes"]))]
  plan = [(p, d) for p, d in plan if d is not None]
  covers = {d for _, d in plan}
  covers = [d for d in covers if not any(d.startswith(c.rstrip("/") + "/") for c in covers)]
  staged = []
  for i, (prefix, _) in enumerate(plan):
    stage = os.path.join(cfg["base"], f"stage{i}")
    os.mkdir(stage, 0o700)
    _check(libc.mount(prefix.encode(), stage.encode(), None, _MS_BIND | _MS_REC, None),
           f"bind {prefix}")
    staged.append((prefix, stage))
  for d in covers:
    _check(libc.mount(b"tmpfs", d.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                      b"mode=0755,size=1m"), f"cover {d}")
  for prefix, stage in staged:
    os.makedirs(prefix, mode=0o755, exist_ok=True)
    _check(libc.mount(stage.encode(), prefix.encode(), None, _MS_BIND | _MS_REC, None),
           f"rebind {prefix}")
    _check(libc.umount2(stage.encode(), _MNT_DETACH), f"unmount {stage}")


def _setup_mounts(cfg: dict):
  """Private read-only view of every mount; the work directory a tmpfs."""
  ctypes, libc = _libc()

  class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

  def set_attr(path: bytes, flags: int, attr: MountAttr, what: str):
    _check(libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path, flags, ctypes.byref(attr),
                        ctypes.sizeof(attr)), what)

  work = cfg["workdir"].encode()
  # Private first, so that nothing below propagates back to the host.
  _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
  if cfg["mode"] == "namespaces-root":
    _expose_python(cfg, libc)
  owner = cfg["drop_uid"] if cfg["mode"] == "namespaces-root" else 0
  opts = f"size={cfg['limits']['file_bytes']},mode=0700,uid={owner},gid={owner}".encode()
  _check(libc.mount(b"tmpfs", work, b"tmpfs", _MS_NOSUID | _MS_NODEV, opts), "mount tmpfs")
  _write_files(cfg)
  set_attr(b"/", _AT_RECURSIVE, MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0), "read-only /")
  set_attr(work, 0, MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0), "writable workdir")


def _write_files(cfg: dict):
  owner = cfg["drop_uid"] if cfg["mode"] != "namespaces-user" else None
  items = dict(cfg["files"])
  items[".sandbox_stdin"] = cfg["stdin"]
  for name, text in items.items():
    path = os.path.join(cfg["workdir"], name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    if owner is not None:
      os.chown(path, owner, owner)


def _drop_privileges(cfg: dict):
  ctypes, libc = _libc()
  if cfg["mode"] == "namespaces-user":
    class Header(ctypes.Structure):
      _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
      _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                  ("inheritable", ctypes.c_uint32)]

    # _LINUX_CAPABILITY_VERSION_3 with empty sets: without CAP_SYS_ADMIN the
    # program cannot undo the read-only mounts of its namespace.
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")
  elif cfg["drop_uid"] is not None:
    _become(cfg["drop_uid"])
  _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def _set_rlimits(cfg: dict):
  import resource
  lim = cfg["limits"]

  def lower(which, soft, hard=None):
    # Never above the inherited hard limit: raising it needs CAP_SYS_RESOURCE.
    cap = resource.getrlimit(which)[1]
    hard = soft if hard is None else hard
    if cap != resource.RLIM_INFINITY:
      soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(which, (int(soft), int(hard)))

  cpu = math.ceil(lim["cpu_s"])
  lower(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU, then SIGKILL a second later
  lower(resource.RLIMIT_AS, lim["memory_bytes"])
  lower(resource.RLIMIT_FSIZE, lim["file_bytes"])
  lower(resource.RLIMIT_NOFILE, lim["max_open_files"])
  lower(resource.RLIMIT_CORE, 0)
  nproc = lim["max_processes"]
  if cfg["mode"] == "rlimits" and cfg["drop_uid"] is None:
    # The count is per user: leave room for the caller's own processes.
    uid = os.getuid()
    nproc += sum(1 for e in os.listdir("/proc") if e.isdigit() and _owned(f"/proc/{e}", uid))
  lower(resource.RLIMIT_NPROC, nproc)


def _owned(path: str, uid: int) -> bool:
  try:
    return os.stat(path).st_uid == uid
  except OSError:
    return False


def _install_guard(workdir: str):
  """The audit-hook guard of the module docstring. Cannot be removed."""
  root = os.path.realpath(workdir)
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  # Threads are refused too: with a second thread a program could swap a
  # symlink between the check below and the actual open.
  forbidden = frozenset((
      "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
      "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "socket.__new__",
      "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "ctypes.dlopen",
      "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
      "resource.setrlimit", "resource.prlimit", "os.chroot", "sys.remote_exec",
      "_thread.start_new_thread"))
  path_events = {"os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,),
                 "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,),
                 "os.utime": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
                 "shutil.copyfile": (1,), "shutil.rmtree": (0,)}
  blocked_imports = frozenset(("ctypes", "_ctypes", "_posixsubprocess"))
  write, exit_ = os.write, os._exit

  def deny(event):
    write(2, f"\n{_GUARD_MARK}{event}\n".encode())
    exit_(_FORBIDDEN_EXIT)

  def inside(path) -> bool:
    if isinstance(path, int):
      return True  # an already-open descriptor (only workdir ones can exist, see below)
    try:
      real = os.path.realpath(os.fsdecode(path))
    except Exception:  # noqa: BLE001 - an unreadable path is outside
      return False
    return real == root or real.startswith(root + os.sep)

  def hook(event, args):
    if event in forbidden:
      deny(event)
    elif event == "open":
      path, mode, flags = (tuple(args) + (None, None, None))[:3]
      writing = ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                 or (isinstance(flags, int) and flags > 0 and flags & write_flags))
      if not inside(path) and (writing or (isinstance(path, (str, bytes)) and os.path.isdir(path))):
        # A descriptor of an outside directory would let dir_fd= calls write
        # there under a relative name, so such directories cannot be opened.
        deny("open")
    elif event in path_events:
      if any(i < len(args) and not inside(args[i]) for i in path_events[event]):
        deny(event)
    elif event == "os.symlink" and len(args) >= 2:
      link = os.fsdecode(args[1]) if isinstance(args[1], (str, bytes)) else ""
      target = os.path.join(os.path.dirname(link), os.fsdecode(args[0]))
      if not (inside(link) and inside(target)):
        deny(event)
    elif event == "import" and args and args[0] in blocked_imports:
      deny(f"import:{args[0]}")

  for name in (*blocked_imports, "ctypes.util", "ctypes._endian"):
    sys.modules.pop(name, None)
  # Python < 3.13 raises no audit event for new threads: replace the primitive.
  import _thread
  for name in ("start_new_thread", "start_joinable_thread", "start_new"):
    if hasattr(_thread, name):
      setattr(_thread, name, lambda *a, **k: deny("_thread.start_new_thread"))
  sys.addaudithook(hook)


def _worker(cfg: dict):
  """The program's process: stdin, privileges, limits, program. Never returns."""
  try:
    os.close(cfg["status_fd"])
    stdin_path = os.path.join(cfg["workdir"], ".sandbox_stdin")
    fd = os.open(stdin_path, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.unlink(stdin_path)
    os.chdir(cfg["workdir"])
    _drop_privileges(cfg)
    _set_rlimits(cfg)
  except BaseException as e:  # noqa: BLE001 - reported through the exit code
    os.write(2, f"sandbox worker set-up failed: {e!r}\n".encode())
    os._exit(_SETUP_EXIT)
  program = cfg["program"]
  if "argv" in program:
    try:
      os.execvp(program["argv"][0], program["argv"])
    except OSError as e:
      os.write(2, f"exec failed: {e}\n".encode())
      os._exit(127)
  code = 0
  try:
    compiled = compile(program["python"], "<sandbox>", "exec")
    sys.argv = ["<sandbox>"]
    if cfg["guard"]:
      _install_guard(cfg["workdir"])
    exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException as e:  # noqa: BLE001 - the program's own error, printed like Python would
    import traceback
    # tb_next skips this launcher frame: the trace starts in "<sandbox>".
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    code = 1
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:  # noqa: BLE001
    code = code or 1
  os._exit(code & 0xFF)


def _supervise(cfg: dict) -> int:
  """Forks the worker, reaps it, reports ``exit|signal N CPU_S`` on the status fd."""
  pid = os.fork()
  if pid == 0:
    _worker(cfg)
  status = "setup_error worker not reaped"
  while True:
    try:
      reaped, wstatus, usage = os.wait4(-1, 0)
    except ChildProcessError:
      break
    if reaped == pid:
      cpu = usage.ru_utime + usage.ru_stime
      if os.WIFSIGNALED(wstatus):
        status = f"signal {os.WTERMSIG(wstatus)} {cpu}"
      else:
        status = f"exit {os.WEXITSTATUS(wstatus)} {cpu}"
      if cfg["mode"] != "rlimits":
        break  # pid 1 exiting kills whatever the program left behind
  os.write(cfg["status_fd"], (status + "\n").encode())
  return 0


def _report_setup_error(cfg: dict, e: BaseException) -> int:
  os.write(cfg["status_fd"], f"setup_error {e!r}\n".replace("\n", " ").encode() + b"\n")
  return _SETUP_EXIT


def _launcher_main(config_path: str) -> int:
  with open(config_path, "rb") as f:
    cfg = marshal.load(f)
  try:
    if cfg["mode"] == "rlimits":
      _write_files(cfg)
      return _supervise(cfg)
    _enter_namespaces(cfg)
    init = os.fork()
    if init == 0:
      try:
        _, libc = _libc()
        _check(libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        _setup_mounts(cfg)
        os._exit(_supervise(cfg))
      except BaseException as e:  # noqa: BLE001
        os._exit(_report_setup_error(cfg, e))
    _, wstatus = os.waitpid(init, 0)
    return os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else 1
  except BaseException as e:  # noqa: BLE001
    return _report_setup_error(cfg, e)


if __name__ == "__main__":
  sys.exit(_launcher_main(sys.argv[1]))

# ----------------------------------------------------------------------------
# Parent side: the public API. Imported after the launcher's exit on purpose.

import dataclasses  # noqa: E402
import random  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402

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
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"SandboxLimits.{field.name} must be a positive number, got {value!r}")
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
          [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), cfg_path, run_id],
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
