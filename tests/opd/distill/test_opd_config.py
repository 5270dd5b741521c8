"""OPDConfig (opd/distill/source.py): nested rollout / weighting / loss configs built
from config groups, validated by their own classes under their full paths."""
import ml_collections
import pytest

from opd.config import fields, overrides
from opd.distill.loss import OPDLossConfig
from opd.distill.source import OPDConfig
from opd.distill.teacher_weighting import TeacherWeightingConfig
from opd.rollout.batches import RolloutConfig

CFG = OPDConfig(RolloutConfig(prompts_per_step=3, group_size=2, temperature=0.7, top_k=5,
                              top_p=0.9, max_new_tokens=8, seq_len=32, length_bucket=0),
                TeacherWeightingConfig(schedule="confidence", confidence_per_token=True,
                                       anneal_steps=2, anneal_to="confidence"),
                OPDLossConfig(estimator="top_k", top_k=4, temperature=1.5, grpo_coef=0.1),
                updates_per_batch=2, cache_dtype="float32", verify=True)


def test_to_dict_round_trips_through_a_config_group():
  d = CFG.to_dict()
  assert d["loss"]["estimator"] == "top_k" and d["rollout"]["top_p"] == 0.9
  assert fields.from_group(OPDConfig, d, "config.opd") == CFG
  assert fields.from_group(OPDConfig, ml_collections.ConfigDict(d), "config.opd") == CFG
  assert hash(fields.from_group(OPDConfig, d, "config.opd")) == hash(CFG)
  # A config file's group: only what differs, yet every field, nested ones as sub-groups.
  group = fields.to_group(OPDConfig, rollout=dict(prompts_per_step=3), diag_every=0)
  assert group.rollout.prompts_per_step == 3 and group.rollout.group_size == 4  # OPD's G
  assert sorted(group.loss.keys()) == sorted(OPDLossConfig().to_dict())
  assert fields.from_group(OPDConfig, group, "config.opd") == OPDConfig(
      RolloutConfig(prompts_per_step=3, group_size=4), diag_every=0)
  # replace takes a nested config's changes as a mapping.
  assert CFG.replace(loss=dict(top_k=6)).loss == OPDLossConfig(
      estimator="top_k", top_k=6, temperature=1.5, grpo_coef=0.1)


@pytest.mark.parametrize("group, path, match", [
    ({"loss": {"estimator": "foo"}}, "config.opd.loss.estimator",
     r"OPDLossConfig.estimator must be one of \('full', 'top_k', 'token'\), got 'foo'"),
    ({"weighting": {"confidence_temperature": -1.0}},
     "config.opd.weighting.confidence_temperature",
     r"TeacherWeightingConfig.confidence_temperature must be a finite number > 0, got -1.0"),
    ({"rollout": {"group_size": 0}}, "config.opd.rollout.group_size",
     r"RolloutConfig.group_size must be a positive int, got 0"),
    ({"diag_tokens": 0}, "config.opd.diag_tokens",
     r"OPDConfig.diag_tokens must be a positive int, got 0"),
])
def test_a_bad_nested_field_is_named_by_its_full_path(group, path, match):
  where = path.rsplit(".", 1)[0]
  with pytest.raises(ValueError, match=rf"^{where}: {match} \({path}\)$"):
    fields.from_group(OPDConfig, group, "config.opd")
  # The same through a config file's group and a command-line override.
  config = ml_collections.ConfigDict({"opd": fields.to_group(OPDConfig)})
  with pytest.raises(ValueError, match=rf"\({path}\)$"):
    key = path.removeprefix("config.")
    value = next(iter(group.values()))
    value = next(iter(value.values())) if isinstance(value, dict) else value
    fields.from_group(OPDConfig, overrides.apply_overrides(config, {key: value}).opd,
                      "config.opd")


def test_a_nested_field_must_hold_its_config_class():
  with pytest.raises(ValueError, match=r"OPDConfig.loss must be a OPDLossConfig .*got \{"):
    OPDConfig(loss={"estimator": "token"})
  with pytest.raises(ValueError, match=r"^config.opd: OPDConfig.rollout must be a RolloutConfig "
                                       r".*got 3 \(config.opd.rollout\)$"):
    fields.from_group(OPDConfig, {"rollout": 3}, "config.opd")
