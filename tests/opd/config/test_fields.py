"""The shared validators: one rule for numbers (numpy accepted, bools not), named errors."""
import dataclasses

import ml_collections
import numpy as np
import pytest

from opd.config import fields


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_check_int_accepts_python_and_numpy_ints(value):
  out = fields.check_int("Cfg", "n", value, min_value=1)
  assert out == 3 and type(out) is int


@pytest.mark.parametrize("value", [True, 3.0, "3", None, 0, np.int64(0), 11])
def test_check_int_rejects_and_names_field(value):
  with pytest.raises(ValueError, match=r"Cfg\.n must be an int >= 1 and <= 10, got"):
    fields.check_int("Cfg", "n", value, min_value=1, max_value=10)


def test_check_int_none():
  assert fields.check_int("Cfg", "n", None, allow_none=True) is None
  with pytest.raises(ValueError, match="or None"):
    fields.check_int("Cfg", "n", "x", allow_none=True)


@pytest.mark.parametrize("value", [2, 2.5, np.float32(2.5), np.int64(2)])
def test_check_float_accepts_numbers(value):
  out = fields.check_float("Cfg", "lr", value, min_value=0, min_exclusive=True)
  assert out == float(value) and type(out) is float


@pytest.mark.parametrize("value", [False, float("nan"), float("inf"), 0.0, -1, "1e-3"])
def test_check_float_rejects(value):
  with pytest.raises(ValueError, match=r"Cfg\.lr must be a finite number > 0, got"):
    fields.check_float("Cfg", "lr", value, min_value=0, min_exclusive=True)


def test_check_bool_and_choice():
  assert fields.check_bool("Cfg", "b", np.bool_(True)) is True
  with pytest.raises(ValueError, match=r"Cfg\.b must be True or False, got 1"):
    fields.check_bool("Cfg", "b", 1)
  assert fields.check_choice("Cfg", "mode", "a", ("a", "b")) == "a"
  with pytest.raises(ValueError, match=r"Cfg\.mode must be one of \('a', 'b'\), got 'c'"):
    fields.check_choice("Cfg", "mode", "c", ("a", "b"))


@dataclasses.dataclass(frozen=True)
class _Cfg:
  n: int = 2
  lr: float = 0.1

  def __post_init__(self):
    fields.set_field(self, "n", fields.check_int("_Cfg", "n", self.n, min_value=1))
    fields.set_field(self, "lr", fields.check_float("_Cfg", "lr", self.lr, min_value=0))


def test_from_group_defaults_overrides_and_errors():
  assert fields.from_group(_Cfg, None, "config.x") == _Cfg()
  group = ml_collections.ConfigDict({"n": np.int64(4)})
  cfg = fields.from_group(_Cfg, group, "config.x", lr=0.5)
  assert cfg == _Cfg(4, 0.5) and type(cfg.n) is int
  with pytest.raises(ValueError, match=r"config\.x has unknown field\(s\) \['m'\]"):
    fields.from_group(_Cfg, {"m": 1}, "config.x")
  with pytest.raises(ValueError, match=r"config\.x: _Cfg\.n must be a positive int, got 0"):
    fields.from_group(_Cfg, {"n": 0}, "config.x")
  with pytest.raises(ValueError, match="config.x must be a group of fields"):
    fields.from_group(_Cfg, [1], "config.x")


def test_check_wording_for_bounds():
  with pytest.raises(ValueError, match=r"Cfg\.n must be a non-negative int or None, got -1"):
    fields.check_int("Cfg", "n", -1, min_value=0, allow_none=True)
  for low, high in ((0, 1), (0.0, 1.0)):  # the bounds read the same as ints or floats
    with pytest.raises(ValueError, match=r"Cfg\.b must be a finite number >= 0 and < 1, got 1\.0$"):
      fields.check_float("Cfg", "b", 1.0, min_value=low, max_value=high, max_exclusive=True)
  assert fields.check_float("Cfg", "b", np.float64(0.99), min_value=0, max_value=1,
                            max_exclusive=True) == 0.99


