"""Hostile programs aimed at the sandbox's hardening, at every level offered here.

Each attack is contained and reported with a reason, and the caller is
unaffected. Where a level does not claim the property an attack targets
(``Sandbox.provides`` / ``Sandbox.enforced``), the test checks that it does
not claim it instead of running the attack.
"""
import ast
import logging
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import uuid

import pytest

from opd.tasks import get_task
from opd.tasks.code_task import CodeTask
from opd.tasks.sandbox import api as sandbox_api
from opd.tasks.sandbox import cgroup
from opd.tasks.sandbox.api import (KERNEL_ISOLATION, UID_BASE, IsolationUnavailable, Sandbox,
                                   SandboxLimits, isolation_report)
from opd.tasks.sandbox.launcher import blocked_ancestor

LIMITS = SandboxLimits(cpu_s=2, wall_s=3.0)
LEVELS = [level for level, state in isolation_report().items() if state == "available"]
# What a contained attack may come back as: the program failed, never "ok"
# and never an infrastructure error.
FAILED = ("exit_code:", "forbidden:", "signal:", "memory_limit")


@pytest.fixture(scope="module", params=LEVELS)
def level(request):
  return request.param


@pytest.fixture(scope="module", params=[True, False], ids=["guard", "kernel_only"])
def sandbox(level, request):
  return Sandbox(LIMITS, isolation=level, python_guard=request.param)


@pytest.fixture
def host_dir():
  """A world-accessible directory of the host, outside any sandbox directory."""
  path = pathlib.Path(tempfile.mkdtemp(prefix="opd-sandbox-hostile-"))
  path.chmod(0o777)
  yield path
  shutil.rmtree(path)


def assert_contained(r):
  assert not r.ok and r.reason.startswith(FAILED) and not r.infrastructure_error, r


def accepted(server: socket.socket) -> bool:
  """Whether a (non-blocking) listener got a connection."""
  try:
    server.accept()[0].close()
    return True
  except BlockingIOError:
    return False


def test_host_unix_socket_unreachable(sandbox, host_dir):
  """A listener on a host path: no connection, no byte, directly or via CodeTask."""
  path = str(host_dir / "listener.sock")
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen()
    server.setblocking(False)
    src = ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
           f"s.connect({path!r})\ns.sendall(b'pwned')\nprint('connected')\n")
    r = sandbox.run_python(src)
    fn = ("def f(x):\n  import socket\n  s = socket.socket(socket.AF_UNIX)\n"
          f"  s.connect({path!r})\n  s.sendall(b'pwned')\n  return x\n")
    task = CodeTask(sandbox)
    example = task.examples("train", 1, seed=0, difficulty=1)[0]
    reward = task.verify(example, fn)
    connected = accepted(server)
  if sandbox.python_guard or "filesystem" in sandbox.provides:
    assert_contained(r)
    assert "connected" not in r.stdout and not connected
    # The guard ends the run ("sandbox:forbidden:..."); without it each call
    # of f raises inside the harness ("partial:0/6"). Either way: no reward.
    assert reward.reward == 0.0 and reward.reason in ("sandbox:forbidden:socket.__new__",
                                                      "partial:0/6"), reward
  else:
    assert sandbox.isolation == "rlimits"  # documented: host sockets reachable


def test_abstract_unix_socket_unreachable(sandbox):
  """Abstract Unix sockets have no file; the network namespace scopes them."""
  name = f"\0opd-sandbox-test-{uuid.uuid4().hex}"
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
    server.bind(name)
    server.listen()
    server.setblocking(False)
    r = sandbox.run_python(f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({name!r})\n"
                           "s.sendall(b'pwned')\nprint('connected')\n")
    connected = accepted(server)
  if sandbox.python_guard or "network" in sandbox.provides:
    assert_contained(r)
    assert "connected" not in r.stdout and not connected
  else:
    assert sandbox.isolation == "rlimits"  # documented: no network isolation


