"""The four escapes of the third sandbox red-team, each as a hostile test.

E1 signals the supervisor (pid 1) through ``pidfd_send_signal``, which raises
no audit event; E2 switches the Python guard off from inside by hanging a
descriptor on the class of its frozen namespaces; E3 makes ``compile`` fail
with ``MemoryError`` / ``RecursionError``; E4 adds a key to the host kernel's
keyrings. Each must end as the program's own failure, never ``ok`` and never
an infrastructure error (``sandbox_error``, ``SandboxFailure``), through
``Sandbox.run_python``, ``run_python_batch``, ``CodeTask.verify`` /
``verify_batch`` and GENCLUSTER's batch runner, at every level offered here
and in ``namespaces-user`` run by an unprivileged uid (E1 reached the
supervisor only there: it shares the program's uid). A hostile batch leaves
no key, temporary directory, cgroup or process behind.
"""
import glob
import json
import os
import pathlib
import random
import runpy
import shutil
import subprocess
import sys
import tempfile

import pytest

from grm.gencluster import execution
from opd.tasks.code_task import CodeTask
from opd.tasks.sandbox import api as sandbox_api
from opd.tasks.sandbox.api import (KERNEL_ISOLATION, UID_BASE, IsolationUnavailable, Sandbox,
                                   SandboxLimits, SandboxResult, isolation_report)
from opd.tasks.sandbox import seccomp
from opd.tasks.sandbox.batch import run_python_batch

LIMITS = SandboxLimits(cpu_s=2, wall_s=3.0)
LEVELS = [level for level, state in isolation_report().items() if state == "available"]
FAILED = ("exit_code:", "forbidden:", "signal:", "memory_limit", "supervisor_")
GOOD = "print(sum(range(10)))"  # a neighbour in every batch; prints 45
DRIVER = pathlib.Path(__file__).with_name("sandbox_user_driver.py")
ALLOW_ALL = runpy.run_path(str(DRIVER))["ALLOW_ALL"]

_ADD_KEY = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\n"
            "r = libc.syscall(ctypes.c_long({nr}), b'user', b'opd-escape-e4', b'v', "
            "ctypes.c_long(1), ctypes.c_long(-4))\n"  # -4: KEY_SPEC_USER_KEYRING
            "if r == -1:\n  raise OSError(ctypes.get_errno(), 'add_key')\n")
# E2: a property on the guard's namespace class runs inside the audit hook,
# finds the hook's `check` through the frames and empties its deny sets.
_GUARD_OFF = """
import os, sys
def _grab(self):
  f = sys._getframe(1)
  while f is not None:
    chk = f.f_locals.get('check')
    for c in (getattr(chk, '__closure__', None) or ()):
      if isinstance(c.cell_contents, frozenset):
        c.cell_contents = frozenset()
    f = f.f_back
  return os.lstat
for _c in object.__subclasses__():
  if _c.__name__ in ('_Frozen', 'SimpleNamespace'):
    try:
      _c.lstat = property(_grab)
    except TypeError:
      pass
open('trigger', 'w').close()
"""


def _add_key_nr() -> int:
  import pyseccomp
  return pyseccomp.resolve_syscall(pyseccomp.system_arch(), "add_key")


def _indent(text: str) -> str:
  return "".join(f"  {line}\n" for line in text.splitlines())


def escapes() -> dict[str, str]:
  """name -> program body (top-level code; also run as the body of ``f``)."""
  add_key = _ADD_KEY.format(nr=_add_key_nr())
  return {
      "E1_pidfd_signal": "import os, signal\n"
                         "signal.pidfd_send_signal(os.pidfd_open(1), signal.SIGINT)\n",
      "E2_guard_off": _GUARD_OFF + add_key,
      "E3_compile": "y = " + "-" * 200000 + "1\n",
      "E4_add_key": add_key,
  }


