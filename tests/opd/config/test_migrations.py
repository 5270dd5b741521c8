"""opd.config.migrations: the flat OPD layout (before #24) against today's nested one.

``OLD_FIELDS`` is the flat ``OPDConfig``'s field list as it was at 64bbde0
(opd/distill/source.py), written out here so that the map is checked against
the old layout itself, not against a copy of the map.
"""
import dataclasses

import ml_collections
import pytest

from opd.config import fields, migrations, overrides
from opd.distill.loss import OPDLossConfig
from opd.distill.source import OPDConfig
from opd.distill.teacher_weighting import TeacherWeightingConfig
from opd.rollout.batches import RolloutConfig

OLD_FIELDS = (
    "prompts_per_step", "group_size", "temperature", "kl_temperature", "teacher_temperature",
    "max_new_tokens", "seq_len", "length_bucket", "schedule", "confidence_by",
    "confidence_temperature", "confidence_per_token", "anneal_steps", "anneal_to", "estimator",
    "top_k", "aggregation", "forward_kl_coef", "grpo_coef", "grpo_clip_eps_low",
    "grpo_clip_eps_high", "updates_per_batch", "deadline_s", "fault_window", "cache_dtype",
    "diag_every", "diag_tokens", "verify", "domain_balance", "loss_form", "adv_gamma", "adv_beta",
    "adv_alpha", "is_cap")
STAYED = ("updates_per_batch", "deadline_s", "fault_window", "cache_dtype", "diag_every",
          "diag_tokens", "verify")


def _leaves(cls, prefix=""):
  """Every field path of dataclass ``cls``, nested dataclasses expanded."""
  out = []
  for f in dataclasses.fields(cls):
    sub = {"rollout": RolloutConfig, "weighting": TeacherWeightingConfig,
           "loss": OPDLossConfig}.get(f.name) if cls is OPDConfig else None
    out += _leaves(sub, f"{f.name}.") if sub else [prefix + f.name]
  return out


def test_the_map_covers_the_old_layout_and_lands_on_todays_fields():
  moved = migrations.MOVED["opd"]
  assert len(OLD_FIELDS) == 34 and len(dataclasses.fields(OPDConfig)) == 10
  assert sorted(moved) == sorted(set(OLD_FIELDS) - set(STAYED))
  new = _leaves(OPDConfig)
  assert set(moved.values()) | set(STAYED) | set(migrations.FILLED["opd"]) == set(new)
  assert len(set(moved.values())) == len(moved)  # no two old fields land on one
  assert not set(migrations.FILLED["opd"]) & set(moved.values())


def test_an_old_flat_group_migrates_to_the_nested_config_of_the_same_values():
  # A flat group as a recorded config.json holds it (values differ from the defaults).
  old = {f: getattr(OPDConfig(), f) for f in STAYED}
  old.update(prompts_per_step=10, group_size=4, temperature=0.7, kl_temperature=1.5,
             teacher_temperature=0.5, max_new_tokens=48, seq_len=128, length_bucket=16,
             schedule="uniform", confidence_by="neg_entropy", confidence_temperature=2.0,
             confidence_per_token=True, anneal_steps=5, anneal_to="confidence",
             estimator="top_k", top_k=10, aggregation="sequence_mean", forward_kl_coef=0.1,
             grpo_coef=0.2, grpo_clip_eps_low=0.1, grpo_clip_eps_high=0.3, verify=True,
             domain_balance=True, loss_form="exact", adv_gamma=0.0, adv_beta=1.0,
             adv_alpha=0.0, is_cap=0.0)
  assert sorted(old) == sorted(OLD_FIELDS)
  want = OPDConfig(
      RolloutConfig(prompts_per_step=10, group_size=4, temperature=0.7, max_new_tokens=48,
                    seq_len=128, length_bucket=16, domain_balance=True),
      TeacherWeightingConfig(schedule="uniform", confidence_by="neg_entropy",
                             confidence_temperature=2.0, confidence_per_token=True,
                             anneal_steps=5, anneal_to="confidence"),
      OPDLossConfig(estimator="top_k", top_k=10, temperature=1.5, teacher_temperature=0.5,
                    aggregation="sequence_mean", forward_kl_coef=0.1, grpo_coef=0.2,
                    grpo_clip_eps_low=0.1, grpo_clip_eps_high=0.3),
      verify=True)
  saved = {"job": "opd", "seed": 3, "opd": old, "world": {"opd": dict(old)}}
  got = migrations.migrate(saved)
  assert got["opd"] == want.to_dict() and got["world"]["opd"] == want.to_dict()
  assert (got["job"], got["seed"]) == ("opd", 3) and saved["opd"] is old  # input untouched
  assert fields.from_group(OPDConfig, got["opd"], "config.opd") == want
  # Today's layout is a fixed point.
  assert migrations.migrate(got) == got


def test_an_old_path_is_refused_naming_its_new_one():
  config = ml_collections.ConfigDict({"opd": fields.to_group(OPDConfig)})
  for old, new in [("opd.estimator", "opd.loss.estimator"),
                   ("opd.kl_temperature", "opd.loss.temperature"),
                   ("opd.loss_form", "opd.loss.form"),
                   ("opd.schedule", "opd.weighting.schedule"),
                   ("opd.seq_len", "opd.rollout.seq_len")]:
    with pytest.raises(ValueError, match=rf"config field '{old}' moved to '{new}'.*"
                                         rf"--config.{new}="):
      overrides.apply_overrides(config, [f"--config.{old}=1"])
  assert migrations.moved_to("world.opd.top_k") == "world.opd.loss.top_k"
  assert migrations.moved_to("opd.verify") is None and migrations.moved_to("grpo.top_k") is None
  # The new paths take the override, typed.
  overrides.apply_overrides(config, ["opd.loss.estimator=top_k", "opd.loss.top_k=10"])
  cfg = fields.from_group(OPDConfig, config.opd, "config.opd")
  assert (cfg.loss.estimator, cfg.loss.top_k) == ("top_k", 10)
  # A flat group handed to the converter names the new path too.
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['estimator'\] \(config.opd.estimator "
                                       r"is now config.opd.loss.estimator\)"):
    fields.from_group(OPDConfig, {"estimator": "top_k"}, "config.opd")
