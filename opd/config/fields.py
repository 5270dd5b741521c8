"""Shared field validators and the one dict -> dataclass converter.

Every config dataclass validates its fields in ``__post_init__`` with these
helpers, so that all of them agree on what a valid value is and say so in the
same words: ``f"{owner}.{name} must be ..., got {value!r}"``.

Defaults live in the dataclasses only: a config file builds a group with
``to_group(Cls, field=value, ...)`` (every field present, so any of them can
be overridden on the command line with its type checked) and a job turns it
back with ``from_group``.

Numbers: numpy scalars are accepted wherever Python numbers are (a value
read from an ``np.int64`` array or a sweep written with numpy is as good as a
literal) and are stored as the Python type, so configs stay JSON-ready and
hash equal. ``bool`` is never accepted as a number.

Nested configs: a field whose type is a dataclass (``OPDConfig.loss``) is a
sub-group of its own (``config.opd.loss.*``); ``from_group`` builds it from
that sub-group and names its full path in errors, ``to_group`` writes it as
one.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from typing import Any, Mapping, Sequence, TypeVar

import ml_collections
import numpy as np

from opd.config import migrations

__all__ = ["check_int", "check_float", "check_bool", "check_choice", "check_fields", "set_field",
           "from_group", "to_group"]

T = TypeVar("T")


def _bounds(min_value, max_value, min_exclusive: bool, max_exclusive: bool = False) -> str:
  # A bound reads the same whether the caller wrote 0 or 0.0.
  show = lambda v: int(v) if isinstance(v, float) and v.is_integer() else v
  parts = []
  if min_value is not None:
    parts.append(f"{'>' if min_exclusive else '>='} {show(min_value)}")
  if max_value is not None:
    parts.append(f"{'<' if max_exclusive else '<='} {show(max_value)}")
  return " and ".join(parts)


def check_int(owner: str, name: str, value: Any, *, min_value: int | None = None,
              max_value: int | None = None, allow_none: bool = False) -> int | None:
  """``value`` as a Python ``int`` (numpy integers accepted, bools not) within the bounds.

  Raises:
    ValueError: ``"{owner}.{name} must be an int >= 2 and <= 8, got value"`` (a
      lower bound of 1 or 0 alone reads "a positive int" / "a non-negative int").
  """
  if value is None and allow_none:
    return None
  ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
  if ok:
    value = int(value)
    ok = (min_value is None or value >= min_value) and (max_value is None or value <= max_value)
  if not ok:
    if max_value is None and min_value in (0, 1):
      kind = "a positive int" if min_value == 1 else "a non-negative int"
    else:
      kind = " ".join(x for x in ("an int", _bounds(min_value, max_value, False)) if x)
    what = kind + (" or None" if allow_none else "")
    raise ValueError(f"{owner}.{name} must be {what}, got {value!r}")
  return value


def check_float(owner: str, name: str, value: Any, *, min_value: float | None = None,
                max_value: float | None = None, min_exclusive: bool = False,
                max_exclusive: bool = False, allow_none: bool = False) -> float | None:
  """``value`` as a finite Python ``float`` (ints and numpy numbers accepted, bools not).

  Raises:
    ValueError: ``"{owner}.{name} must be a finite number > min_value, got value"``.
  """
  if value is None and allow_none:
    return None
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if ok:
    value = float(value)
    ok = math.isfinite(value)
    if ok and min_value is not None:
      ok = value > min_value if min_exclusive else value >= min_value
    if ok and max_value is not None:
      ok = value < max_value if max_exclusive else value <= max_value
  if not ok:
    what = " ".join(x for x in ("a finite number",
                                _bounds(min_value, max_value, min_exclusive, max_exclusive),
                                "or None" if allow_none else "") if x)
    raise ValueError(f"{owner}.{name} must be {what}, got {value!r}")
  return value


def check_bool(owner: str, name: str, value: Any) -> bool:
  """``value`` as a Python ``bool`` (``np.bool_`` accepted; 0/1 are not bools)."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise ValueError(f"{owner}.{name} must be True or False, got {value!r}")