@dataclasses.dataclass(frozen=True)
class _Full:
  n: int = 2
  lr: float = 0.1
  size: int | None = None
  name: str = "a"
  dims: tuple[int, ...] = (1, 2)

  def __post_init__(self):
    fields.set_field(self, "n", fields.check_int("_Full", "n", self.n, min_value=1))


def test_to_group_holds_every_field_and_round_trips():
  group = fields.to_group(_Full, lr=0.5)
  assert sorted(group.keys()) == ["dims", "lr", "n", "name", "size"]
  assert fields.from_group(_Full, group, "config.x") == _Full(lr=0.5)
  # None-valued optional fields are typed placeholders, so overrides are checked.
  assert group.size is None and group.get_type("size") is int
  group.size = 4
  with pytest.raises(TypeError):
    group.size = "four"
  assert fields.from_group(_Full, group, "config.x") == _Full(lr=0.5, size=4)
  # Values are validated (and normalised) by the dataclass when the group is built.
  assert type(fields.to_group(_Full, n=np.int64(3)).n) is int
  with pytest.raises(ValueError, match=r"_Full\.n must be a positive int, got 0"):
    fields.to_group(_Full, n=0)


def test_to_group_omit_and_unknown_fields():
  group = fields.to_group(_Full, omit=("dims",), n=5)
  assert "dims" not in group and group.n == 5
  for kwargs in (dict(m=1), dict(omit=("dims",), dims=(3,)), dict(omit=("nope",))):
    with pytest.raises(ValueError, match=r"to_group\(_Full\): unknown or omitted field"):
      fields.to_group(_Full, **kwargs)
  with pytest.raises(ValueError, match="to_group needs a dataclass"):
    fields.to_group(dict)


def test_every_config_dataclass_takes_numpy_ints_and_refuses_bools():
  """One rule for every config dataclass that validates with these helpers."""
  from opd.models import ModelConfig
  from opd.rollout.sampler import SamplingConfig
  from opd.tasks.sandbox.api import SandboxLimits
  from opd.training.optim import OptimConfig
  for cls, name in [(ModelConfig, "n_layers"), (OptimConfig, "grad_accum_steps"),
                    (SamplingConfig, "max_new_tokens"), (SandboxLimits, "max_processes")]:
    cfg = cls(**{name: np.int64(3)})
    assert getattr(cfg, name) == 3 and type(getattr(cfg, name)) is int
    assert cfg == cls(**{name: 3})
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name} must be a positive int, "
                                         r"got True"):
      cls(**{name: True})


def test_check_fields_validates_normalises_and_names_the_field():
  @dataclasses.dataclass(frozen=True)
  class _Block:
    n: int = 2
    lr: float = 0.5
    decay: float = 0.0
    frac: float = 0.5
    on: bool = True
    mode: str = "a"

    def __post_init__(self):
      fields.check_fields(self, "_Block", ints={"n": 2}, positive=("lr",),
                          non_negative=("decay",), floats={"frac": dict(min_value=0, max_value=1)},
                          bools=("on",), choices={"mode": ("a", "b")})

  cfg = _Block(n=np.int32(3), lr=np.float32(0.25), decay=1, frac=np.float64(1.0), on=np.bool_(0))
  assert (cfg.n, cfg.lr, cfg.decay, cfg.frac, cfg.on) == (3, 0.25, 1.0, 1.0, False)
  assert [type(v) for v in (cfg.n, cfg.lr, cfg.decay, cfg.frac, cfg.on)] == [
      int, float, float, float, bool]
  for kwargs, message in [
      (dict(n=1), r"_Block.n must be an int >= 2, got 1"),
      (dict(lr=0.0), r"_Block.lr must be a finite number > 0, got 0.0"),
      (dict(decay=-1.0), r"_Block.decay must be a finite number >= 0, got -1.0"),
      (dict(frac=1.5), r"_Block.frac must be a finite number >= 0 and <= 1, got 1.5"),
      (dict(on=1), r"_Block.on must be True or False, got 1"),
      (dict(mode="c"), r"_Block.mode must be one of \('a', 'b'\), got 'c'")]:
    with pytest.raises(ValueError, match=message):
      _Block(**kwargs)