def test_root_holds_only_what_the_program_needs(level):
  """The program's root: system directories, the interpreter, /dev (three
  devices), a fresh /proc and the work directory; nothing else of the host."""
  kernel_only = Sandbox(LIMITS, isolation=level, python_guard=False)
  if "minimal_root" not in kernel_only.enforced:
    assert "filesystem" not in kernel_only.provides
    return
  r = kernel_only.run_python(
      "import os\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/dev')))\n"
      "print(os.getcwd(), open('/dev/null', 'w').write('x'), len(open('/dev/urandom', 'rb')"
      ".read(4)))\nprint(sorted(os.listdir('/etc')) if os.path.isdir('/etc') else [])\n")
  assert r.ok, r
  top, dev, cwd, etc = r.stdout.splitlines()
  top, dev, etc = (set(ast.literal_eval(x)) for x in (top, dev, etc))
  system = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc",
            "sandbox"}
  prefix_top = os.path.realpath(sys.base_prefix).split("/")[1]
  assert top <= system | {prefix_top}, top
  assert not {"tmp", "run", "home", "var", "work", "workdirs"} & (top - {prefix_top}), top
  assert dev == {"null", "zero", "urandom", "fd", "stdin", "stdout", "stderr"}, dev
  assert cwd == "/sandbox 1 4"
  assert etc <= {"ld.so.cache"}, etc


def test_proc_shows_only_the_run(sandbox):
  """Every pid the program can list is one of its own run."""
  src = ("import os\nfor e in os.listdir('/proc'):\n  if e.isdigit():\n"
         "    try:\n      print(e, open(f'/proc/{e}/cmdline', 'rb').read().hex())\n"
         "    except OSError:\n      print(e, 'unreadable')\n")
  r = sandbox.run_python(src)
  if sandbox.python_guard and r.reason.startswith("forbidden:"):
    return  # the guard refused the directory listing itself
  if "fresh_proc" not in sandbox.enforced:
    assert sandbox.isolation == "rlimits"
    return
  assert r.ok, r
  pids = [line.split() for line in r.stdout.splitlines()]
  assert pids, r
  for pid, cmdline in pids:
    # Only the run's own processes (the launcher's init and the program),
    # whose command lines carry the run id; none of the host's.
    assert cmdline != "unreadable" and r.run_id in bytes.fromhex(cmdline).decode(), (pid, r)


def test_world_readable_host_files_unreadable(sandbox, host_dir):
  """Files of the host (a temp dir, the repository) are not in the program's root."""
  token = uuid.uuid4().hex
  secret = host_dir / "secret.txt"
  secret.write_text(token)
  secret.chmod(0o644)
  in_repo = pathlib.Path(__file__).resolve().parent / f".sandbox-secret-{token}.txt"
  in_repo.write_text(token)
  in_repo.chmod(0o644)
  try:
    for path in (secret, in_repo):
      r = sandbox.run_python(f"print(open({str(path)!r}).read())")
      if "filesystem" in sandbox.provides:
        assert_contained(r)
        assert token not in r.stdout and "No such file or directory" in r.stderr, r
      else:
        assert sandbox.isolation == "rlimits"  # documented: reads follow file permissions
  finally:
    in_repo.unlink()


def test_forged_setup_failure_is_a_failed_program(sandbox):
  """Imitating the launcher's set-up failure scores as a failed program."""
  src = ("import os, sys\nfor fd in range(3, 256):\n  try:\n"
         "    os.write(fd, b'setup_error forged\\n')\n  except OSError:\n    pass\n"
         "sys.stderr.write('sandbox worker set-up failed: forged\\nsetup_error forged\\n')\n"
         "sys.stderr.flush()\nos._exit(87)\n")
  r = sandbox.run_python(src)
  assert (r.reason, r.returncode, r.infrastructure_error) == ("exit_code:87", 87, False), r
  if not sandbox.python_guard:  # the supervisor's descriptors are out of reach too
    r = sandbox.run_python(
        "import glob\nfor p in glob.glob('/proc/*/fd/*'):\n  try:\n"
        "    open(p, 'w').write('setup_error forged\\n')\n  except OSError:\n    pass\n")
    assert r.ok and not r.infrastructure_error, r
  fn = ("def f(x):\n  import os, sys\n"
        "  sys.stderr.write('sandbox worker set-up failed: forged\\n')\n"
        "  sys.stderr.flush()\n  os._exit(87)\n")
  task = CodeTask(sandbox)
  example = task.examples("train", 1, seed=0, difficulty=1)[0]
  reward = task.verify(example, fn)  # would raise SandboxFailure if believed
  assert reward.reward == 0.0 and reward.reason == "sandbox:exit_code:87"


def test_real_setup_failure_is_an_infrastructure_error(level):
  """The trusted channel still reports genuine failures (files overflowing the tmpfs)."""
  small = Sandbox(SandboxLimits(file_bytes=4096), isolation=level)
  r = small.run_python("print(1)", files={"big.txt": "x" * 65536})
  if "tmpfs_workdir" in small.enforced:
    assert r.infrastructure_error and "No space left" in r.reason, r


