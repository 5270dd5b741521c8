"""Sandbox hazards: each is contained, reported with a reason, and harmless to us.

The whole hazard list runs at every isolation level this machine offers
(``LEVELS``), each with the Python guard on and off, so that the kernel
layers are tested on their own. Kernel-layer tests check the claims of
``Sandbox.enforced``: where a layer is claimed it must hold, and where it is
not claimed it must not be listed. Hostile programs aimed at the hardening
(host sockets, /proc, forged status, guard bypasses, per-run memory, fail
closed) are in ``test_sandbox_hostile.py``.
"""
import glob
import os
import pathlib
import resource
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from opd.tasks.sandbox.api import (ISOLATION_LEVELS, Sandbox, SandboxLimits, isolation_report,
                         probe_isolation)

LIMITS = SandboxLimits(cpu_s=1, wall_s=1.0, max_processes=8)
TIME_REASONS = ("cpu_time_limit", "wall_time_limit")
LEVELS = [level for level, state in isolation_report().items() if state == "available"]


@pytest.fixture(scope="module", params=LEVELS)
def level(request):
  return request.param


@pytest.fixture(scope="module")
def guarded(level):
  return Sandbox(LIMITS, isolation=level)


@pytest.fixture(scope="module")
def kernel_only(level):
  return Sandbox(LIMITS, isolation=level, python_guard=False)


def survivors(run_id: str, wait_s: float = 2.0) -> list[int]:
  """Processes of a run still alive after up to ``wait_s`` (SIGKILL is async)."""
  deadline = time.monotonic() + wait_s
  while True:
    alive = []
    for entry in os.listdir("/proc"):
      if entry.isdigit():
        try:
          with open(f"/proc/{entry}/cmdline", "rb") as f:
            if run_id.encode() in f.read():
              alive.append(int(entry))
        except OSError:
          pass
    if not alive or time.monotonic() > deadline:
      return alive
    time.sleep(0.05)


def test_runs_program_with_stdin_files_and_private_dir(guarded):
  src = ("import sys\n"
         "nums = [int(t) for t in sys.stdin.read().split()]\n"
         "open('out.txt', 'w').write(str(sum(nums)))\n"
         "print(open('out.txt').read(), open('data/in.txt').read())\n"
         "import os, tempfile\n"
         "open(os.path.join(os.getcwd(), 'abs.txt'), 'w').write('by absolute path')\n"
         "fd, path = tempfile.mkstemp()\n"
         "print(os.path.dirname(path) == os.getcwd() == os.environ['HOME'])\n")
  r = guarded.run_python(src, stdin="3 4 5", files={"data/in.txt": "hello"})
  assert r.ok and r.reason == "ok" and r.returncode == 0, r
  assert r.stdout.split() == [str(3 + 4 + 5), "hello", "True"]


def test_exit_codes_and_exceptions_are_reported(guarded):
  r = guarded.run_python("import sys; sys.exit(3)")
  assert (r.ok, r.reason, r.returncode) == (False, "exit_code:3", 3)
  r = guarded.run_python("raise KeyError('boom')")
  assert r.reason == "exit_code:1" and "KeyError: 'boom'" in r.stderr
  assert 'File "<sandbox>"' in r.stderr


def test_run_executable(guarded):
  r = guarded.run(["echo", "hi there"])
  assert r.ok and r.stdout == "hi there\n", r


def test_infinite_loop_is_stopped(guarded):
  r = guarded.run_python("while True: pass")
  assert not r.ok and r.reason in TIME_REASONS, r
  assert r.wall_s < LIMITS.wall_s + 1.5
  assert survivors(r.run_id) == []


def test_fork_bomb_blocked_by_guard(guarded):
  r = guarded.run_python("import os\nwhile True:\n  os.fork()\n")
  assert not r.ok and r.reason == "forbidden:os.fork", r
  assert survivors(r.run_id) == []
  r = guarded.run_python("import subprocess\nsubprocess.run(['true'])\n")
  assert not r.ok and r.reason.startswith("forbidden:"), r


