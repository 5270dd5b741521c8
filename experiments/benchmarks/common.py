"""Shared benchmark plumbing: machine facts, timing, tables and JSON output.

Every benchmark measures its baseline in the same run, prints a table and
writes ``<name>.json`` (machine, sizes, rows, ratios) under ``--out``
(default ``benchmark_results/``).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time
from typing import Any, Callable, Sequence


def machine_info() -> dict[str, Any]:
  """Facts about this machine and the jax backend, for the JSON record."""
  info: dict[str, Any] = {
      "hostname": platform.node(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "cpu_count": os.cpu_count(),
      "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
  }
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          info["cpu_model"] = line.split(":", 1)[1].strip()
          break
    with open("/proc/meminfo") as f:
      info["mem_total_kib"] = int(f.readline().split()[1])
  except OSError:
    pass
  try:
    import jax
    info["jax"] = jax.__version__
    info["backend"] = jax.default_backend()
    info["devices"] = [str(d) for d in jax.devices()]
    info["device_kind"] = jax.devices()[0].device_kind
  except Exception as e:  # benchmark still records what it can
    info["jax_error"] = repr(e)
  return info


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, iters: int = 5,
            min_time: float = 0.0) -> dict[str, float]:
  """Wall time of ``fn()`` (which must block until done); returns seconds stats."""
  for _ in range(warmup):
    fn()
  times = []
  start = time.perf_counter()
  while len(times) < iters or (time.perf_counter() - start) < min_time:
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  times.sort()
  return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1],
          "iters": len(times)}


def max_rss_mib() -> float:
  """Peak resident memory of this process so far (MiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_isolated(module: str, args: Sequence[str], timeout: float = 1800) -> dict[str, Any]:
  """Runs ``python -m module args`` in a fresh process; it must print one JSON
  object on its last stdout line. Returns it, with the child's peak RSS added
  as ``max_rss_mib`` (from the kernel's accounting of the child)."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=timeout, env=os.environ.copy())
  if proc.returncode:
    raise RuntimeError(f"{module} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  # ru_maxrss of children is the max over all waited-for children; take the
  # child's own report when present, which is exact.
  result.setdefault("max_rss_mib", max(after, before) / 1024.0)
  return result


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
  """A markdown table of ``rows`` (dicts) over ``columns``."""
  if not rows:
    return "(no rows)"
  columns = list(columns or rows[0].keys())

  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)

  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
  return "\n".join(lines)


def write_result(name: str, payload: dict[str, Any], out_dir: str | os.PathLike = "benchmark_results") -> pathlib.Path:
  """Writes ``payload`` plus machine info to ``out_dir/name.json``; returns the path."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{name}.json"
  record = {"benchmark": name, "machine": machine_info(), **payload}
  path.write_text(json.dumps(record, indent=2, default=str))
  return path