def as_function(body: str) -> str:
  """A code answer running ``body`` when called, then returning None (never
  an expected int): reward 0 however the attack ends."""
  if body.startswith("y = -"):  # E3 as an answer: deep enough to fail compile, not ast.parse
    return "def f(x):\n  return " + "-" * 3500 + "x\n"
  return "def f(x):\n" + _indent(body) + "  return None\n"


def assert_program_failed(r: SandboxResult, what):
  assert not r.ok and not r.infrastructure_error and r.reason.startswith(FAILED), (what, r)


@pytest.fixture
def deep_host_parser():
  """The host parses deeper answers than the sandbox compiles (issue: E3)."""
  old = sys.getrecursionlimit()
  sys.setrecursionlimit(5000)
  yield
  sys.setrecursionlimit(old)


@pytest.fixture(scope="module", params=[(lv, g) for lv in LEVELS for g in (True, False)],
                ids=lambda p: f"{p[0]}-{'guard' if p[1] else 'kernel_only'}")
def sandbox(request):
  level, guard = request.param
  return Sandbox(LIMITS, isolation=level, python_guard=guard)


def test_escapes_fail_as_the_program_through_every_runner(sandbox, deep_host_parser):
  progs = escapes()
  for name, body in progs.items():
    assert_program_failed(sandbox.run_python(body), name)
  batch = run_python_batch(sandbox, [GOOD] + list(progs.values()) + [GOOD])
  assert batch[0].ok and batch[0].stdout == "45\n" and batch[-1].stdout == "45\n", batch
  for name, r in zip(progs, batch[1:-1]):
    assert_program_failed(r, ("batch", name))
  task = CodeTask(sandbox)
  example = task.examples("train", 1, seed=0, difficulty=1)[0]
  answers = [as_function(body) for body in progs.values()]
  singles = [task.verify(example, a) for a in answers]  # SandboxFailure would raise here
  batched = task.verify_batch([example] * len(answers), answers)
  for name, one, many in zip(progs, singles, batched):
    assert one.reward == 0.0 and one.format == 1.0, (name, one)
    assert many == one, (name, many, one)
  inputs = [[[1], [2]]] * len(answers)
  outputs = execution.run_functions(sandbox, answers, inputs, workers=2, chunk=8)
  for name, out in zip(progs, outputs):  # the program's failure: its slot, no exception
    assert not out.ok or all(v.startswith("error:") for v in out.values), (name, out)


def _reader_interpreter() -> str:
  """This Python's version as a system interpreter any uid can read."""
  name = f"python{sys.version_info.major}.{sys.version_info.minor}"
  for directory in ("/usr/bin", "/usr/local/bin", "/bin"):
    path = os.path.join(directory, name)
    real = os.path.realpath(path)
    parents = [real[:i] or "/" for i, c in enumerate(real) if c == "/"]
    if os.path.exists(real) and all(os.stat(d).st_mode & 0o001 for d in parents):
      return path  # every directory on the way may be entered by any uid
  pytest.fail(f"no {name} that an unprivileged uid can run is installed in /usr/bin, "
              "/usr/local/bin or /bin: namespaces-user cannot be exercised by a root caller")


