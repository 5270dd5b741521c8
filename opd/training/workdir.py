"""One owner per workdir, and a run's config checked before it is recorded.

A run directory belongs to the process that holds its lock: ``WorkdirLock``
takes an exclusive ``fcntl.flock`` on ``<workdir>/.lock`` for the run's life
and writes its owner (pid, host, start time) inside. The kernel drops the lock
when the process exits, however it exits, so a second launch on the same
directory is refused with the holder named while the first is alive, and a
lock file still naming a dead owner (SIGKILL, power loss) is reported and
taken over. ``flock`` is advisory and per host on some network filesystems:
two hosts sharing a directory over NFS without lock support are not
excluded (docs/DESIGN.md, "Failure model").

``check_config`` compares a relaunch's whole resolved config against the
``config.json`` the directory already holds and names every field that
differs; only fields the user allowed explicitly (``allow_change``) pass,
each with a logged line. ``record_config`` then writes ``config.json``
atomically (``opd.training.files``), keeping a previous, different one
beside it instead of overwriting it.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from opd.config.migrations import migrate
from opd.config.overrides import config_mismatches
from opd.training.files import atomic_write_json, read_json

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"


class WorkdirBusyError(RuntimeError):
  """Another live process holds the workdir's lock."""


class ConfigChangedError(ValueError):
  """A relaunch's config differs from the workdir's ``config.json`` in fields not allowed to change."""


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except OSError as e:
    return e.errno == errno.EPERM  # exists, owned by another user
  return True


def _describe(owner: Mapping[str, Any]) -> str:
  return (f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')!r} "
          f"(since {owner.get('started', '?')})")


