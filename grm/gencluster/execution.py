"""Running untrusted functions on many inputs in the sandbox (docs/DESIGN.md §7).

Every model-written program of GENCLUSTER (candidates, input generators,
validators) is a function ``f``; ``function_program`` appends the sandbox's
function harness (``opd.tasks.sandbox.harness``, shared with the code task),
which calls it on each input (one ``try`` per call, so an exception costs
that input only) and prints one marker line holding, per input,
``("ok", repr)`` or ``("error", name)``. ``run_programs`` runs a list of programs through
``opd.tasks.sandbox.run_python_batch`` (one sandbox set-up per chunk, each
program still alone in its own process, uid and work directory, with the
sandbox's CPU, wall-time, memory and output limits) in ``workers``
concurrent chunks, i.e. that many sandbox process trees at once.
``read_outputs`` turns a run into per-input outputs, or a failure reason when
the program as a whole failed (a limit, a signal, a guard denial): a hostile
program costs its own slot and nothing else.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from opd.tasks.sandbox import Sandbox, SandboxResult, harness, run_python_batch

MARK = "@@GENCLUSTER@@"
EMPTY = "empty"      # the function returned None: it printed nothing to compare


def function_program(source: str, inputs: Sequence[Sequence]) -> str:
  """``source`` (defining ``f``) plus the harness calling ``f(*args)`` for each input."""
  return harness.function_program(source, inputs, MARK)


@dataclasses.dataclass(frozen=True)
class Outputs:
  """``values``: per input ``"ok:<repr>"``, ``"error:<name>"`` or ``EMPTY``; None when
  ``failure`` (the program failed as a whole: ``"sandbox:<reason>"``)."""
  values: tuple[str, ...] | None
  failure: str | None

  @property
  def ok(self) -> bool:
    return self.failure is None


def read_outputs(result: SandboxResult, n_inputs: int) -> Outputs:
  """The per-input outputs of one harness run."""
  if result.infrastructure_error:
    raise RuntimeError(f"sandbox infrastructure error: {result.reason}")
  if not result.ok:
    return Outputs(None, f"sandbox:{result.reason}")
  if not any(ln.startswith(MARK) for ln in result.stdout.splitlines()):
    return Outputs(None, "sandbox:no_results")
  raw = harness.read_results(result.stdout, n_inputs, MARK)
  if raw is None:
    return Outputs(None, "sandbox:unreadable_results")
  return Outputs(tuple(EMPTY if item == ("ok", "None") else f"{item[0]}:{item[1]}"
                       for item in raw), None)


def value_of(output: str):
  """The Python value of an ``"ok:<repr>"`` output (``nan`` and ``inf`` included)."""
  if not output.startswith("ok:"):
    raise ValueError(f"output={output[:40]!r} is not an ok output")
  return harness.literal(output[3:])


@dataclasses.dataclass
class RunStats:
  """Programs run and the wall seconds spent in ``run_programs`` (throughput)."""
  programs: int = 0
  wall_s: float = 0.0

  @property
  def programs_per_s(self) -> float:
    return self.programs / self.wall_s if self.wall_s > 0 else 0.0


def run_programs(sandbox: Sandbox, sources: Sequence[str], *, workers: int = 2,
                 chunk: int = 32, stats: RunStats | None = None,
                 desc: str = "sandbox") -> list[SandboxResult]:
  """``[sandbox.run_python(s) for s in sources]``, batched and concurrent.

  Args:
    sandbox: the sandbox (its limits apply to every program).
    sources: program texts.
    workers: chunks run at once (each its own sandbox process tree).
    chunk: programs per ``run_python_batch`` call.
    stats: counts the programs and the wall time, when given.
  """
  for name, v in (("workers", workers), ("chunk", chunk)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name}={v!r} must be an int >= 1")
  sources = list(sources)
  start = time.perf_counter()
  chunks = [list(range(i, min(i + chunk, len(sources)))) for i in range(0, len(sources), chunk)]
  results: list[SandboxResult | None] = [None] * len(sources)
  with tqdm(total=len(sources), desc=desc, unit="prog", leave=False) as bar, \
      concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(chunks)))) as pool:
    futures = {pool.submit(run_python_batch, sandbox, [sources[i] for i in idx]): idx
               for idx in chunks}
    for fut in concurrent.futures.as_completed(futures):
      idx = futures[fut]
      for i, r in zip(idx, fut.result()):
        results[i] = r
      bar.update(len(idx))
  if stats is not None:
    stats.programs += len(sources)
    stats.wall_s += time.perf_counter() - start
  return results  # type: ignore[return-value]


def run_functions(sandbox: Sandbox, sources: Sequence[str], inputs: Sequence[Sequence[Sequence]],
                  **kwargs) -> list[Outputs]:
  """Runs ``sources[i]`` (each defining ``f``) on ``inputs[i]``; per-input outputs."""
  if len(sources) != len(inputs):
    raise ValueError(f"{len(sources)} sources but {len(inputs)} input lists")
  results = run_programs(sandbox, [function_program(s, x) for s, x in zip(sources, inputs)],
                         **kwargs)
  return [read_outputs(r, len(x)) for r, x in zip(results, inputs)]
