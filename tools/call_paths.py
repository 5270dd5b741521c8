"""Call paths from a job's entry to its end points, and how often they climb (docs/DESIGN.md §1).

Imports only point down (``tests/test_layering.py``), but calls may still run
back up through callbacks: a trainer in ``opd/training`` calling a loss that
``opd/distill`` handed it. This tool measures that on a real run. It runs a
job's tiny config in-process under ``sys.setprofile`` (and
``threading.setprofile``) and, at every call that enters the job's *end
point* from outside it, records the stack of repo frames (files under
``pallas_kernels/``, ``opd/``, ``grm/``, ``experiments/``; jax's and the
standard library's frames in between are left out), outermost first.

A *climb* is a consecutive caller -> callee pair of that stack whose callee
ranks higher than its caller. Ranks are ``tests/test_layering.py``'s:
``pallas_kernels`` < ``opd`` < ``grm`` < ``experiments``, and inside ``opd``
the subpackages by their rank there (``config`` 0, ``models`` / ``text`` /
``parallel`` 1, ``tasks`` / ``training`` 2, ``rollout`` 3, ``rl`` / ``eval``
4, ``distill`` 5; a module directly under ``opd/`` ranks like ``config``).
A call is *inside* the end point when its nearest repo caller is in the end
point too, so each stack ends at the first end-point frame.

The jobs measured (``JOBS``):

* ``opd``: ``experiments/configs/distill.py:tiny`` (``run_opd``); end point:
  every call into ``pallas_kernels/``.
* ``grm``: ``experiments/configs/grm.py:tiny``, stacks through the benchmark
  stage (``experiments/grm_benchmark.py``) only; end points: the judges'
  model forward (``opd/models/``) and the voting (``grm/voting.py``).

Usage (prints every distinct stack, its count and its climbs, then a summary)::

  python tools/call_paths.py opd --workdir /tmp/call_paths_opd
  python tools/call_paths.py grm --workdir /tmp/call_paths_grm [--json stacks.json]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import sys
import threading
from typing import Callable, Iterable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The same ranks as tests/test_layering.py (tests/test_call_paths.py checks they agree).
TOP = {"pallas_kernels": 0, "opd": 1, "grm": 2, "experiments": 3}
OPD = {"config": 0, "models": 1, "text": 1, "parallel": 1, "tasks": 2, "training": 2,
       "rollout": 3, "rl": 4, "eval": 4, "distill": 5}

Frame = tuple[str, str]  # (path relative to the repo, function name)
Stack = tuple[Frame, ...]


def rank(path: str) -> tuple[int, int]:
  """``(layer, opd subpackage rank)`` of a repo-relative ``path`` (module docstring).

  Raises:
    ValueError: ``path`` is not in one of the four packages.
  """
  parts = path.split("/")
  if parts[0] not in TOP:
    raise ValueError(f"path={path!r} is not under one of {sorted(TOP)}")
  if parts[0] == "opd" and len(parts) > 2:
    if parts[1] not in OPD:
      raise ValueError(f"path={path!r}: opd subpackage {parts[1]!r} has no rank in OPD")
    return TOP["opd"], OPD[parts[1]]
  return TOP[parts[0]], 0


def climbs(stack: Sequence[Frame]) -> list[int]:
  """Indices i where ``stack[i] -> stack[i + 1]`` climbs (the callee ranks higher)."""
  return [i for i in range(len(stack) - 1) if rank(stack[i + 1][0]) > rank(stack[i][0])]


class CallPaths:
  """Records the stacks of repo frames at each call entering an end point.

  Use as a context manager around the run; ``stacks`` then counts each
  distinct stack (outermost frame first, the end point's frame last).

  Args:
    end_point: ``end_point(path, function) -> bool`` for repo-relative paths.
    via: keep only the stacks that pass through this repo-relative file
      (None: all).
    root: the repository whose files count as repo frames.
  """

  def __init__(self, end_point: Callable[[str, str], bool], via: str | None = None,
               root: pathlib.Path = ROOT):
    self.end_point, self.via = end_point, via
    self.prefix = str(pathlib.Path(root).resolve()) + os.sep
    self.stacks: collections.Counter[Stack] = collections.Counter()
    self._paths: dict[str, str | None] = {}

  def _path(self, filename: str) -> str | None:
    """The repo-relative path of a code object's file, None outside the four packages."""
    if filename not in self._paths:
      rel = None
      if filename.startswith(self.prefix):
        rel = filename[len(self.prefix):].replace(os.sep, "/")
        if rel.split("/")[0] not in TOP:
          rel = None
      self._paths[filename] = rel
    return self._paths[filename]

  def _profile(self, frame, event, arg):
    del arg
    if event != "call":
      return
    path = self._path(frame.f_code.co_filename)
    if (path is None or frame.f_code.co_name == "<module>"  # an import, not a call
        or not self.end_point(path, frame.f_code.co_name)):
      return
    stack, f = [], frame
    while f is not None:
      p = self._path(f.f_code.co_filename)
      if p is not None:
        if len(stack) == 1 and self.end_point(p, f.f_code.co_name):
          return  # the nearest repo caller is in the end point: a call inside it
        stack.append((p, f.f_code.co_name))
      f = f.f_back
    if self.via is None or any(p == self.via for p, _ in stack):
      self.stacks[tuple(reversed(stack))] += 1

  def __enter__(self) -> "CallPaths":
    sys.setprofile(self._profile)
    threading.setprofile(self._profile)
    return self

  def __exit__(self, *exc) -> None:
    sys.setprofile(None)
    threading.setprofile(None)


@dataclasses.dataclass(frozen=True)
class Job:
  """A job to trace: its config (``file.py:variant`` under experiments/configs),
  its end point and the file its stacks must pass through."""
  config: str
  end_point: Callable[[str, str], bool]
  via: str


JOBS = {
    "opd": Job("distill.py:tiny", lambda path, fn: path.startswith("pallas_kernels/"),
               "experiments/distill.py"),
    "grm": Job("grm.py:tiny", lambda path, fn: path.startswith("opd/models/")
               or path == "grm/voting.py", "experiments/grm_benchmark.py"),
}


def trace_job(name: str, workdir: str | pathlib.Path, **overrides) -> collections.Counter:
  """Runs ``JOBS[name]`` in-process in ``workdir`` and returns its stacks' counts.

  Args:
    name: a key of ``JOBS``.
    workdir: the job's run directory.
    **overrides: top-level config fields replaced before the launch (e.g.
      ``mesh=(1, 1, 1)`` in a process with several devices).
  """
  if name not in JOBS:
    raise ValueError(f"job={name!r}: expected one of {sorted(JOBS)}")
  import importlib  # noqa: PLC0415 (the jobs import jax: only when tracing)
  from experiments import launch  # noqa: PLC0415
  job = JOBS[name]
  file, variant = job.config.split(":")
  module = importlib.import_module(f"experiments.configs.{file.removesuffix('.py')}")
  config = module.get_config(variant)
  for key, value in overrides.items():
    if key not in config:
      raise ValueError(f"override {key}={value!r}: {job.config} has no field {key!r}")
    config[key] = value
  with CallPaths(job.end_point, via=job.via) as paths:
    launch.launch(config, workdir)
  return paths.stacks


def render(stacks: collections.Counter) -> list[str]:
  """Every distinct stack (most frequent first) with its climbs marked, then a summary line."""
  lines = []
  for stack, n in stacks.most_common():
    up = set(climbs(stack))
    lines.append(f"{n} calls, {len(stack)} frames, {len(up)} climbs")
    for i, (path, fn) in enumerate(stack):
      mark = "  ^ climbs" if i - 1 in up else ""
      lines.append(f"    {rank(path)} {path} {fn}{mark}")
  lines.append(summary(stacks))
  return lines


def summary(stacks: Iterable[Stack]) -> str:
  """Distinct stacks, the most frames and the most climbs on one."""
  stacks = list(stacks)
  return (f"{len(stacks)} distinct stacks; most frames {max((len(s) for s in stacks), default=0)}"
          f"; most climbs {max((len(climbs(s)) for s in stacks), default=0)}")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("job", choices=sorted(JOBS))
  parser.add_argument("--workdir", required=True, help="run directory of the traced job")
  parser.add_argument("--json", help="also write the stacks here: [{count, stack: [[path, "
                      "function], ...]}, ...]")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(ROOT))
  stacks = trace_job(args.job, args.workdir)
  print("\n".join(render(stacks)))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        [{"count": n, "stack": [list(f) for f in s]} for s, n in stacks.most_common()]))


if __name__ == "__main__":
  main()