def check_choice(owner: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
  """``value`` if it is one of ``choices``."""
  if value not in tuple(choices):
    raise ValueError(f"{owner}.{name} must be one of {tuple(choices)}, got {value!r}")
  return value


def set_field(obj: Any, name: str, value: Any) -> None:
  """Stores a normalised value on a (possibly frozen) dataclass in ``__post_init__``."""
  object.__setattr__(obj, name, value)


def check_fields(obj: Any, owner: str, *, ints: Mapping[str, int] | None = None,
                 positive: Sequence[str] = (), non_negative: Sequence[str] = (),
                 floats: Mapping[str, Mapping[str, Any]] | None = None,
                 bools: Sequence[str] = (), choices: Mapping[str, Sequence[Any]] | None = None
                 ) -> None:
  """Validates fields of a config dataclass and stores their normalised values.

  The ``__post_init__`` block every config repeats, written once::

    check_fields(self, "TeacherWeightingConfig", ints={"anneal_steps": 0},
                 positive=("confidence_temperature",), bools=("confidence_per_token",),
                 choices={"schedule": SCHEDULES})

  Args:
    obj: the (possibly frozen) dataclass being initialised.
    owner: its name in error messages (``f"{owner}.{field} must be ..."``).
    ints: field -> smallest allowed value (``check_int``).
    positive: fields that are finite numbers > 0.
    non_negative: fields that are finite numbers >= 0.
    floats: field -> ``check_float`` bounds (``min_value``, ``max_value``,
      ``min_exclusive``, ``max_exclusive``, ``allow_none``).
    bools: fields that are True or False.
    choices: field -> the allowed values.

  Raises:
    ValueError: from the first invalid field, in the order of the arguments.
  """
  for name, lo in (ints or {}).items():
    set_field(obj, name, check_int(owner, name, getattr(obj, name), min_value=lo))
  bounds = {**{n: dict(min_value=0, min_exclusive=True) for n in positive},
            **{n: dict(min_value=0) for n in non_negative}, **(floats or {})}
  for name, b in bounds.items():
    set_field(obj, name, check_float(owner, name, getattr(obj, name), **b))
  for name in bools:
    set_field(obj, name, check_bool(owner, name, getattr(obj, name)))
  for name, allowed in (choices or {}).items():
    check_choice(owner, name, getattr(obj, name), allowed)


def _nested(cls: type) -> dict[str, type]:
  """The fields of dataclass ``cls`` whose declared type is a dataclass."""
  try:
    hints = typing.get_type_hints(cls)
  except NameError:  # an annotation only a type checker resolves: no nested groups
    return {}
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)
          if f.init and isinstance(hints.get(f.name), type)
          and dataclasses.is_dataclass(hints[f.name])}


def _field_of(message: str, cls: type) -> str | None:
  """The field of ``cls`` a validation message names (``"Cls.field ..."``)."""
  prefix = f"{cls.__name__}."
  if not message.startswith(prefix):
    return None
  name = message[len(prefix):].split(" ", 1)[0].split("=", 1)[0]
  return name if name in {f.name for f in dataclasses.fields(cls)} else None