# Each of these switched an unhardened guard off (its deny action became a
# no-op, or every path looked like the work directory).
_NOOP_DENY = ("def _mk():\n  write = exit_ = None\n  def deny(event):\n    (write, exit_)\n"
              "  return deny\nnoop = _mk()\n")
GUARD_BYPASSES = {
    # Find the hook's closure through the object graph and replace deny.
    "gc": "import gc\nfor o in gc.get_objects():\n"
          "  for c in (getattr(o, '__closure__', None) or ()):\n"
          "    if getattr(c.cell_contents, '__name__', '') == 'deny':\n"
          "      c.cell_contents = lambda event: None\n",
    # The functions the hook consulted: every path inside, no directory anywhere.
    "realpath": "import os, os.path\nos.path.realpath = lambda p, **k: os.getcwd()\n"
                "os.path.isdir = lambda p: False\n",
    "isinstance": "import builtins\nbuiltins.isinstance = lambda *a: True\n",
    # The thread stand-ins shared deny's closure cell with the hook.
    "thread_cell": "import _thread\nfor c in _thread.start_new_thread.__closure__:\n"
                   "  c.cell_contents = lambda *a: None\n",
    # A patched function the hook called hands over the hook's frame.
    "hook_frame": _NOOP_DENY + "import os, sys\norig = os.path.realpath\n"
                  "def spy(p, **k):\n  f = sys._getframe(1)\n  while f is not None:\n"
                  "    d = f.f_locals.get('deny')\n    if d is not None:\n"
                  "      d.__code__ = noop.__code__\n    f = f.f_back\n  return orig(p, **k)\n"
                  "os.path.realpath = spy\nopen('trigger', 'w').close()\n",
    # A descriptor on the class of the hook's frozen namespaces runs inside the
    # hook (E2 of the third red-team): the hook's deny sets emptied.
    "namespace_descriptor":
        "import os, sys\ndef grab(self):\n  f = sys._getframe(1)\n  while f is not None:\n"
        "    chk = f.f_locals.get('check')\n"
        "    for c in (getattr(chk, '__closure__', None) or ()):\n"
        "      if isinstance(c.cell_contents, frozenset):\n"
        "        c.cell_contents = frozenset()\n    f = f.f_back\n  return os.lstat\n"
        "for k in object.__subclasses__():\n"
        "  if k.__name__ in ('_Frozen', 'SimpleNamespace'):\n    try:\n"
        "      k.lstat = property(grab)\n    except TypeError:\n      pass\n"
        "open('trigger', 'w').close()\n",
}


@pytest.mark.parametrize("bypass", sorted(GUARD_BYPASSES))
def test_guard_survives_bypass_attempts(level, bypass, host_dir):
  """After each attempt to switch the guard off, every escape is still stopped
  by the guard itself (the reason names it), at every level."""
  guarded = Sandbox(LIMITS, isolation=level)
  target = host_dir / "pwned"
  escapes = {
      "write": f"open({str(target)!r}, 'w').write('x')\n",
      "socket": "import socket\nsocket.socket()\n",
      "fork": "import os\nos.fork()\n",
      "thread": "import threading\nthreading.Thread(target=print).start()\n",
      "ctypes": "import ctypes\n",
  }
  for name, escape in escapes.items():
    # ``try`` so that a bypass refused by the guard ends the run, while one
    # that merely raises lets the escape run next.
    # Modules the escapes use are imported before the bypass may break imports.
    src = (f"import os, socket, threading\ntry:\n  exec({GUARD_BYPASSES[bypass]!r})\n"
           f"except Exception:\n  pass\n{escape}")
    r = guarded.run_python(src)
    assert r.reason.startswith("forbidden:"), (bypass, name, r)
  assert not target.exists()


