"""The Python guard of ``opd.tasks.sandbox``: an audit hook, a fast, friendly first layer.

Loaded by the launcher (``exec`` of this file, so that it stays importable
without the ``opd`` package) and installed in the program's process just
before the program runs. It ends the program with a readable reason
(``forbidden:<event>``) on process creation, signals, sockets, ``ctypes``,
``resource.setrlimit``, new threads and file-system writes outside the work
directory, before the kernel would have to refuse anything.

What it is not: a boundary. It runs inside the program's own interpreter, so a
program that finds a way to run its code inside the hook, or to corrupt the
interpreter's state, can switch it off; audit events also miss calls that
raise none (``signal.pidfd_send_signal``, ``os.pidfd_open``). The boundary is
the kernel's: the seccomp filter (``seccomp.py``), the namespaces, the uid
drop and the limits (docs/DESIGN.md §7); no property the sandbox claims rests
on the guard, and the hostile tests check each escape with the guard off.

It does make the bypasses known to us fail, so that its verdicts stay
readable: what the hook consults is captured at install time (a private
snapshot of the builtins, private copies of ``posixpath``'s functions over
namespaces of an immutable built-in type holding the C functions); a path
argument that is not exactly ``str``, ``bytes`` or ``int`` is refused rather
than converted, and any error inside the hook is a denial, so that no known
route runs program code under a hook frame; the thread primitives are
replaced by C-level callables raising an audit event; and the object-graph
walkers (``gc.get_objects``/``get_referrers``/``get_referents``), tracing and
profiling hooks, ``__code__`` assignment and re-importing ``_thread`` are
refused.
"""
import builtins
import os
import posixpath
import stat
import sys

FORBIDDEN_EXIT = 86  # the guard stopped the program; stderr names the event
GUARD_MARK = "sandbox-guard: forbidden "
_THREAD_EVENT = "opd.sandbox.new_thread"
_FORBIDDEN = frozenset((
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "socket.__new__",
    "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
    "resource.setrlimit", "resource.prlimit", "os.chroot", "sys.remote_exec",
    "_thread.start_new_thread", _THREAD_EVENT,
    # Introspection that could reach the hook's closure and switch it off.
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile"))
_PATH_EVENTS = {"os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,),
                "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,),
                "os.utime": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
                "shutil.copyfile": (1,), "shutil.rmtree": (0,)}
_BLOCKED_IMPORTS = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "_thread"))


# Namespaces whose attributes are fixed at install time. ``types.SimpleNamespace``
# (reached without importing ``types``) is a built-in, immutable type: a program
# that finds it through ``object.__subclasses__()`` cannot hang a descriptor on
# it to run its own code inside the hook, as it could on a class defined here.
_Frozen = type(sys.implementation)


def _private_copies(module, names, global_overrides: dict, private_builtins: dict) -> dict:
  """Copies of ``module``'s functions whose globals are a private snapshot."""
  g = dict(vars(module))
  g.update(global_overrides)
  g["__builtins__"] = private_builtins
  func_type = type(_private_copies)
  for name, value in list(g.items()):
    if type(value) is func_type:
      g[name] = func_type(value.__code__, g, name, value.__defaults__, value.__closure__)
      g[name].__kwdefaults__ = value.__kwdefaults__
  return {name: g[name] for name in names}