class WorkdirLock:
  """An exclusive, process-lifetime lock on a run directory.

  Use as a context manager (``with WorkdirLock(workdir): ...``) or call
  ``acquire()`` / ``release()``. Acquiring never blocks: a held lock raises
  ``WorkdirBusyError`` naming the holder.

  Attributes:
    path: the lock file, ``<workdir>/.lock``.
    stale: after ``acquire()``, the owner record a previous holder left
      without releasing (it died), else None.
  """

  def __init__(self, workdir: str | os.PathLike):
    self.workdir = pathlib.Path(workdir)
    self.path = self.workdir / LOCK_FILE
    self.stale: dict[str, Any] | None = None
    self._fd: int | None = None

  def _read_owner(self, fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    if not text:
      return None
    try:
      owner = json.loads(text)
    except json.JSONDecodeError:
      return {"unreadable": text[:80]}
    return owner if isinstance(owner, dict) else {"unreadable": text[:80]}

  def acquire(self) -> "WorkdirLock":
    """Takes the lock or raises ``WorkdirBusyError`` naming its holder."""
    if self._fd is not None:
      raise RuntimeError(f"{self.path} is already held by this WorkdirLock")
    self.workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (PEP 446)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      owner = self._read_owner(fd)
      os.close(fd)
      who = _describe(owner) if owner else "another process (its owner record not yet written)"
      raise WorkdirBusyError(
          f"workdir {str(self.workdir)!r} is in use by {who} (lock {str(self.path)!r}); wait for "
          "that run to finish, stop it, or launch with another --workdir") from None
    except BaseException:
      os.close(fd)
      raise
    previous = self._read_owner(fd)
    if previous:  # the last holder never released: it died holding the lock
      self.stale = previous
      here = previous.get("host") == socket.gethostname()
      pid = previous.get("pid")
      state = ("that process is gone" if here and isinstance(pid, int) and not _pid_alive(pid)
               else "its pid is alive again (reused)" if here
               else "on another host; the lock was free")
      log.warning("workdir %s: taking over a stale lock left by %s; %s", self.workdir,
                  _describe(previous), state)
    owner = {"pid": os.getpid(), "host": socket.gethostname(),
             "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    """Clears the owner record and drops the lock (a no-op when not held).

    The lock file itself stays: unlinking it would let a process that opened
    the old inode and a process creating a new one both hold "the" lock.
    """
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
    finally:
      os.close(fd)  # closing the descriptor drops the flock

  @property
  def held(self) -> bool:
    return self._fd is not None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _fields(tree: Any, prefix: str = "") -> set[str]:
  """Every dotted path of a nested mapping, groups included."""
  out = set()
  if isinstance(tree, Mapping):
    for key, value in tree.items():
      name = f"{prefix}{key}"
      out.add(name)
      out |= _fields(value, name + ".")
  return out


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
  """``(field, saved value, new value)`` for every leaf that differs, added
  fields (saved ``"<missing>"``) and removed ones (new ``"<missing>"``) included;
  ``saved`` is first brought to today's layout (``opd.config.migrations``)."""
  saved = migrate(saved)
  out = config_mismatches(saved, new)
  # Fields only ``saved`` holds: ``config_mismatches`` reversed reports them as missing.
  out += [(name, want, "<missing>") for name, have, want in config_mismatches(new, saved)
          if have == "<missing>"]
  return sorted(out, key=lambda t: t[0])


def _allowed(field: str, allow: Sequence[str]) -> bool:
  return any(field == a or field.startswith(a + ".") for a in allow)


def check_config(workdir: str | os.PathLike, config: Mapping[str, Any], *,
                 allow_change: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
  """Checks ``config`` (a JSON-ready dict) against ``<workdir>/config.json``.

  Args:
    workdir: the run directory; without a ``config.json`` every config passes.
    config: the relaunch's whole resolved config.
    allow_change: dotted fields (or groups: ``optim`` allows ``optim.lr``) the
      user lets differ; each one that does is logged.

  Returns:
    The allowed changes, ``(field, saved value, new value)``.

  Raises:
    ConfigChangedError: fields outside ``allow_change`` differ (all named).
    ValueError: an ``allow_change`` entry names no field of either config.
    ResultFileError: ``config.json`` is torn or not a JSON object.
  """
  allow = tuple(a.strip() for a in allow_change if a.strip())
  path = pathlib.Path(workdir) / CONFIG_FILE
  saved = read_json(path, expect=dict) if path.exists() else None
  known = _fields(config) | _fields(saved or {})
  unknown = [a for a in allow if a not in known]
  if unknown:
    raise ValueError(f"allow_config_change={','.join(allow)}: {unknown} name no config field")
  if saved is None:
    return []
  changes = config_changes(saved, config)
  refused = [c for c in changes if not _allowed(c[0], allow)]
  if refused:
    detail = "; ".join(f"{k}: was {have!r}, now {want!r}" for k, have, want in refused[:8])
    more = f" (+{len(refused) - 8} more)" if len(refused) > 8 else ""
    names = ",".join(k for k, _, _ in refused)
    raise ConfigChangedError(
        f"workdir {str(pathlib.Path(workdir))!r} holds a run with another config: {detail}{more}. "
        f"Use a new --workdir, or relaunch with --allow_config_change={names} if continuing "
        "this run under the new values is intended")
  allowed = [c for c in changes if _allowed(c[0], allow)]
  for k, have, want in allowed:
    log.warning("workdir %s: config field %s changes from %r to %r (--allow_config_change)",
                workdir, k, have, want)
  return allowed


def record_config(workdir: str | os.PathLike, config: Mapping[str, Any]) -> pathlib.Path | None:
  """Writes ``config`` to ``<workdir>/config.json`` atomically.

  An identical saved config is left untouched; a different one (changes
  ``check_config`` allowed, or the same config in an older layout) is kept as
  ``config.before-<UTC time>.json``.

  Returns:
    The path the previous config was kept at, or None.
  """
  path = pathlib.Path(workdir) / CONFIG_FILE
  kept = None
  if path.exists():
    saved = read_json(path, expect=dict)
    if not config_changes(saved, config) and migrate(saved) == saved:
      return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    kept = path.with_name(f"config.before-{stamp}.json")
    atomic_write_json(kept, saved, sort_keys=True)
  atomic_write_json(path, dict(config), sort_keys=True)
  return kept
