"""Crash-safe result files: atomic writes and readers whose errors name the file.

Every JSON result outside Orbax (stage records, sweep tables, ``config.json``,
final metrics) goes through ``atomic_write_json``: the text is written to a
temporary file in the same directory, flushed and fsynced, then renamed over
the target, so a reader sees either the old file or the new one, never a torn
one (docs/DESIGN.md, "Failure model").
"""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any


class ResultFileError(ValueError):
  """A result file exists but cannot be read (truncated, not JSON, wrong type)."""


def _fsync_dir(directory: pathlib.Path) -> None:
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:  # some filesystems do not open directories; the rename is still atomic
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
  """Writes ``text`` to ``path`` atomically (temp file + fsync + rename).

  A crash at any moment leaves either the previous content or the new one.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise
  _fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any, **dump_kwargs) -> None:
  """``json.dumps(obj)`` written atomically to ``path`` (indent 2 and sorted keys by default)."""
  dump_kwargs.setdefault("indent", 2)
  text = json.dumps(obj, **dump_kwargs)
  atomic_write_text(path, text + "\n")


def read_json(path: str | os.PathLike, expect: type | None = None) -> Any:
  """Reads a JSON file; a torn or malformed file raises ``ResultFileError`` naming the path.

  Args:
    path: the file.
    expect: if given, the type the top-level value must have (e.g. ``dict``).
  """
  path = pathlib.Path(path)
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise
  except (OSError, UnicodeDecodeError) as e:
    raise ResultFileError(f"cannot read result file {str(path)!r}: {e}") from e
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ResultFileError(
        f"result file {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}, column "
        f"{e.colno}; {len(text)} bytes): it was probably torn by a crash; delete it to redo "
        "the step that wrote it") from e
  if expect is not None and not isinstance(value, expect):
    raise ResultFileError(f"result file {str(path)!r} holds a {type(value).__name__}, "
                          f"expected a {expect.__name__}")
  return value
