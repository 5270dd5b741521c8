"""Tests for opd/config/overrides.py: arg parsing, overrides, config files, ModelConfig."""
import dataclasses
import json

import ml_collections
import numpy as np
import pytest

from opd.config import overrides as config_utils
from opd.models import ModelConfig, to_model_config


def _config():
  c = ml_collections.ConfigDict()
  c.job = "pretrain"
  c.seed = 0
  c.optim = ml_collections.ConfigDict(dict(lr=1e-3, b1=0.9, warmup=10, nesterov=False))
  c.mesh = (1, 1, 1)
  c.init = ml_collections.config_dict.placeholder(str)
  c.note = None
  return c


def test_parse_arg_infers_types_without_defaults():
  got = config_utils.parse_arg("tiny,teachers=3,lr=1e-3,flag=false,name=math")
  assert got == {"tiny": True, "teachers": 3, "lr": 1e-3, "flag": False, "name": "math"}
  assert type(got["teachers"]) is int and type(got["lr"]) is float
  assert config_utils.parse_arg(None) == {} and config_utils.parse_arg("") == {}


def test_parse_arg_coerces_to_default_types():
  got = config_utils.parse_arg("teachers=3,lr=2,tiny", tiny=False, teachers=2, lr=0.1,
                               name="x")
  assert got == {"tiny": True, "teachers": 3, "lr": 2.0, "name": "x"}
  assert type(got["lr"]) is float
  with pytest.raises(ValueError, match="unknown key 'teacher'.*known"):
    config_utils.parse_arg("teacher=3", teachers=2)
  with pytest.raises(ValueError, match="'teachers' expects int, got 'many'"):
    config_utils.parse_arg("teachers=many", teachers=2)
  with pytest.raises(ValueError, match="'teachers' needs a value"):
    config_utils.parse_arg("teachers", teachers=2)
  with pytest.raises(ValueError, match="given twice"):
    config_utils.parse_arg("tiny,tiny")


def test_apply_overrides_from_text_and_dict():
  c = config_utils.apply_overrides(
      _config(), ["optim.lr=3e-4", "--config.optim.warmup=5", "optim.nesterov=true",
                  "mesh=(2, 2, 2)", "init=/ckpt/base", "note=7", "job=sft"])
  assert (c.optim.lr, c.optim.warmup, c.optim.nesterov) == (3e-4, 5, True)
  assert c.mesh == (2, 2, 2) and c.init == "/ckpt/base" and c.note == 7 and c.job == "sft"
  assert type(c.optim.warmup) is int
  c = config_utils.apply_overrides(_config(), {"optim.lr": 1, "optim.b1": 0.8})
  assert c.optim.lr == 1.0 and type(c.optim.lr) is float and c.optim.b1 == 0.8


@pytest.mark.parametrize("override,pattern", [
    ("optim.lrr=1", r"unknown config field 'optim.lrr'.*config.optim has no field 'lrr' "
                    r"\(did you mean 'lr'\?\)"),
    ("model.d=1", r"unknown config field 'model.d': config has no field 'model'"),
    ("seed.x=1", r"config.seed is a int, not a group"),
    ("optim.warmup=ten", r"config field 'optim.warmup' expects int, got 'ten'"),
    ("optim.warmup=1.5", r"config field 'optim.warmup' expects int, got '1.5'"),
    ("optim.nesterov=maybe", r"config field 'optim.nesterov' expects a bool"),
    ("mesh=3", r"config field 'mesh' expects a tuple"),
    ("optim=1", r"config field 'optim' is a group of fields"),
    ("optim.lr", r"must look like 'a.b=value'"),
])
def test_apply_overrides_errors_name_the_field(override, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_utils.apply_overrides(_config(), [override])


@pytest.mark.parametrize("key,value,pattern", [
    ("optim.warmup", 2.5, r"'optim.warmup' expects int, got 2.5 \(float\)"),
    ("optim.warmup", True, r"'optim.warmup' expects int, got True \(bool\)"),
    ("optim.nesterov", 1, r"'optim.nesterov' expects bool, got 1 \(int\)"),
    ("job", 3, r"'job' expects str, got 3 \(int\)"),
])
def test_apply_overrides_dict_type_errors(key, value, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_utils.apply_overrides(_config(), {key: value})


def test_load_config_and_sweep(tmp_path):
  path = tmp_path / "exp.py"
  path.write_text(
      "import ml_collections\n"
      "from opd.config import overrides as config_utils\n"
      "def get_config(arg=None):\n"
      "  a = config_utils.parse_arg(arg, tiny=False, teachers=2)\n"
      "  return ml_collections.ConfigDict(dict(job='x', teachers=a['teachers'], tiny=a['tiny']))\n"
      "def get_sweep(arg=None):\n"
      "  return [{'teachers': k} for k in (1, 2)]\n")
  c = config_utils.load_config(f"{path}:tiny,teachers=3")
  assert (c.teachers, c.tiny) == (3, True)
  assert config_utils.load_config(str(path)).teachers == 2
  assert config_utils.load_sweep(str(path)) == [{"teachers": 1}, {"teachers": 2}]
  with pytest.raises(ValueError, match="does not exist"):
    config_utils.load_config(str(tmp_path / "missing.py"))
  (tmp_path / "nosweep.py").write_text("def get_config():\n  return None\n")
  with pytest.raises(ValueError, match="defines no get_sweep"):
    config_utils.load_sweep(str(tmp_path / "nosweep.py"))
  with pytest.raises(ValueError, match="takes no argument"):
    config_utils.load_config(f"{tmp_path / 'nosweep.py'}:tiny")


def test_to_model_config():
  fields = dict(vocab_size=300, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64,
                qk_norm=True)
  cfg = to_model_config(ml_collections.ConfigDict(fields))
  assert cfg == ModelConfig(**fields)
  # Every dataclass field survives the round trip through a ConfigDict.
  full = ml_collections.ConfigDict(dataclasses.asdict(cfg))
  assert to_model_config(full) == cfg
  with pytest.raises(ValueError, match=r"config.teachers.math.model has unknown field\(s\) "
                                       r"\['d_modle'\]"):
    to_model_config({**fields, "d_modle": 3}, where="config.teachers.math.model")
  with pytest.raises(ValueError, match=r"config.model: ModelConfig.d_model=30 is not divisible"):
    to_model_config({**fields, "d_model": 30})
  # numpy ints (e.g. from a sweep written with numpy) are accepted and stored as int.
  cfg = to_model_config({**fields, "d_model": np.int64(32)})
  assert cfg == ModelConfig(**fields) and type(cfg.d_model) is int
  with pytest.raises(ValueError, match=r"config.model: ModelConfig.n_layers must be a positive "
                                       r"int, got True"):
    to_model_config({**fields, "n_layers": True})


def test_config_to_dict_is_json():
  c = _config()
  d = config_utils.config_to_dict(c)
  assert json.loads(json.dumps(d)) == d
  assert d["mesh"] == [1, 1, 1] and d["optim"]["lr"] == 1e-3 and d["init"] is None
