"""Child side of ``opd.tasks.sandbox.api``: the launcher that sets up isolation and runs a program.

Run as ``python -I -S -B launcher.py CONFIG RUN_ID`` by
``opd.tasks.sandbox.api.Sandbox``; never imported by user code. It joins the
run's cgroup, enters the namespaces, builds the program's root and pivots
into it (as pid 1 of the new pid namespace, the supervisor), then forks the
worker that drops privileges, sets the rlimits, loads the seccomp filter
(``seccomp.py``, built by the caller), installs the guard (``guard.py``,
loaded by path) and runs the program. Set-up failures and the program's end
are reported on the private status pipe only.

The supervisor blocks every signal it can block (SIGKILL and SIGSTOP sent to
pid 1 from inside its pid namespace are dropped by the kernel, and the filter
denies signals to pid 1 anyway), so nothing a program sends can interrupt it;
an exception it still meets after the program started is reported as
``disrupted``, a failure of the program (``outcome.classify``). Everything
that goes wrong with the program's own text (``compile`` running out of
memory or recursion included) is the program's failure, printed like Python
would. Its imports stay
light (no json, signal, subprocess, dataclasses: they pull in
re/enum/inspect and would triple the start-up time that every sandboxed run
pays). See ``opd.tasks.sandbox.api`` for the isolation levels and what each
enforces.
"""
import marshal
import math
import os
import sys

_SETUP_EXIT = 87  # the launcher's own exit status on a set-up failure (never trusted)
WORKDIR = "/sandbox"  # the work directory's path inside the program's root
_SIGKILL = 9
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 1
_SYS_MOUNT_SETATTR = 442  # same on every architecture (syscalls >= 424 are unified)
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


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


def blocked_ancestor(path: str, uid: int) -> str | None:
  """The highest directory on ``path`` that ``uid`` may not traverse, if any."""
  parts = [p for p in path.split("/") if p]
  for i in range(len(parts) + 1):
    d = "/" + "/".join(parts[:i])
    st = os.stat(d)
    bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == uid else 0o001
    if not st.st_mode & bit:
      return d
  return None


