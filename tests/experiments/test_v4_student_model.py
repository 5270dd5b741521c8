"""``experiments.v4.student_model``: the width lever's architecture and its errors."""
import pytest

from experiments import v4
from experiments.configs import v4 as v4_config
from opd.config import overrides as config_utils


def _cfg(width):
  c = v4_config.get_config("tiny")
  c.student_width = width
  return c


def test_default_student_is_the_specialists_model():
  c = _cfg(0)
  assert v4.student_model(c).to_dict() == c.specialists.model.to_dict()
  assert not v4.student_has_own_base(c)
  same = _cfg(c.specialists.model.d_model)  # its own width is the same model
  assert not v4.student_has_own_base(same)


def test_a_wider_student_scales_d_model_and_d_ff_only():
  c = _cfg(0)
  spec = c.specialists.model.to_dict()
  wide = v4.student_model(_cfg(2 * spec["d_model"])).to_dict()
  assert wide["d_model"] == 2 * spec["d_model"] and wide["d_ff"] == 2 * spec["d_ff"]
  assert {k: v for k, v in wide.items() if k not in ("d_model", "d_ff")} == {
      k: v for k, v in spec.items() if k not in ("d_model", "d_ff")}
  assert v4.student_has_own_base(_cfg(2 * spec["d_model"]))
  assert v4.student_stage_config(_cfg(2 * spec["d_model"]), "opd", {
      d: "x" for d in c.specialists.domains}, "init", 0).student.model.d_model == 2 * spec["d_model"]


@pytest.mark.parametrize("width,match", [(-8, r"config.student_width=-8: expected an int >= 0"),
                                         (50, r"config.student_width=50: must be a multiple of "
                                              r"n_heads=4")])
def test_bad_width_names_the_field(width, match):
  with pytest.raises(ValueError, match=match):
    v4.student_model(_cfg(width))


def _stage_configs(c):
  dirs = {d: f"/runs/{d}" for d in c.specialists.domains}
  return {s: v4.student_stage_config(c, s, dirs, "/runs/init", 0).to_dict()
          for s in v4.STUDENT_STAGES}


@pytest.mark.parametrize("field,value,changed", [
    ("opd.loss.aggregation", "sequence_mean", {"opd", "anneal"}),
    ("opd.loss.teacher_temperature", 0.5, {"opd", "anneal"}),
    ("opd_optim.lr", 1e-4, {"opd"}),
    ("anneal.steps", 3, {"anneal"}),
    ("cold_start.steps", 7, {"cold_start"}),
    ("cold_start_optim.lr", 2e-3, {"cold_start"}),
    ("opd.weighting.anneal_to", "confidence", {"anneal"}),  # OPD does not anneal: reused
])
def test_a_lever_changes_only_the_stage_configs_of_the_stages_it_reaches(field, value, changed):
  """What ``--config.reuse_from`` reruns: a stage whose config a lever leaves
  equal is read from the other run (experiments.common.Stages)."""
  c = v4_config.get_config("tiny")
  before = _stage_configs(c)
  config_utils.apply_overrides(c, {field: value})
  after = _stage_configs(c)
  assert {s for s in v4.STUDENT_STAGES if before[s] != after[s]} == changed


def test_the_teacher_shift_misroutes_opd_and_annealing_only():
  """The negative control: domain i's OPD teacher is the specialist of domain
  i + shift (mod K); the cold start keeps the right specialists."""
  c = v4_config.get_config("tiny")
  domains = list(c.specialists.domains)
  right = _stage_configs(c)
  c.teacher_shift = 1
  shifted = _stage_configs(c)
  assert shifted["cold_start"] == right["cold_start"]
  for stage in ("opd", "anneal"):
    for i, d in enumerate(domains):
      t = shifted[stage]["teachers"][d]
      assert t["domain"] == d
      assert t["init"] == f"/runs/{domains[(i + 1) % len(domains)]}/checkpoints" != (
          right[stage]["teachers"][d]["init"])
