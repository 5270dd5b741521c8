"""Per-run control groups: one memory and one pids budget for all processes of a run.

A run's cgroup is created next to the caller's own (a child of the cgroup the
caller is in), limited, joined by the launcher before it forks anything, and
removed after the run. cgroup v2 is used where the caller's cgroup delegates
the ``memory`` and ``pids`` controllers to its children; otherwise the v1
``memory`` and ``pids`` hierarchies, where they are mounted and writable (the
common case for root on hybrid-hierarchy hosts). Where neither works (an
unprivileged caller without a delegated subtree), ``problem()`` says why and
the sandbox keeps per-process rlimits only (``Sandbox.enforced`` says which).

To get per-run cgroups as an unprivileged user on a systemd host, run the
job in a delegated scope: ``systemd-run --user --scope -p Delegate=yes CMD``.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)
REMOVE_PATIENCE_S = 10.0  # how long remove() kills and retries before it logs a leftover

_LOCK = threading.Lock()
_PROBED: list[str | None] = []


def _mounts() -> dict[str, str]:
  """``{"v2": mountpoint, "memory": mountpoint, "pids": mountpoint}`` as mounted."""
  found = {}
  with open("/proc/self/mountinfo", encoding="utf-8") as f:
    for line in f:
      left, _, right = line.partition(" - ")
      fstype, _, options = (right.split() + ["", "", ""])[:3]
      point = left.split()[4].replace("\\040", " ")
      if fstype == "cgroup2":
        found.setdefault("v2", point)
      elif fstype == "cgroup":
        for controller in ("memory", "pids"):
          if controller in options.split(","):
            found.setdefault(controller, point)
  return found


def _own_paths() -> dict[str, str]:
  """The caller's cgroup per hierarchy: ``{"v2": path, "memory": path, "pids": path}``."""
  paths = {}
  with open("/proc/self/cgroup", encoding="utf-8") as f:
    for line in f:
      hid, controllers, path = line.rstrip("\n").split(":", 2)
      if hid == "0" and not controllers:
        paths["v2"] = path
      for controller in controllers.split(","):
        if controller in ("memory", "pids"):
          paths[controller] = path
  return paths


def _parents() -> tuple[str, dict[str, str]]:
  """``(version, {controller: parent directory})`` for run cgroups, or raises OSError."""
  mounts, own = _mounts(), _own_paths()
  errors = []
  if "v2" in mounts and "v2" in own:
    parent = os.path.join(mounts["v2"], own["v2"].lstrip("/"))
    try:
      with open(os.path.join(parent, "cgroup.subtree_control"), encoding="utf-8") as f:
        enabled = f.read().split()
      if not {"memory", "pids"} <= set(enabled):
        with open(os.path.join(parent, "cgroup.subtree_control"), "w", encoding="utf-8") as f:
          f.write("+memory +pids")
      return "v2", {"memory": parent, "pids": parent}
    except OSError as e:
      errors.append(f"cgroup v2 at {parent}: memory and pids not delegated ({e.strerror})")
  else:
    errors.append("no cgroup v2 mount")
  if all(c in mounts and c in own for c in ("memory", "pids")):
    return "v1", {c: os.path.join(mounts[c], own[c].lstrip("/")) for c in ("memory", "pids")}
  errors.append("no cgroup v1 memory and pids hierarchies")
  raise OSError("; ".join(errors))


class RunCgroup:
  """The cgroup(s) of one run. Create with ``RunCgroup.create``."""

  def __init__(self, version: str, dirs: dict[str, str]):
    self.version = version
    self.dirs = dirs  # controller -> directory (one directory for both in v2)

  @classmethod
  def create(cls, name: str, memory_bytes: int, max_pids: int) -> RunCgroup:
    """Makes and limits a fresh cgroup ``name`` (raises OSError where impossible)."""
    version, parents = _parents()
    dirs = {c: os.path.join(p, name) for c, p in parents.items()}
    group = cls(version, dirs)
    try:
      for d in set(dirs.values()):
        os.mkdir(d, 0o755)
      if version == "v2":
        group._write("memory", "memory.max", memory_bytes)
        group._write("memory", "memory.swap.max", 0, optional=True)
      else:
        group._write("memory", "memory.limit_in_bytes", memory_bytes)
        group._write("memory", "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
      group._write("pids", "pids.max", max_pids)
    except OSError:
      group.remove()
      raise
    return group

  def _write(self, controller: str, name: str, value: int, optional: bool = False):
    path = os.path.join(self.dirs[controller], name)
    if optional and not os.path.exists(path):
      return
    with open(path, "w", encoding="utf-8") as f:
      f.write(str(value))

  @property
  def procs_files(self) -> list[str]:
    """The ``cgroup.procs`` files a process writes its pid to, to join."""
    return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

  def oom_kills(self) -> int:
    """Processes of the run the kernel killed for exceeding the memory budget."""
    name = "memory.events" if self.version == "v2" else "memory.oom_control"
    try:
      with open(os.path.join(self.dirs["memory"], name), encoding="utf-8") as f:
        for line in f:
          key, _, value = line.partition(" ")
          if key == "oom_kill":
            return int(value)
    except OSError:
      pass
    return 0

  def _pids(self) -> set[int]:
    pids = set()
    for procs in self.procs_files:
      try:
        with open(procs, encoding="utf-8") as f:
          pids.update(int(p) for p in f.read().split())
      except OSError:
        pass
    return pids

  def kill(self):
    """SIGKILLs every process still in the run (also those that left its session)."""
    for _ in range(100):
      pids = self._pids()
      if not pids:
        return
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      time.sleep(0.01)

  def remove(self, patience_s: float = REMOVE_PATIENCE_S) -> bool:
    """Kills what is left and removes the directories; never raises.

    A loaded host can take more than a moment to deliver SIGKILL to the last
    processes (or to reap them), and ``rmdir`` fails with ``EBUSY`` until they
    are gone, so this kills again and retries for up to ``patience_s`` seconds.
    Returns whether every directory is gone; one that stays is logged, by path.
    """
    deadline = time.monotonic() + patience_s
    left = set(self.dirs.values())
    while True:
      self.kill()
      for d in sorted(left):
        try:
          os.rmdir(d)
          left.discard(d)
        except FileNotFoundError:
          left.discard(d)
        except OSError:
          pass
      if not left:
        return True
      if time.monotonic() >= deadline:
        log.warning("sandbox cgroup not removed after %.0f s (processes still in it): %s",
                    patience_s, ", ".join(sorted(left)))
        return False
      time.sleep(0.02)  # the last processes are still being reaped


def problem() -> str | None:
  """None when per-run cgroups can be made here, else why not (probed once)."""
  with _LOCK:
    if not _PROBED:
      try:
        RunCgroup.create(f"opd-sandbox-probe-{os.getpid()}", 64 * 2**20, 8).remove()
        _PROBED.append(None)
      except OSError as e:
        _PROBED.append(f"no per-run cgroup: {e}")
    return _PROBED[0]
