"""Helpers for ml-collections experiment configs (big_vision style).

A config file under ``experiments/configs/`` defines ``get_config(arg)`` and
optionally ``get_sweep(arg)``; ``arg`` is the text after the colon in
``--config=experiments/configs/NAME.py:tiny,teachers=3``. This module parses
that text, loads config files and applies ``a.b=value`` overrides with errors
that name the field. Config groups become dataclasses through
``opd.config.fields.from_group`` (``opd.models.to_model_config`` for the model).
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from opd.config import fields, migrations

_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")


def _coerce(text: str, to_type: type | None, what: str) -> Any:
  """Parses ``text`` as ``to_type`` (or infers int/float/bool/str when None)."""
  if to_type is None:
    for parse in (int, float):
      try:
        return parse(text)
      except ValueError:
        pass
    if text.lower() in ("true", "false"):
      return text.lower() == "true"
    return text
  if to_type is bool:
    if text.lower() in _TRUE:
      return True
    if text.lower() in _FALSE:
      return False
    raise ValueError(f"{what} expects a bool (true/false), got {text!r}")
  if to_type in (int, float):
    try:
      return to_type(text)
    except ValueError:
      raise ValueError(f"{what} expects {to_type.__name__}, got {text!r}") from None
  if to_type in (tuple, list):
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      raise ValueError(f"{what} expects a {to_type.__name__} literal like (1, 2), "
                       f"got {text!r}") from None
    if not isinstance(value, (tuple, list)):
      raise ValueError(f"{what} expects a {to_type.__name__}, got {text!r}")
    return to_type(value)
  if to_type is str:
    return text
  raise ValueError(f"{what} has type {to_type.__name__}, which cannot be set from text {text!r}")


def parse_arg(arg: str | None, **defaults: Any) -> dict[str, Any]:
  """Parses a config argument such as ``"tiny,teachers=3,lr=1e-3"``.

  A bare word means ``True``; ``key=value`` values are coerced. Values cannot
  contain commas.

  Args:
    arg: the text after the colon of ``--config=FILE.py:ARG`` (None or "" for
      none).
    **defaults: when given, the allowed keys and their defaults; values are
      coerced to the default's type and unknown keys raise. Without defaults,
      types are inferred (int, then float, then true/false, else str).

  Returns:
    A dict of the defaults updated with the parsed values.
  """
  out = dict(defaults)
  seen = set()
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, sep, text = item.partition("=")
    key = key.strip()
    if not key.isidentifier():
      raise ValueError(f"config arg {arg!r}: {key!r} is not a valid name")
    if key in seen:
      raise ValueError(f"config arg {arg!r}: {key!r} is given twice")
    seen.add(key)
    if defaults and key not in defaults:
      raise ValueError(f"config arg {arg!r}: unknown key {key!r}; known: {sorted(defaults)}")
    default = defaults.get(key)
    if not sep:
      if defaults and not isinstance(default, bool):
        raise ValueError(
            f"config arg {arg!r}: {key!r} needs a value ({key}=...), default {default!r}")
      out[key] = True
      continue
    to_type = type(default) if default is not None else None
    out[key] = _coerce(text.strip(), to_type, f"config arg {key!r}")
  return out


def _field_type(node: ml_collections.ConfigDict, key: str) -> type | None:
  # Placeholders (``config_dict.placeholder(int)``) hold None but know their type.
  field_type = node.get_type(key)
  return None if field_type is type(None) else field_type


def _resolve(config: ml_collections.ConfigDict, path: str):
  """Returns (parent ConfigDict, leaf key) for a dotted ``path``, or raises."""
  parts = path.split(".")
  node = config
  for i, part in enumerate(parts):
    where = ".".join(["config"] + parts[:i])
    if not isinstance(node, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
      raise ValueError(f"unknown config field {path!r}: {where} is a "
                       f"{type(node).__name__}, not a group of fields")
    if part not in node:
      moved = migrations.moved_to(".".join(parts[:i + 1]))
      if moved is not None and i == len(parts) - 1:
        raise ValueError(f"config field {path!r} moved to {moved!r} (the layout of issue #24, "
                         f"opd.config.migrations): use --config.{moved}=...")
      close = difflib.get_close_matches(part, list(node.keys()), n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ValueError(f"unknown config field {path!r}: {where} has no field {part!r}{hint}; "
                       f"its fields are {sorted(node.keys())}")
    if i == len(parts) - 1:
      return node, part
    node = node[part]


def _split_override(item: str) -> tuple[str, str]:
  key, sep, value = item.partition("=")
  key = key.strip()
  if key.startswith("--"):
    key = key[2:]
  if key.startswith("config."):
    key = key[len("config."):]
  if not sep or not key:
    raise ValueError(f"override {item!r} must look like 'a.b=value'")
  return key, value


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Sequence[str] | Mapping[str, Any]) -> ml_collections.ConfigDict:
  """Sets dotted fields of ``config`` in place and returns it.

  Args:
    config: the config to change.
    overrides: ``["optim.lr=1e-3", ...]`` (text, parsed to the field's type;
      a leading ``--config.`` is accepted) or ``{"optim.lr": 1e-3, ...}``
      (Python values, type-checked against the field).

  Returns:
    ``config``.

  Raises:
    ValueError: naming the field for an unknown key, and naming the field, the
      expected type and the value for a value of the wrong type.
  """
  if isinstance(overrides, Mapping):
    items = [(str(k), v, False) for k, v in overrides.items()]
  elif isinstance(overrides, str):
    raise ValueError(f"overrides must be a list of 'a.b=value' strings, got one string "
                     f"{overrides!r}")
  else:
    items = [(*_split_override(o), True) for o in overrides]
  for path, value, is_text in items:
    parent, key = _resolve(config, path)
    current = parent[key]
    if isinstance(current, (ml_collections.ConfigDict, Mapping)):
      raise ValueError(f"config field {path!r} is a group of fields; override its leaves "
                       f"({sorted(current.keys())}) one by one")
    expected = _field_type(parent, key)
    if is_text:
      text = value.strip()
      if text == "None" and expected is not str:
        value = None  # e.g. optim.clip_norm=None; the field's dataclass says if None is valid
      elif expected is None:
        try:
          value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
          value = text
      else:
        value = _coerce(text, expected, f"config field {path!r}")
    elif (expected in (int, float) and isinstance(value, bool)) or (
        expected is bool and not isinstance(value, (bool, type(None)))):
      # ml_collections would accept True for an int field and 1 for a bool
      # field after casting; in an experiment config either is a typo.
      raise ValueError(f"config field {path!r} expects {expected.__name__}, "
                       f"got {value!r} ({type(value).__name__})")
    try:
      parent[key] = value
    except (TypeError, ValueError, AttributeError) as e:
      name = expected.__name__ if expected is not None else "its declared type"
      raise ValueError(f"config field {path!r} expects {name}, got {value!r} "
                       f"({type(value).__name__}): {e}") from None
  return config


def load_config_module(path: str | pathlib.Path):
  """Imports a config file by path (it need not be on ``sys.path``)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"config file {str(path)!r} does not exist")
  name = f"_opd_config_{abs(hash(str(path.resolve())))}"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # lets dataclasses / pickling inside the file work
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {str(path)!r} defines no get_config(arg)")
  return module