def test_multi_process_allocation_is_bounded_per_run(level, monkeypatch):
  """4 processes x 600 MB: with a per-run cgroup at most memory_bytes of them
  coexist; without one, each process alone is capped (and nothing is claimed).

  The per-run budget is kept just above one allocation (700 MiB) so that the
  second one trips it at once; the children hold their memory long enough
  (1.5 s) that all four would coexist if nothing stopped them.
  """
  size = 600 * 2**20
  src = ("import os, time\nkids = []\nfor i in range(4):\n  pid = os.fork()\n  if pid == 0:\n"
         f"    b = b'x' * {size}\n    time.sleep(1.5)\n    os._exit(0)\n  kids.append(pid)\n"
         "ok = sum(os.waitpid(k, 0)[1] == 0 for k in kids)\nprint(ok)\n")
  limits = SandboxLimits(cpu_s=4, wall_s=20.0, memory_bytes=700 * 2**20)
  per_run = Sandbox(limits, isolation=level, python_guard=False)
  if "cgroup_memory_per_run" in per_run.enforced:
    r = per_run.run_python(src)
    assert r.reason == "memory_limit", r
    # Children that ran to the end held their 600 MB at the same time.
    assert r.stdout == "" or int(r.stdout) <= limits.memory_bytes // size, r
  else:
    assert cgroup.problem() is not None or per_run.isolation == "rlimits"
  # Without a cgroup (as where none can be made) the per-process cap still holds.
  monkeypatch.setattr(cgroup, "problem", lambda: "no cgroup (test)")
  per_process = Sandbox(SandboxLimits(cpu_s=4, wall_s=20.0, memory_bytes=512 * 2**20),
                        isolation=level, python_guard=False)
  assert "cgroup_memory_per_run" not in per_process.enforced
  assert "rlimit_address_space_per_process" in per_process.enforced
  r = per_process.run_python(src)
  assert r.ok and r.stdout.strip() == "0", r  # every child's allocation failed


def test_weak_isolation_is_refused_without_opt_in(caplog, monkeypatch):
  """Fail closed: rlimits never runs as root, and a task requiring kernel
  isolation refuses a weaker sandbox unless explicitly (and loudly) allowed."""
  if os.geteuid() == 0:
    prefix = os.path.realpath(sys.base_prefix)
    if blocked_ancestor(prefix, UID_BASE):
      with pytest.raises(IsolationUnavailable, match="root"):
        Sandbox(LIMITS, isolation="rlimits")
    else:  # the interpreter is readable: rlimits runs under the per-run uid
      r = Sandbox(LIMITS, isolation="rlimits").run_python("import os; print(os.getuid())")
      assert r.ok and int(r.stdout) != 0, r
  if isolation_report()["rlimits"] == "available":
    with pytest.raises(IsolationUnavailable, match="filesystem, network, processes"):
      Sandbox(LIMITS, isolation="rlimits", require=KERNEL_ISOLATION)
    with pytest.raises(IsolationUnavailable, match="allow_weak_isolation"):
      CodeTask(Sandbox(LIMITS, isolation="rlimits"))
    with caplog.at_level(logging.WARNING):
      weak = Sandbox(LIMITS, isolation="rlimits", require=KERNEL_ISOLATION, allow_weaker=True)
    assert weak.provides == () and "allow_weaker=True" in caplog.text
  # The task's own check, on whatever level is here, with the level's claims
  # taken away: refused without the flag, logged with it.
  strong = Sandbox(LIMITS, isolation=LEVELS[0])
  assert CodeTask(strong).sandbox is strong
  monkeypatch.setattr(sandbox_api.Sandbox, "provides", property(lambda self: ()))
  with pytest.raises(IsolationUnavailable, match="filesystem, network, processes"):
    get_task("code", sandbox=strong)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    CodeTask(strong, allow_weak_isolation=True)
  assert "allow_weak_isolation=True" in caplog.text


def test_cgroup_remove_waits_for_the_last_processes_then_logs_what_stays(tmp_path, caplog):
  """``RunCgroup.remove`` retries while ``rmdir`` fails (as it does until the last
  killed processes are reaped) and logs a directory that never empties, by path.
  A plain directory with a file in it stands in for a busy cgroup."""
  import threading
  busy = tmp_path / "busy"
  busy.mkdir()
  (busy / "cgroup.procs").write_text("")  # no pids to kill; rmdir fails while it exists
  group = cgroup.RunCgroup("v2", {"memory": str(busy), "pids": str(busy)})
  timer = threading.Timer(0.3, (busy / "cgroup.procs").unlink)
  timer.start()
  assert group.remove(patience_s=5.0) is True and not busy.exists()
  timer.join()
  stuck = tmp_path / "stuck"
  stuck.mkdir()
  (stuck / "cgroup.procs").write_text("")
  caplog.set_level("WARNING")
  assert cgroup.RunCgroup("v2", {"memory": str(stuck), "pids": str(stuck)}).remove(
      patience_s=0.1) is False
  assert stuck.exists() and str(stuck) in caplog.text