def install(workdir: str):
  """Installs the guard for a program whose only writable place is ``workdir``."""
  private_builtins = dict(vars(builtins))
  frozen_os = _Frozen(
      fspath=os.fspath, getcwd=os.getcwd, getcwdb=os.getcwdb, lstat=os.lstat, stat=os.stat,
      readlink=os.readlink, sep=os.sep, fsencode=os.fsencode, fsdecode=os.fsdecode)
  frozen_stat = _Frozen(S_ISLNK=stat.S_ISLNK, S_ISDIR=stat.S_ISDIR, S_ISREG=stat.S_ISREG)
  import genericpath
  frozen_generic = _Frozen(_check_arg_types=genericpath._check_arg_types)
  # posixpath's namespace holds genericpath's functions too (isdir), so one
  # private copy serves every path function the hook needs.
  realpath, isdir, path_join, path_dirname = _private_copies(
      posixpath, ("realpath", "isdir", "join", "dirname"),
      {"os": frozen_os, "stat": frozen_stat, "genericpath": frozen_generic},
      private_builtins).values()
  root = realpath(workdir)
  prefix = root + "/"
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  fs_encoding = sys.getfilesystemencoding()
  write, exit_ = os.write, os._exit
  mark = GUARD_MARK.encode()
  forbidden, path_events, blocked_imports = _FORBIDDEN, _PATH_EVENTS, _BLOCKED_IMPORTS
  str_, bytes_, int_, type_, len_, tuple_ = str, bytes, int, type, len, tuple

  exit_code = FORBIDDEN_EXIT

  def deny(event):
    write(2, b"\n" + mark + str_.encode(event, "ascii", "replace") + b"\n")
    exit_(exit_code)

  def plain(path):
    """``path`` as a str, without running program code; None if it is not plain."""
    kind = type_(path)
    if kind is str_:
      return path
    if kind is bytes_:
      return bytes_.decode(path, fs_encoding, "surrogateescape")
    return None

  def inside(path) -> bool:
    if type_(path) is int_:
      return True  # an already-open descriptor (only workdir ones can exist, see below)
    text = plain(path)
    if text is None:
      return False
    real = realpath(text)
    return real == root or str_.startswith(real, prefix)

  def check(event, args):
    # Types first: an operation on a program-defined subclass would run its code.
    if type_(event) is not str_ or type_(args) is not tuple_:
      deny("non-plain-event")
    if event in forbidden:
      deny(event)
    elif event == "open":
      path, mode, flags = (args + (None, None, None))[:3]
      writing = ((type_(mode) is str_ and ("w" in mode or "a" in mode or "x" in mode
                                           or "+" in mode))
                 or (type_(flags) is int_ and flags > 0 and flags & write_flags))
      if type_(path) is int_:
        return
      text = plain(path)
      if text is None:
        deny("open:non-plain-path")
      # A descriptor of an outside directory would let dir_fd= calls write
      # there under a relative name, so such directories cannot be opened.
      if not inside(text) and (writing or isdir(text)):
        deny("open")
    elif event in path_events:
      for i in path_events[event]:
        if i < len_(args) and not inside(args[i]):
          deny(event)
    elif event == "os.symlink" and len_(args) >= 2:
      link, target = plain(args[1]), plain(args[0])
      if link is None or target is None:
        deny(event)
      if not (inside(link) and inside(path_join(path_dirname(link), target))):
        deny(event)
    elif event == "object.__setattr__" and len_(args) >= 2:
      if type_(args[1]) is not str_ or args[1] == "__code__":
        deny("object.__setattr__:__code__")
    elif event == "import" and args:
      if type_(args[0]) is not str_:
        deny("import")
      if args[0] in blocked_imports:
        deny("import:" + args[0])

  def hook(event, args):
    try:
      check(event, args)
    except BaseException:  # noqa: BLE001 - any surprise inside the guard is a denial
      deny("guard-error")

  # Rebuilt with private globals (the builtins snapshot): assigning the names
  # updates the closure cells the functions share, so none of them looks
  # anything up in a namespace the program can reach.
  private_globals = {"__builtins__": private_builtins}
  func_type = type(install)
  deny, plain, inside, check, hook = (
      func_type(f.__code__, private_globals, f.__name__, f.__defaults__, f.__closure__)
      for f in (deny, plain, inside, check, hook))

  for name in ("ctypes", "_ctypes", "ctypes.util", "ctypes._endian"):
    sys.modules.pop(name, None)
  # Python < 3.13 raises no audit event for new threads: replace the
  # primitives with C-level callables that raise one (never a reference to
  # deny, and nothing with a closure or __dict__ a program could rewire).
  import _thread
  import functools
  refuse_thread = functools.partial(sys.audit, _THREAD_EVENT)
  for name in ("start_new_thread", "start_joinable_thread", "start_new"):
    if hasattr(_thread, name):
      setattr(_thread, name, refuse_thread)
  sys.addaudithook(hook)
