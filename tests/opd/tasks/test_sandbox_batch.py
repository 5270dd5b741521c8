"""Batched sandbox runs (opd.tasks.sandbox.batch) give the results of single runs.

The reference is ``Sandbox.run_python``, one run per program (the path every
program took before batching). Programs that end by themselves must come
from the batch (their ``run_id`` is the batch's plus ``-i``) with the same
reason, exit status, stdout and stderr; programs that hit a limit or the
guard are run again alone, so their verdicts are single-run verdicts. One
program's files never reach the next.
"""
import pytest

from opd.tasks import get_task
from opd.tasks.sandbox.api import Sandbox, SandboxLimits
from opd.tasks.sandbox.batch import _records, run_python_batch

FINISHING = [
    "print('hello')",
    "raise ValueError('boom')",  # traceback on stderr, exit status 1
    "import sys\nsys.stdout.write('partial')\nsys.exit(3)",
    "def f(:\n  pass",  # a syntax error is the program's own fault
    "open('left.txt', 'w').write('x')\nprint(sorted(__import__('os').listdir('.')))",
    "import os\nprint(sorted(os.listdir('.')))",  # must not see left.txt
    "print(sum(i * i for i in range(10**5)))",
]
LIMITED = ["while True:\n  pass", "print('x' * 200000)", "open('/tmp/opd-batch-test', 'w')"]


@pytest.fixture(scope="module")
def sandbox():
  return Sandbox(SandboxLimits(cpu_s=1, wall_s=1.5))


def test_batch_equals_single_runs(sandbox):
  sources = FINISHING + LIMITED + FINISHING[:1]
  batch = run_python_batch(sandbox, sources)
  single = [sandbox.run_python(s) for s in sources]
  assert len(batch) == len(sources)
  for i, (b, s) in enumerate(zip(batch, single)):
    if sources[i] == LIMITED[0]:  # CPU or wall limit, whichever the load lets fire first
      assert {b.reason, s.reason} <= {"cpu_time_limit", "wall_time_limit"}
    else:
      assert (b.ok, b.reason, b.returncode, b.stdout, b.stderr) == (
          s.ok, s.reason, s.returncode, s.stdout, s.stderr), sources[i]
  batch_id = batch[0].run_id.rsplit("-", 1)[0]
  from_batch = [i for i, b in enumerate(batch) if b.run_id == f"{batch_id}-{i}"]
  expected = [i for i, src in enumerate(sources) if src not in LIMITED]
  if sandbox.isolation == "rlimits":  # no pid namespace: every program runs alone
    expected = []
  assert from_batch == expected
  assert batch[5].stdout == "[]\n" and batch[4].stdout == "['left.txt']\n"


def test_each_program_has_its_own_uid(sandbox):
  # (Namespace identities cannot be compared the same way: the kernel reuses
  # a freed namespace's inode number for the next program's.)
  runs = run_python_batch(sandbox, ["import os; print(os.getuid())"] * 3)
  assert all(r.ok for r in runs), runs
  if sandbox.isolation == "namespaces-root":  # a fresh uid per program, as per single run
    assert len({r.stdout for r in runs}) == 3


def test_truncated_record_stream_stops_at_last_complete_record():
  def record(status, out, err):
    return f"{len(status)} {len(out)} {len(err)} - 0.01\n".encode() + status + out + err
  data = record(b"started\nexit 0 0.0\n", b"a\n", b"") + record(b"started\n", b"bb", b"e")
  assert [r[1] for r in _records(data, 2)] == [b"a\n", b"bb"]
  assert [r[1] for r in _records(data[:-1], 2)] == [b"a\n"]  # cut inside the second body
  assert _records(b"garbage\n" + data, 2) == []
  assert _records(data, 1)[0][0] == "started\nexit 0 0.0\n"


def test_code_verify_batch_equals_single_run_verify():
  task = get_task("code", sandbox=Sandbox(SandboxLimits(cpu_s=1, wall_s=1.5)), workers=2)
  examples = task.examples("train", 6, seed=3, difficulty=2)
  responses = []
  for i, e in enumerate(examples):
    responses += [e.reference_text, "def f(x, y): return x", "def f(x, y): return x // 0",
                  "no code here", f"def f(x, y): return x + y + {i}"]
  pairs = [(e, r) for e in examples for r in responses[:5]]
  batched = task.verify_batch([e for e, _ in pairs], [r for _, r in pairs])
  assert batched == [task.verify(e, r) for e, r in pairs]
  assert {r.reason.split(":")[0] for r in batched} >= {"ok", "malformed"}


def test_bad_arguments(sandbox):
  with pytest.raises(ValueError, match=r"sources\[1\]"):
    run_python_batch(sandbox, ["print(1)", b"print(2)"])
  with pytest.raises(ValueError, match="sandbox"):
    run_python_batch(object(), ["print(1)"])
