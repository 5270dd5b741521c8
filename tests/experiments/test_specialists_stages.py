"""Stage reuse in the pipeline jobs (experiments.common.run_stage): a finished stage is reused only
under the same config; another config is refused with the fields named and
nothing in the directory changes."""
import json

import ml_collections
import pytest

from experiments import common


def _cfg(lr):
  return ml_collections.ConfigDict({"job": "sft", "optim": {"lr": lr, "steps": 3},
                                    "data": {"domains": ("math",)}})


def test_finished_stage_is_reused_only_with_the_same_config(tmp_path):
  calls = []

  def job(cfg, workdir):
    calls.append(workdir)
    return {"final_loss": 0.5 + len(calls)}

  stage = tmp_path / "math" / "sft"
  first = common.run_stage("math: SFT", job, _cfg(1e-3), stage)
  again = common.run_stage("math: SFT", job, _cfg(1e-3), stage)
  assert first == again == {"final_loss": 1.5} and len(calls) == 1
  before = {p.name: p.read_bytes() for p in stage.iterdir()}
  with pytest.raises(ValueError, match=r"'math: SFT' stage of a run with another config "
                                       r"\(optim.lr: was 0.001, now 0.002\)"):
    common.run_stage("math: SFT", job, _cfg(2e-3), stage)
  assert len(calls) == 1
  assert {p.name: p.read_bytes() for p in stage.iterdir()} == before
  assert json.loads((stage / "config.json").read_text())["optim"]["lr"] == 1e-3


def test_interrupted_stage_with_another_config_is_refused(tmp_path):
  stage = tmp_path / "code" / "grpo"
  stage.mkdir(parents=True)
  (stage / "config.json").write_text(json.dumps(common.config_to_dict(_cfg(1e-3))))
  with pytest.raises(ValueError, match=r"optim.lr: was 0.001, now 0.0005"):
    common.run_stage("code: GRPO", lambda c, w: {}, _cfg(5e-4), stage)
  # Same config: the job runs (and would resume from its checkpoints).
  assert common.run_stage("code: GRPO", lambda c, w: {"ok": 1}, _cfg(1e-3), stage) == {"ok": 1}
