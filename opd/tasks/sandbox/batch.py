"""Many Python programs in one sandbox run: one set-up, each program still alone.

A single ``Sandbox.run_python`` pays for an interpreter start, the launcher's
imports, the namespaces, the program's root and a cgroup (about 50 ms of the
reference machine's CPU) before a model-written function of a few
milliseconds runs; the code verifier's batches were mostly set-up.
``run_python_batch`` pays it once per list of programs. The launcher's
supervisor, pid 1 of the run's pid namespace, runs the programs one after
another, each as a single run would (``launcher._supervise_batch``): a fresh
worker forked from the supervisor, under its own uid, on a fresh, empty work
tmpfs and in fresh IPC, network and UTS namespaces, with its own wall-time
deadline and output cap; then it kills every process left in the pid
namespace before the next program starts. Nothing of one program (files,
processes, IPC objects, sockets, uid budget) reaches the next.

Results are those of single runs, by construction: a program's batched result
is kept only when it ended by itself, within ``KEEP_FRACTION`` of its CPU and
wall budgets, with an exit status (0, or a Python exception) and no OOM kill
in the run's cgroup. Anything else (a limit, a signal, a guard denial, a
set-up error, a batch that died or ran out of time) is run again alone with
``Sandbox.run_python``, whose verdict is returned. What a program could tell
apart is what already differs between two single runs: its uid, pid and
timings. The "rlimits" level has no pid namespace to empty between programs,
so there every program runs alone.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from opd.tasks.sandbox import outcome
from opd.tasks.sandbox.api import UID_BASE, Sandbox, SandboxResult

# A batched result is kept when the program used at most this share of its
# CPU and wall-time budgets (``SandboxLimits.cpu_s`` / ``wall_s``).
KEEP_FRACTION = 0.5
_RECORD_SLACK = 512  # bytes of header and status text per program record


def _records(data: bytes, n: int) -> list[tuple[str, bytes, bytes, str | None, float]]:
  """The supervisor's ``(status, stdout, stderr, killed, wall_s)`` records, in
  order; stops at the first incomplete one (a batch cut short)."""
  out, pos = [], 0
  while len(out) < n:
    end_head = data.find(b"\n", pos)
    if end_head < 0:
      break
    try:
      n_status, n_out, n_err, killed, wall = data[pos:end_head].decode("ascii").split()
      sizes = (int(n_status), int(n_out), int(n_err))
      wall_s = float(wall)
    except ValueError:
      break
    body = data[end_head + 1:end_head + 1 + sum(sizes)]
    if len(body) < sum(sizes):
      break
    status, rest = body[:sizes[0]], body[sizes[0]:]
    out.append((status.decode("utf-8", "replace"), rest[:sizes[1]], rest[sizes[1]:],
                None if killed == "-" else killed, wall_s))
    pos = end_head + 1 + sum(sizes)
  return out


def _kept(sandbox: Sandbox, record, run_id: str) -> SandboxResult | None:
  """The record as a ``SandboxResult`` when a single run would give the same, else None."""
  status, out, err, killed, wall_s = record
  if killed is not None:
    return None
  stderr = err.decode("utf-8", "replace")
  reason, returncode = outcome.classify(None, status, stderr, cpu_limit_s=sandbox.limits.cpu_s,
                                        oom_kills=0, supervisor_reachable=False)
  final = [line.split() for line in status.splitlines() if line.startswith("exit ")]
  if not (reason == "ok" or reason.startswith("exit_code:")) or not final:
    return None
  if (float(final[-1][2]) > KEEP_FRACTION * sandbox.limits.cpu_s
      or wall_s > KEEP_FRACTION * sandbox.limits.wall_s):
    return None
  return SandboxResult(reason == "ok", reason, returncode, out.decode("utf-8", "replace"), stderr,
                       wall_s, sandbox.enforced, run_id)


def run_python_batch(sandbox: Sandbox, sources: Sequence[str]) -> list[SandboxResult]:
  """``[sandbox.run_python(s) for s in sources]``, with one sandbox set-up.

  Args:
    sandbox: a ``Sandbox``; its limits apply to every program.
    sources: Python program texts (no stdin, no extra files).

  Returns:
    One ``SandboxResult`` per program, in order (``run_id`` is the batch's
    id plus ``-i``, or the single run's id for a program run again alone).
  """
  if not isinstance(sandbox, Sandbox):
    raise ValueError(f"sandbox must be a Sandbox, got {type(sandbox).__name__}")
  sources = list(sources)
  for i, source in enumerate(sources):
    if not isinstance(source, str):
      raise ValueError(f"sources[{i}] must be str, got {type(source).__name__}")
  if len(sources) <= 1 or sandbox.isolation == "rlimits":
    return [sandbox.run_python(s) for s in sources]
  limits, n = sandbox.limits, len(sources)
  uids = [(sandbox.sandbox_uid or UID_BASE + random.randrange(2**20))
          if sandbox.isolation == "namespaces-root" else None for _ in sources]

  def launch(base, run_id, program, stdin, files, workdir, drop_uid, group, start):
    run = sandbox._execute(base, run_id, program, stdin, files, workdir, drop_uid, group,
                           start + limits.wall_s * (n + 1), n * (limits.output_bytes + _RECORD_SLACK))
    if isinstance(run, str) or (group is not None and group.oom_kills()):
      return run_id, []
    return run_id, _records(run[0], n)

  got = sandbox._run({"batch": sources, "uids": uids}, "", {}, launch)
  run_id, records = got if isinstance(got, tuple) else ("", [])  # a SandboxResult: no cgroup
  results = []
  for i, source in enumerate(sources):
    kept = _kept(sandbox, records[i], f"{run_id}-{i}") if i < len(records) else None
    results.append(kept if kept is not None else sandbox.run_python(source))
  return results