def user_mode(guard: bool, single: list[str], batch: list[str],
              allow_all_filter: bool = False) -> dict:
  """Results of ``namespaces-user`` runs made by an unprivileged caller
  (``allow_all_filter``: with a seccomp filter that allows every call)."""
  request = {"guard": guard, "single": single, "batch": batch,
             "allow_all_filter": allow_all_filter}
  if os.geteuid() != 0:  # already unprivileged: run here
    if allow_all_filter:
      monkeypatch = pytest.MonkeyPatch()
      monkeypatch.setattr(seccomp, "program_filter", lambda: ALLOW_ALL)
    box = Sandbox(LIMITS, isolation="namespaces-user", python_guard=guard)
    got = {"isolation": box.isolation, "enforced": box.enforced,
           "single": [box.run_python(s) for s in single],
            "batch": run_python_batch(box, batch)}
    if allow_all_filter:
      monkeypatch.undo()
    return got
  uid = UID_BASE - 1 - random.randrange(2**16)  # outside the per-run range; no account uses it
  repo = pathlib.Path(__file__).resolve().parents[3]
  site = os.path.dirname(os.path.dirname(os.path.abspath(__import__("numpy").__file__)))
  proc = subprocess.run([_reader_interpreter(), "-I", str(DRIVER), str(repo), site],
                        input=json.dumps(request), capture_output=True, text=True, user=uid,
                        group=uid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                        timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout)
  for key in ("single", "batch"):
    got[key] = [SandboxResult(**{**r, "enforced": tuple(r["enforced"])}) for r in got[key]]
  return got


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "kernel_only"])
def test_escapes_fail_as_the_program_in_user_mode(guard, deep_host_parser):
  """``namespaces-user`` by an unprivileged caller (run under another uid when
  the suite runs as root): the verdicts, and how the code task and
  GENCLUSTER read them (``verify`` is ``_score`` of one run, ``verify_batch``
  of a batched one; the runs cross a process boundary here)."""
  progs = escapes()
  task = CodeTask(Sandbox(LIMITS, isolation=LEVELS[0]))
  example = task.examples("train", 1, seed=0, difficulty=1)[0]
  answers = [task._program(example, as_function(body)) for body in progs.values()]
  inputs = [[1], [2]]
  functions = [execution.function_program(as_function(body), inputs) for body in progs.values()]
  got = user_mode(guard, list(progs.values()) + answers,
                  [GOOD] + list(progs.values()) + answers + functions + [GOOD])
  assert got["isolation"] == "namespaces-user"
  n = len(progs)
  single, batch = got["single"], got["batch"]
  assert batch[0].stdout == "45\n" and batch[-1].stdout == "45\n", batch
  for i, name in enumerate(progs):
    for r in (single[i], batch[1 + i]):
      assert_program_failed(r, ("program", name))
    for r in (single[n + i], batch[1 + n + i]):  # CodeTask: reward 0, no SandboxFailure
      reward = task._score(example, r)
      assert reward.reward == 0.0, (name, reward)
    out = execution.read_outputs(batch[1 + 2 * n + i], len(inputs))  # raises on sandbox_error
    assert not out.ok or all(v.startswith("error:") for v in out.values), (name, out)