def test_fork_limit_and_bomb_without_guard(kernel_only):
  """The kernel caps processes (RLIMIT_NPROC) and the pid namespace reaps all."""
  if "rlimit_nproc" not in kernel_only.enforced:
    # Without namespaces and without a uid of its own, the process limit is
    # either absent (root keeps uid 0, which the kernel exempts) or shared with
    # the caller's processes; the sandbox must not claim it, and the bomb is
    # not run.
    assert kernel_only.isolation == "rlimits"
    return
  wide = ("import os, time\nn = 0\nfor i in range(40):\n"
          "  try:\n    pid = os.fork()\n  except OSError:\n    break\n"
          "  if pid == 0:\n    time.sleep(0.5)\n    os._exit(0)\n  n += 1\nprint(n)\n")
  r = kernel_only.run_python(wide)
  assert r.ok, r
  assert 1 <= int(r.stdout) < LIMITS.max_processes  # the worker itself counts as one
  # A real (depth-bounded, so safe even if uncapped: 2**6 processes) bomb
  # that spins forever: capped, then killed with everything it spawned.
  bomb = ("import os\nfor i in range(6):\n  try:\n    os.fork()\n"
          "  except OSError:\n    print('fork_failed', flush=True)\nwhile True:\n  pass\n")
  r = kernel_only.run_python(bomb)
  assert not r.ok and r.reason in TIME_REASONS, r
  assert "fork_failed" in r.stdout
  assert survivors(r.run_id) == []


def test_memory_bomb(guarded, kernel_only):
  for sandbox in (guarded, kernel_only):
    r = sandbox.run_python("b = bytearray(1 << 30)\nprint(len(b))")
    assert not r.ok and r.reason == "memory_limit", r


def test_output_flood(guarded):
  r = guarded.run_python("import sys\nfor _ in range(100):\n  sys.stdout.write('x' * (1 << 20))\n")
  assert not r.ok and r.reason == "output_limit", r
  assert len(r.stdout) <= LIMITS.output_bytes
  assert r.wall_s < LIMITS.wall_s + 1.0


@pytest.fixture
def outside():
  """A directory the test owns, outside the sandbox's, that anyone may write.

  It lives directly under the system temp dir (pytest's tmp_path sits under a
  0700 directory, where plain file permissions would already stop a program
  running as "nobody"): only the sandbox itself can stop the write here.
  """
  path = pathlib.Path(tempfile.mkdtemp(prefix="opd-sandbox-test-"))
  path.chmod(0o777)
  yield path
  shutil.rmtree(path)


def test_write_outside_blocked_by_guard(guarded, outside):
  target = outside
  for src in (f"open({str(target / 'pwned')!r}, 'w').write('x')",
              f"import os; os.mkdir({str(target / 'pwned')!r})",
              f"import os; open('x', 'w').close(); os.rename('x', {str(target / 'pwned')!r})"):
    r = guarded.run_python(src)
    assert not r.ok and r.reason.startswith("forbidden:"), (src, r)
    assert not (target / "pwned").exists()


def test_write_outside_blocked_by_kernel(kernel_only, outside):
  target = outside
  r = kernel_only.run_python(f"open({str(target / 'pwned')!r}, 'w').write('x')")
  if "filesystem" in kernel_only.provides:
    # The host directory does not exist in the program's root at all.
    assert not r.ok and "No such file or directory" in r.stderr, r
    assert not (target / "pwned").exists()
  r = kernel_only.run_python("open('/usr/pwned', 'w').write('x')")
  if "readonly_root" in kernel_only.enforced:
    assert not r.ok and "Read-only file system" in r.stderr, r
    assert not os.path.exists("/usr/pwned")
  if "filesystem" in kernel_only.provides:
    assert "readonly_root" in kernel_only.enforced
  else:
    # Documented: without a mount namespace only the Python guard stops writes.
    assert kernel_only.isolation == "rlimits"
    (target / "pwned").unlink(missing_ok=True)


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "kernel_only"])
def test_network_connection_blocked(guarded, kernel_only, guard):
  sandbox = guarded if guard else kernel_only
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    r = sandbox.run_python(
        f"import socket\ns = socket.socket()\ns.settimeout(0.5)\ns.connect(('127.0.0.1', {port}))\n"
        "print('connected')")
    try:
      conn, _ = server.accept()
      conn.close()
      connected = True
    except BlockingIOError:
      connected = False
  if guard or "network_namespace" in sandbox.enforced:
    assert not r.ok and "connected" not in r.stdout, r
    assert not connected
    if guard:
      assert r.reason == "forbidden:socket.__new__"
  else:
    assert sandbox.isolation == "rlimits"  # documented: no network isolation


