"""A run recorded with the flat OPD config layout (before #24) is the same run
under today's nested layout: its finished stages are read, not rerun; the
launcher and a resumed checkpoint accept it; a real change is still named
(opd.config.migrations, experiments.common.Stages, opd.training.workdir,
opd.training.resume)."""
import json

import jax.numpy as jnp
import ml_collections
import pytest

from experiments import common
from opd.config.fields import to_group
from opd.config.overrides import config_to_dict
from opd.distill.source import OPDConfig
from opd.training import workdir as workdir_lib
from opd.training.checkpoints import CheckpointManager
from opd.training.resume import resume

# The ``opd`` group of a stage recorded before #24, as its config.json holds
# it: every one of the flat OPDConfig's 34 fields, values as a tiny run set them.
OLD_OPD = {
    "prompts_per_step": 5, "group_size": 2, "temperature": 1.0, "kl_temperature": 1.0,
    "teacher_temperature": 1.0, "max_new_tokens": 12, "seq_len": 160, "length_bucket": 0,
    "schedule": "routing", "confidence_by": "logprob", "confidence_temperature": 1.0,
    "confidence_per_token": False, "anneal_steps": 0, "anneal_to": "uniform",
    "estimator": "full", "top_k": 8, "aggregation": "token_mean", "forward_kl_coef": 0.0,
    "grpo_coef": 0.0, "grpo_clip_eps_low": 0.2, "grpo_clip_eps_high": 0.2,
    "updates_per_batch": 1, "deadline_s": 60.0, "fault_window": 20, "cache_dtype": "bfloat16",
    "diag_every": 2, "diag_tokens": 64, "verify": True, "domain_balance": False,
    "loss_form": "exact", "adv_gamma": 0.0, "adv_beta": 1.0, "adv_alpha": 0.0, "is_cap": 0.0}


def _stage_cfg(**loss):
  """Today's stage config of that run: the same values in the nested groups."""
  return ml_collections.ConfigDict({
      "job": "opd", "seed": 0, "optim": {"lr": 3e-4}, "train": {"steps": 2},
      "opd": to_group(OPDConfig, rollout=dict(prompts_per_step=5, group_size=2,
                                             max_new_tokens=12, seq_len=160, length_bucket=0),
                      loss=loss, diag_every=2, diag_tokens=64, verify=True)})


def _old(cfg) -> dict:
  return {**config_to_dict(cfg), "opd": dict(OLD_OPD)}


def _record(stage_dir, saved, metrics):
  stage_dir.mkdir(parents=True)
  (stage_dir / "config.json").write_text(json.dumps(saved))
  (stage_dir / common.FINAL).write_text(json.dumps(metrics))


def test_a_finished_old_layout_stage_is_read_not_rerun(tmp_path):
  calls = []
  fn = lambda cfg, w: calls.append(w) or {"x": 0.0}  # noqa: E731
  old_root, new_root = tmp_path / "old", tmp_path / "new"
  _record(old_root / "student" / "opd", _old(_stage_cfg()), {"x": 1.0})
  cfg = _stage_cfg()
  # Relaunching in the same workdir, and reusing it from another one.
  assert common.Stages.of(old_root).run("opd", fn, cfg, "student/opd")[0] == {"x": 1.0}
  got, d = common.Stages.of(new_root, [old_root]).run("opd", fn, cfg, "student/opd")
  assert (got, d, calls) == ({"x": 1.0}, old_root / "student" / "opd", [])
  assert not new_root.exists()
  # A real change is still a change, named by its new path.
  changed = _stage_cfg(estimator="token")
  assert common.Stages.of(new_root, [old_root]).find(changed, "student/opd") is None
  with pytest.raises(ValueError, match=r"opd.loss.estimator: was 'full', now 'token'"):
    common.run_stage("opd", fn, changed, old_root / "student" / "opd")
  assert calls == []


def test_the_launcher_and_a_resume_accept_an_old_layout_record(tmp_path):
  new = config_to_dict(_stage_cfg())
  (tmp_path / "config.json").write_text(json.dumps(_old(_stage_cfg())))
  assert workdir_lib.check_config(tmp_path, new) == []
  with pytest.raises(workdir_lib.ConfigChangedError, match=r"opd.loss.top_k: was 8, now 4"):
    workdir_lib.check_config(tmp_path, config_to_dict(_stage_cfg(top_k=4)))
  # Recording today's config keeps the old file beside it and writes the new layout.
  kept = workdir_lib.record_config(tmp_path, new)
  assert json.loads(kept.read_text()) == _old(_stage_cfg())
  assert json.loads((tmp_path / "config.json").read_text()) == new
  assert workdir_lib.record_config(tmp_path, new) is None
  # A checkpoint saved by an old-layout run resumes under today's config.
  mngr = CheckpointManager(tmp_path / "checkpoints")
  state = {"w": jnp.arange(3.0)}
  mngr.save(1, state, config={"experiment": _old(_stage_cfg())})
  restored, record = resume({"w": jnp.zeros(3)}, mngr, config={"experiment": new})
  assert record.step == 1 and restored["w"].tolist() == [0.0, 1.0, 2.0]
  with pytest.raises(ValueError, match=r"experiment.opd.loss.top_k: checkpoint has 8, now 4"):
    resume({"w": jnp.zeros(3)}, mngr,
           config={"experiment": config_to_dict(_stage_cfg(top_k=4))})
