"""Child side of ``opd.tasks.sandbox.api``: the launcher that sets up isolation and runs a program.

Run as ``python -I -S sandbox_launcher.py CONFIG RUN_ID`` by
``opd.tasks.sandbox.api.Sandbox``; never imported by user code except for the shared
exit-code constants. Its imports stay light (no json, signal, subprocess,
dataclasses: they pull in re/enum/inspect and would triple the start-up
time that every sandboxed run pays). See ``opd.tasks.sandbox.api`` for the isolation
levels and what each enforces.
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