def split_config_spec(spec: str) -> tuple[str, str | None]:
  """``"dir/x.py:tiny,k=3"`` -> ``("dir/x.py", "tiny,k=3")``; no colon -> arg None."""
  path, sep, arg = spec.partition(":")
  return path, (arg if sep else None)


def _call_with_arg(fn, arg: str | None):
  takes_arg = bool(inspect.signature(fn).parameters)
  if takes_arg:
    return fn(arg) if arg is not None else fn()
  if arg:
    raise ValueError(f"{fn.__name__}() takes no argument but the config spec passes {arg!r}")
  return fn()


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Loads ``"path/to/config.py[:arg]"`` by calling its ``get_config(arg)``."""
  path, arg = split_config_spec(spec)
  config = _call_with_arg(load_config_module(path).get_config, arg)
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f"{path}: get_config returned {type(config).__name__}, not a ConfigDict")
  return config


def load_sweep(spec: str) -> list[dict[str, Any]]:
  """Returns ``get_sweep(arg)`` of a config file: a list of override dicts."""
  path, arg = split_config_spec(spec)
  module = load_config_module(path)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"config file {path!r} defines no get_sweep()")
  sweep = _call_with_arg(module.get_sweep, arg)
  if not isinstance(sweep, (list, tuple)) or not all(isinstance(s, Mapping) for s in sweep):
    raise ValueError(f"{path}: get_sweep must return a list of dicts, got {sweep!r}")
  return [dict(s) for s in sweep]


def config_to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """A JSON-ready nested dict (tuples become lists, other objects ``repr``)."""
  return json.loads(json.dumps(config.to_dict(), default=repr))


def config_mismatches(saved, expected, prefix: str = "") -> list[tuple[str, Any, Any]]:
  """``(dotted path, saved value, expected value)`` wherever ``expected`` (a
  nested mapping) differs from ``saved``; a list equals the tuple it was saved
  from (JSON has no tuples)."""
  out = []
  for key, want in expected.items():
    name = f"{prefix}{key}"
    if not isinstance(saved, Mapping) or key not in saved:
      out.append((name, "<missing>", want))
      continue
    have = saved[key]
    if isinstance(want, Mapping) and isinstance(have, Mapping):
      out.extend(config_mismatches(have, want, name + "."))
    elif have != want and not (isinstance(have, list) and isinstance(want, tuple)
                               and have == list(want)):
      out.append((name, have, want))
  return out