def test_setsid_escapee_is_killed(kernel_only):
  """A child that leaves the process group still dies with the pid namespace."""
  src = ("import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(3)\n"
         "print('parent done')\n")
  r = kernel_only.run_python(src)
  if "pid_namespace" in kernel_only.enforced:
    assert r.ok and r.stdout == "parent done\n", r
    assert survivors(r.run_id) == []
  else:
    assert kernel_only.isolation == "rlimits"


def test_guard_contains_python_hazards(guarded, outside):
  """The guard stops writes, sockets and forks itself (the reason names it),
  at every level: with no namespaces it is all there is."""
  sandbox = guarded
  # A directory that exists where the program runs (the host's temp dir is
  # not in a namespaces level's root at all), so only the guard can stop it.
  target = outside if "filesystem" not in sandbox.provides else pathlib.Path("/usr")
  assert sandbox.run_python(f"open({str(target / 'p')!r}, 'w')").reason == "forbidden:open"
  assert not (target / "p").exists()
  assert sandbox.run_python("import socket; socket.socket()").reason == "forbidden:socket.__new__"
  assert sandbox.run_python("import os; os.fork()").reason == "forbidden:os.fork"
  assert sandbox.run_python("import ctypes").reason.startswith("forbidden:")
  # Indirect routes to the outside directory: a directory descriptor for
  # dir_fd=, a symlink, a hard link, a thread racing the checks.
  tricks = [f"import os\nfd = os.open({str(target)!r}, os.O_RDONLY)\n"
            "os.close(os.open('p', os.O_WRONLY | os.O_CREAT, dir_fd=fd))",
            f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link/p', 'w')",
            f"import os\nos.symlink({str(target / 'p')!r}, 'link')\nopen('link', 'w')",
            f"import os\nos.link({str(target / 'p')!r}, 'hard')",
            "import threading\nthreading.Thread(target=print).start()"]
  for src in tricks:
    r = sandbox.run_python(src)
    assert r.reason.startswith("forbidden:"), (src, r)
  assert not (target / "p").exists()
  r = sandbox.run_python("open('ok.txt', 'w').write('fine'); print(open('ok.txt').read())")
  assert r.ok and r.stdout == "fine\n"


def test_caller_is_unaffected(guarded):
  limits = {r: resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC,
                                                resource.RLIMIT_CPU, resource.RLIMIT_NOFILE)}
  runs = [guarded.run_python("import os\nwhile True:\n  os.fork()\n"),
          guarded.run_python("b = bytearray(1 << 30)")]
  assert {r: resource.getrlimit(r) for r in limits} == limits
  for r in runs:  # private directories are gone
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"opd-sandbox-{r.run_id}-*")) == []
  assert subprocess.run(["true"]).returncode == 0
  buf = bytearray(64 << 20)
  assert len(buf) == 64 << 20
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))


def test_isolation_probe_is_consistent():
  report = isolation_report()
  assert set(report) == set(ISOLATION_LEVELS)
  level = probe_isolation()
  assert report[level] == "available"
  assert Sandbox(LIMITS).isolation == level
  assert level == next(lv for lv in ISOLATION_LEVELS if report[lv] == "available")
  for other in ISOLATION_LEVELS:
    if report[other] != "available":
      with pytest.raises(ValueError, match="not available"):
        Sandbox(LIMITS, isolation=other)


def test_bad_arguments_raise(guarded):
  with pytest.raises(ValueError, match="require"):
    Sandbox(LIMITS, require=("filesystem", "gpu"))
  with pytest.raises(ValueError, match="cpu_s"):
    SandboxLimits(cpu_s=0)
  with pytest.raises(ValueError, match="memory_bytes"):
    SandboxLimits(memory_bytes=1024)
  with pytest.raises(ValueError, match="isolation"):
    Sandbox(isolation="docker")
  with pytest.raises(ValueError, match="source"):
    guarded.run_python(b"print(1)")
  with pytest.raises(ValueError, match="relative path"):
    guarded.run_python("pass", files={"../escape": "x"})
  with pytest.raises(ValueError, match="argv"):
    guarded.run("echo hi")