def from_group(cls: type[T], group: Mapping[str, Any] | ml_collections.ConfigDict | None,
               where: str, **overrides: Any) -> T:
  """``cls(**group, **overrides)`` for a config group: the one dict -> dataclass converter.

  Fields missing from ``group`` take the dataclass's defaults (the defaults
  live in the dataclass only, never a second copy in a config file). A field
  typed as a dataclass given as a group (a ``ConfigDict`` or mapping) is
  built from it the same way, as ``f"{where}.{field}"``.

  Args:
    cls: a dataclass.
    group: e.g. ``config.optim`` (a ``ConfigDict``) or a plain mapping; None
      means all defaults.
    where: the group's path for error messages, e.g. ``"config.optim"``.
    **overrides: fields set on top of ``group``.

  Raises:
    ValueError: naming ``where`` and the unknown fields (and the new path of
      a field that moved, ``opd.config.migrations``), or the invalid field,
      its full path and its value (from the dataclass's own validation):
      ``"config.opd.loss: OPDLossConfig.estimator must be one of (...), got
      'foo' (config.opd.loss.estimator)"``.
  """
  if not dataclasses.is_dataclass(cls):
    raise ValueError(f"from_group needs a dataclass, got {cls!r}")
  if group is None:
    d = {}
  elif isinstance(group, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    d = group.to_dict()
  elif isinstance(group, Mapping):
    d = dict(group)
  else:
    raise ValueError(f"{where} must be a group of fields, got {type(group).__name__}")
  d.update(overrides)
  known = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(d) - known)
  if unknown:
    moved = [f"{where}.{u} is now {migrations.moved_to(f'{where}.{u}')}" for u in unknown
             if migrations.moved_to(f"{where}.{u}")]
    hint = f" ({'; '.join(moved)})" if moved else ""
    raise ValueError(f"{where} has unknown field(s) {unknown}{hint}; known: {sorted(known)}")
  for name, sub in _nested(cls).items():
    value = d.get(name)
    if isinstance(value, (Mapping, ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
      d[name] = from_group(sub, value, f"{where}.{name}")
  try:
    return cls(**d)
  except (TypeError, ValueError) as e:
    field = _field_of(str(e), cls)
    suffix = f" ({where}.{field})" if field else ""
    raise ValueError(f"{where}: {e}{suffix}") from None


def _optional_type(hint: Any) -> type | None:
  """``X`` for a hint ``X | None`` (or ``Optional[X]``) with X a scalar type, else None."""
  if typing.get_origin(hint) not in (typing.Union, types.UnionType):
    return None
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  if len(args) == 1 and args[0] in (int, float, str, bool):
    return args[0]
  return None


def to_group(cls: type, *, omit: Sequence[str] = (), **values: Any) -> ml_collections.ConfigDict:
  """The config group of dataclass ``cls``: every field, its default unless given.

  The inverse of ``from_group``: a config file writes only the values that
  differ from the dataclass's defaults, yet the group holds every field, so
  ``--config.group.field=value`` works for any of them and is type-checked
  against the default's type. A field that defaults to None and is annotated
  ``X | None`` becomes ``ml_collections.config_dict.placeholder(X)``, so its
  overrides are typed too.

  A field typed as a dataclass becomes a sub-group written the same way;
  its value may be given as an instance or as a mapping of the fields that
  differ from that field's default.

  Args:
    cls: a dataclass whose fields all have defaults.
    omit: fields the job fills in itself (left out of the group).
    **values: fields that differ from the defaults.

  Returns:
    A ``ConfigDict`` with one entry per field of ``cls`` not in ``omit``.

  Raises:
    ValueError: naming an unknown or omitted field in ``values``, or the
      invalid field and its value (``cls`` validates the merged values).
  """
  if not dataclasses.is_dataclass(cls):
    raise ValueError(f"to_group needs a dataclass, got {cls!r}")
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted((set(values) - set(names)) | (set(values) & set(omit))
                   | (set(omit) - set(names)))
  if unknown:
    raise ValueError(f"to_group({cls.__name__}): unknown or omitted field(s) {unknown}; "
                     f"fields: {names}")
  nested = _nested(cls)
  built = dict(values)
  for f in dataclasses.fields(cls):
    if f.name in nested and isinstance(values.get(f.name), Mapping):
      default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                 else f.default)
      built[f.name] = dataclasses.replace(default, **values[f.name])
  instance = cls(**built)
  merged = dataclasses.asdict(instance)
  hints = typing.get_type_hints(cls)
  group = ml_collections.ConfigDict()
  for name in names:
    if name in omit:
      continue
    if name in nested:
      sub = getattr(instance, name)
      group[name] = to_group(type(sub), **{f.name: getattr(sub, f.name)
                                          for f in dataclasses.fields(sub) if f.init})
      continue
    value, optional = merged[name], _optional_type(hints.get(name))
    if value is None and optional is not None:
      value = ml_collections.config_dict.placeholder(optional)
    group[name] = value
  return group