def test_supervisor_ignores_the_programs_signals():
  """Under the filter, the supervisor itself ignores what reaches it: with a
  filter that allows every call, signals from the program to pid 1 are sent
  and the run is still the program's, ``ok``. By ``kill`` and
  ``pidfd_send_signal`` (Python handles SIGINT, so pid 1's protection alone
  would deliver it; without the blocked signals:
  ``sandbox_error:KeyboardInterrupt``), and through an I/O owner (SIGIO and
  SIGKILL, which that protection drops)."""
  sends = [f"import os, signal\nos.kill(1, signal.{name})\nprint('sent')\n"
           for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGALRM")]
  sends.append("import os, signal\n"
               "signal.pidfd_send_signal(os.pidfd_open(1), signal.SIGINT)\nprint('sent')\n")
  # SIGIO, and SIGKILL as the I/O signal, for a pipe whose owner is made pid 1.
  for sig in (0, 9):
    sends.append("import fcntl, os, time\nr, w = os.pipe()\nfcntl.fcntl(r, fcntl.F_SETOWN, 1)\n"
                 f"fcntl.fcntl(r, 10, {sig})\nfcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC)\n"  # F_SETSIG
                 "os.write(w, b'x')\ntime.sleep(0.1)\nprint('sent')\n")
  got = user_mode(False, sends, sends, allow_all_filter=True)
  assert "seccomp_filter" in got["enforced"]
  for r in got["single"] + got["batch"]:
    assert (r.ok, r.reason, r.stdout) == (True, "ok", "sent\n"), r


def _host_state(run_ids: list[str], uids: set[int]) -> dict:
  """What a run could leave on the host: keys per uid, temp dirs, cgroups, processes."""
  with open("/proc/key-users", encoding="utf-8") as f:
    keys = sorted(line.split(":")[0].strip() for line in f)
  procs = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
          cmdline = f.read()
        owner = os.stat(f"/proc/{entry}").st_uid
      except OSError:
        continue
      if owner in uids or any(run_id.encode() in cmdline for run_id in run_ids):
        procs.append(int(entry))
  # Another pytest worker may be running sandboxes at the same moment: only this
  # test's runs (its run ids, its uids) are attributed to it.
  groups = [g for g in glob.glob("/sys/fs/cgroup/**/opd-sandbox-*", recursive=True)
            if any(run_id in os.path.basename(g) for run_id in run_ids)]
  return {"key_users": [k for k in keys if k.isdigit() and int(k) in uids],
          "tmp": sorted(os.listdir(tempfile.gettempdir())), "cgroups": sorted(groups),
          "processes": sorted(procs)}


def test_hostile_batch_leaves_nothing_behind(monkeypatch):
  """Keys, temp dirs, cgroups and processes: equal before and after a batch of
  hostile programs (keyrings, a setsid daemon, forks, files), guard off."""
  private_tmp = tempfile.mkdtemp(prefix="opd-escapes-tmp-")
  os.chmod(private_tmp, 0o711)  # as /tmp: the per-run uid passes through to its own directory
  monkeypatch.setattr(tempfile, "tempdir", private_tmp)
  try:
    kernel_only = Sandbox(LIMITS, isolation=LEVELS[0], python_guard=False)
    hostile = list(escapes().values()) + [
        "import os\nprint(os.getuid(), flush=True)\nif os.fork() == 0:\n  os.setsid()\n"
        "  if os.fork() == 0:\n    import time\n    time.sleep(30)\n  os._exit(0)\n",
        "import os\nprint(os.getuid(), flush=True)\nfor i in range(5):\n  open(f'f{i}', 'w')"
        ".write('x' * 1000)\nos.mkdir('d')\n",
    ]
    before = _host_state([], set())
    assert before == {"key_users": [], "tmp": [], "cgroups": [], "processes": []}
    results = run_python_batch(kernel_only, [GOOD] + hostile)
    results += [kernel_only.run_python(hostile[3])]  # E4 alone too
    run_ids = [r.run_id for r in results] + [r.run_id.rsplit("-", 1)[0] for r in results]
    uids = {int(r.stdout.split()[0]) for r in results if r.stdout.split()
            and r.stdout.split()[0].isdigit() and r.stdout != "45\n"}
    assert results[0].stdout == "45\n" and len(uids) == 2, results
    after = _host_state(run_ids, uids - {os.geteuid()})
    assert after == before, after
  finally:
    shutil.rmtree(private_tmp)


def test_default_sandbox_fails_closed(monkeypatch, caplog):
  """``Sandbox()`` where only ``rlimits`` works refuses, naming the missing
  isolation; it runs only when the caller asks for the weaker level, with a
  warning that names it."""
  monkeypatch.setattr(sandbox_api, "probe_isolation", lambda: "rlimits")
  monkeypatch.setattr(sandbox_api, "_level_problem", lambda level, uid=None: None)
  with pytest.raises(IsolationUnavailable, match="filesystem, network, processes"):
    Sandbox(LIMITS)
  caplog.set_level("WARNING")
  weak = Sandbox(LIMITS, allow_weaker=True)
  assert weak.isolation == "rlimits" and "isolation='rlimits'" in caplog.text
  caplog.clear()
  named = Sandbox(LIMITS, isolation="rlimits")  # naming the level is the other opt-in
  assert named.provides == () and "isolation='rlimits' chosen explicitly" in caplog.text
  with pytest.raises(IsolationUnavailable):
    Sandbox(LIMITS, isolation="rlimits", require=KERNEL_ISOLATION)