def _build_root(cfg: dict):
  """Builds the program's root and pivots into it (see the api module docstring).

  A size-limited tmpfs holds: read-only binds of the interpreter prefix and
  system library directories (``cfg["root_plan"]``), null/zero/urandom in
  ``/dev``, a fresh procfs of the run's pid namespace at ``/proc`` and the
  tmpfs work directory ``WORKDIR``. The host root is detached afterwards.
  """
  ctypes, libc = _libc()

  class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

  def set_attr(path: bytes, flags: int, attr: MountAttr, what: str):
    _check(libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path, flags, ctypes.byref(attr),
                        ctypes.sizeof(attr)), what)

  def mount(src, dst: str, fstype, flags: int, data, what: str):
    _check(libc.mount(src, dst.encode(), fstype, flags, data), what)

  # Private first, so that nothing below propagates back to the host.
  mount(b"none", "/", None, _MS_REC | _MS_PRIVATE, None, "make / private")
  root = os.path.join(cfg["base"], "root")
  mount(b"tmpfs", root, b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0755,size=1m", "root tmpfs")
  for kind, path, target in cfg["root_plan"]:
    inner = root + path
    os.makedirs(os.path.dirname(inner), mode=0o755, exist_ok=True)
    if kind == "symlink":
      os.symlink(target, inner)
      continue
    if os.path.isdir(path):
      os.mkdir(inner, 0o755)
    else:
      os.close(os.open(inner, os.O_WRONLY | os.O_CREAT, 0o644))
    mount(path.encode(), inner, None, _MS_BIND | _MS_REC, None, f"bind {path}")
  os.mkdir(root + "/proc", 0o555)
  mount(b"proc", root + "/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None, "mount proc")
  for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
    os.symlink(target, f"{root}/dev/{name}")
  owner = cfg["drop_uid"] if cfg["mode"] == "namespaces-root" else 0
  work = root + WORKDIR
  os.mkdir(work, 0o700)
  opts = f"size={cfg['limits']['file_bytes']},mode=0700,uid={owner},gid={owner}".encode()
  mount(b"tmpfs", work, b"tmpfs", _MS_NOSUID | _MS_NODEV, opts, "work tmpfs")
  cfg["workdir"] = work
  _write_files(cfg)
  cfg["workdir"] = WORKDIR
  os.chdir(root)
  _check(libc.syscall(_SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
  _check(libc.umount2(b".", _MNT_DETACH), "detach the host root")
  os.chdir("/")
  set_attr(b"/", _AT_RECURSIVE, MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0), "read-only /")
  set_attr(WORKDIR.encode(), 0, MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0), "writable workdir")


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
  # The supervisor made itself (and so this fork) non-dumpable; the program
  # gets its own /proc/self back.
  _check(libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(DUMPABLE)")
  _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def _load_filter(bpf: bytes):
  """Loads the seccomp filter (raw ``struct sock_filter`` array) for this
  process and everything it starts; needs ``no_new_privs`` (set before)."""
  ctypes, libc = _libc()

  class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

  if not bpf or len(bpf) % 8:
    raise OSError(f"seccomp filter of {len(bpf)} bytes is not a sock_filter array")
  code = ctypes.create_string_buffer(bpf, len(bpf))
  prog = Fprog(len(bpf) // 8, ctypes.cast(code, ctypes.c_void_p))
  _check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0),
         "prctl(SECCOMP)")


def _block_signals():
  """Blocks every signal for the calling supervisor; returns the previous mask."""
  import _signal
  return _signal.pthread_sigmask(_signal.SIG_BLOCK, _signal.valid_signals())


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


def _load_guard():
  """The guard module (``guard.py`` next to this file), loaded without ``opd``."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")
  with open(path, encoding="utf-8") as f:
    code = compile(f.read(), path, "exec")
  namespace = {"__name__": "opd_sandbox_guard"}
  exec(code, namespace)  # noqa: S102 - our own file
  return namespace["install"]


def _report(cfg: dict, line: str):
  """One line on the private status pipe (the program never holds it)."""
  os.write(cfg["status_fd"], (line.replace("\n", " ") + "\n").encode())


def _worker(cfg: dict, install_guard):
  """The program's process: stdin, privileges, limits, filter, program. Never returns."""
  try:
    import _signal
    _signal.pthread_sigmask(_signal.SIG_SETMASK, cfg["signal_mask"])  # the supervisor's block
    stdin_path = os.path.join(cfg["workdir"], ".sandbox_stdin")
    fd = os.open(stdin_path, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.unlink(stdin_path)
    os.chdir(cfg["workdir"])
    os.environ["HOME"] = os.environ["TMPDIR"] = cfg["workdir"]
    _drop_privileges(cfg)
    _set_rlimits(cfg)
    _load_filter(cfg["seccomp"])
    excepthook = sys.__excepthook__  # C-level printer, captured before the program runs
  except BaseException as e:  # noqa: BLE001 - an infrastructure error, on the trusted pipe
    _report(cfg, f"setup_error worker set-up failed: {e!r}")
    os._exit(_SETUP_EXIT)
  _report(cfg, "started")
  compiled = None
  if "python" in cfg["program"]:
    try:  # under the program's limits: a text too large or too deep is its own fault
      compiled = compile(cfg["program"]["python"], "<sandbox>", "exec")
    except BaseException as e:  # noqa: BLE001 - raised again below, as the program's error
      compiled = e.with_traceback(None)  # no launcher frame in what the program's stderr shows
  os.close(cfg["status_fd"])
  program = cfg["program"]
  if "argv" in program:
    try:
      os.execvp(program["argv"][0], program["argv"])
    except OSError as e:
      os.write(2, f"exec failed: {e}\n".encode())
      os._exit(127)
  code = 0
  try:
    if isinstance(compiled, BaseException):
      raise compiled
    sys.argv = ["<sandbox>"]
    if cfg["guard"]:
      install_guard(cfg["workdir"])
    exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException as e:  # noqa: BLE001 - the program's own error, printed like Python would
    # tb_next skips this launcher frame: the trace starts in "<sandbox>".
    e.__traceback__ = e.__traceback__.tb_next
    excepthook(type(e), e, e.__traceback__)
    code = 1
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:  # noqa: BLE001
    code = code or 1
  os._exit(code & 0xFF)


def _supervise(cfg: dict, install_guard) -> int:
  """Forks the worker, reaps it, reports ``exit|signal N CPU_S`` on the status fd.

  The supervisor is made non-dumpable first: a program running under the
  same uid cannot then open ``/proc/<supervisor>/fd`` to reach the pipe.
  """
  _, libc = _libc()
  _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
  cfg["signal_mask"] = _block_signals()
  pid = os.fork()
  if pid == 0:
    _worker(cfg, install_guard)
  status = "setup_error worker not reaped"
  try:
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
  except BaseException as e:  # noqa: BLE001 - the program is running: charged to it
    status = f"disrupted {e!r}"
  _report(cfg, status)
  return 0


def _fresh_workdir(cfg: dict, owner: int):
  """Replaces the tmpfs at ``WORKDIR`` by a new, empty one owned by ``owner``
  (the previous program's is detached and freed once nothing holds it)."""
  _, libc = _libc()
  _check(libc.umount2(WORKDIR.encode(), _MNT_DETACH), "detach the work tmpfs")
  opts = f"size={cfg['limits']['file_bytes']},mode=0700,uid={owner},gid={owner}".encode()
  _check(libc.mount(b"tmpfs", WORKDIR.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts),
         "work tmpfs")


def _collect_worker(pid: int, fds: list, deadline: float, cap: int, time, select):
  """``(outputs, wstatus, usage, killed)`` of the worker, read and reaped as
  ``outcome.collect`` does for a single run; then every process left is killed."""
  bufs = {fd: bytearray() for fd in fds}
  open_fds, total, killed, reaped = list(fds), 0, None, None
  while open_fds and killed is None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      killed = "wall_time_limit"
      break
    for fd in select.select(open_fds, [], [], remaining)[0]:
      chunk = os.read(fd, 65536)
      if not chunk:
        open_fds.remove(fd)
        continue
      bufs[fd] += chunk[:max(0, cap - total)]
      total += len(chunk)
      if total > cap:
        killed = "output_limit"
        break
  while killed is None and reaped is None:
    got, wstatus, usage = os.wait4(pid, os.WNOHANG)
    if got == pid:
      reaped = (wstatus, usage)
    elif time.monotonic() >= deadline:
      killed = "wall_time_limit"
    else:
      time.sleep(0.0005)
  try:  # pid 1 of the namespace: -1 is every other process of the run
    os.kill(-1, _SIGKILL)
  except ProcessLookupError:
    pass
  while True:
    try:
      got, wstatus, usage = os.wait4(-1, 0)
    except ChildProcessError:
      break
    if got == pid and reaped is None:
      reaped = (wstatus, usage)
  return [bytes(bufs[fd]) for fd in fds], reaped[0], reaped[1], killed


def _supervise_batch(cfg: dict, install_guard) -> int:
  """Runs ``cfg["program"]["batch"]`` one after another (``opd.tasks.sandbox.batch``),
  each in a worker forked as in a single run, with its own uid, work tmpfs,
  IPC, network and UTS namespaces, deadline and output cap. One record per
  program on stdout, which no program holds: ``"STATUS_LEN STDOUT_LEN
  STDERR_LEN KILLED WALL_S\\n"``, then those byte strings (STATUS: what a
  single run's status pipe would say)."""
  import resource, select, time  # noqa: E401,F401 - resource: once here, not per worker
  if os.getpid() != 1:
    raise OSError("batch runs need the run's own pid namespace")
  _, libc = _libc()
  _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
  cfg["signal_mask"] = _block_signals()
  lim, records = cfg["limits"], os.dup(1)
  for source, uid in zip(cfg["program"]["batch"], cfg["program"]["uids"]):
    prog = dict(cfg, program={"python": source}, drop_uid=uid, workdir=WORKDIR, stdin="",
                files={})
    _fresh_workdir(cfg, uid if cfg["mode"] == "namespaces-root" else 0)
    _write_files(prog)
    status_r, prog["status_fd"] = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
      os.dup2(out_w, 1)
      os.dup2(err_w, 2)
      for fd in (records, cfg["status_fd"], status_r, out_r, err_r, out_w, err_w):
        os.close(fd)  # the run's status pipe and the records stay out of reach
      try:  # IPC objects, sockets and the hostname of one program never reach the next
        _check(libc.unshare(_CLONE_NEWIPC | _CLONE_NEWNET | _CLONE_NEWUTS), "unshare")
      except OSError as e:
        _report(prog, f"setup_error {e!r}")
        os._exit(_SETUP_EXIT)
      _worker(prog, install_guard)
    for fd in (prog["status_fd"], out_w, err_w):
      os.close(fd)
    (out, err), wstatus, usage, killed = _collect_worker(
        pid, [out_r, err_r], start + lim["wall_s"], lim["output_bytes"], time, select)
    wall = time.monotonic() - start
    os.close(out_r)
    os.close(err_r)
    status = b""
    while chunk := os.read(status_r, 65536):
      status += chunk
    os.close(status_r)
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(wstatus):
      status += f"signal {os.WTERMSIG(wstatus)} {cpu}\n".encode()
    else:
      status += f"exit {os.WEXITSTATUS(wstatus)} {cpu}\n".encode()
    head = f"{len(status)} {len(out)} {len(err)} {killed or '-'} {wall}\n".encode()
    view = memoryview(head + status + out + err)
    while view:
      view = view[os.write(records, view):]
  return 0


def _launcher_main(config_path: str) -> int:
  with open(config_path, "rb") as f:
    cfg = marshal.load(f)
  try:
    for procs in cfg["cgroup_procs"]:  # before any fork: every process of the run is inside
      _write_proc(procs, str(os.getpid()))
    install_guard = _load_guard() if cfg["guard"] else None
    if cfg["mode"] == "rlimits":
      _write_files(cfg)
      return _supervise(cfg, install_guard)
    _enter_namespaces(cfg)
    init = os.fork()
    if init == 0:
      try:
        _, libc = _libc()
        _check(libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        _build_root(cfg)
        supervise = _supervise_batch if "batch" in cfg["program"] else _supervise
        os._exit(supervise(cfg, install_guard))
      except BaseException as e:  # noqa: BLE001
        _report(cfg, f"setup_error {e!r}")
        os._exit(_SETUP_EXIT)
    _, wstatus = os.waitpid(init, 0)
    return os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else 1
  except BaseException as e:  # noqa: BLE001
    _report(cfg, f"setup_error {e!r}")
    return _SETUP_EXIT


if __name__ == "__main__":
  sys.exit(_launcher_main(sys.argv[1]))
