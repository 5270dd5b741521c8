"""experiments/configs/grm.py:strong and the fields it sets (docs/DESIGN.md §6): each
new field reaches the stage that reads it, with the defaults keeping the old behaviour."""
import json
import types

import numpy as np

from experiments import grm as grm_job
from experiments.configs import grm as grm_config
from experiments.configs import specialists as specialists_config
from grm.data import Candidate, PreferenceGroup
from grm.parse import parse_judgement
from opd import tasks


def test_strong_variant_is_the_strong_worlds_model_from_its_shared_sft():
  c = grm_config.get_config("strong")
  assert c.model.to_dict() == specialists_config.get_config("strong").model.to_dict()
  assert c.models.base == "workdirs/strong/shared_sft/checkpoints"
  assert sorted(c.models) == sorted(["base"] + [f"{k}_{d}" for k in ("sft", "rl")
                                                for d in tasks.ALL_DOMAINS])
  assert not grm_job.has_own_base(c)  # it starts from models.base
  assert (c.sft.principles, c.sft.copies, c.data.keep_rating1_n1) == (1, 4, 0.25)
  default = grm_config.get_config()
  assert (default.sft.principles, default.sft.critique, default.sft.copies,
          default.data.keep_rating1_n1) == (2, True, 2, 1.0)


def _fake_candidates(examples, rng):
  """Per example 4 verified candidates: rewards 0 (p = 0.7) or 1, so the n = 1 groups
  mostly rate 1 (as the source models' wrong answers make them)."""
  return [[Candidate(f"{ex.id}:{i}", tasks.Reward(float(r), 1.0, {}, "ok" if r else "wrong"))
           for i, r in enumerate(rng.random(4) < 0.3)] for ex in examples]


def _data_stage(c, tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  monkeypatch.setattr(grm_job, "source_models", lambda ctx: {})
  monkeypatch.setattr(grm_job, "sample_candidates",
                      lambda models, tok, examples, **kw: _fake_candidates(examples, rng))
  out = tmp_path / f"data{c.data.keep_rating1_n1}"
  out.mkdir()
  metrics = grm_job._stage_data(types.SimpleNamespace(config=c, tok=None, mesh=None,
                                                      rules=None), out)
  return metrics, json.loads((out / "groups.json").read_text())


def test_keep_rating1_n1_reaches_the_data_stage_and_only_thins_train(tmp_path, monkeypatch):
  c = grm_config.get_config("tiny")
  c.data.update(num_train=40, num_test=20, include_reference=False)
  _, full = _data_stage(c, tmp_path, monkeypatch)
  c.data.keep_rating1_n1 = 0.25
  metrics, thin = _data_stage(c, tmp_path, monkeypatch)

  def one(g):
    return len(g["responses"]) == 1 and g["ratings"][0] == 1

  def ones(gs):
    return [g for g in gs if one(g)]

  m = len(ones(full["train"]))
  assert m >= 4  # the draw has enough of them to thin
  assert len(ones(thin["train"])) == int(np.rint(0.25 * m))
  assert metrics["train_rating1_n1_dropped"] == m - int(np.rint(0.25 * m))
  assert thin["test"] == full["test"]
  assert [g for g in full["train"] if not one(g)] == [g for g in thin["train"] if not one(g)]
  kept = ones(thin["train"])
  assert kept == [g for g in ones(full["train"]) if g in kept]  # a subset, in order


def test_copies_principles_and_critique_reach_the_cold_start(tmp_path, monkeypatch):
  c = grm_config.get_config("tiny")
  c.data.update(num_train=12, num_test=4, include_reference=False)
  _, groups = _data_stage(c, tmp_path, monkeypatch)
  train = groups["train"]
  seen = {}
  as_groups = [PreferenceGroup(**{**g, "responses": tuple(g["responses"]),
                                  "ratings": tuple(g["ratings"]), "reasons": tuple(g["reasons"])})
               for g in train]
  monkeypatch.setattr(grm_job, "load_groups", lambda ctx: {"train": as_groups})
  monkeypatch.setattr(grm_job, "_sft", lambda ctx, params, pairs, workdir, steps: (
      seen.setdefault("pairs", pairs), {})[1])
  monkeypatch.setattr(grm_job, "base_params", lambda ctx: None)
  ctx = types.SimpleNamespace(config=c, tok=types.SimpleNamespace(encode=lambda t: t))
  for copies, k, critique in ((1, 2, True), (3, 0, False), (2, 3, True)):
    c.sft.update(copies=copies, principles=k, critique=critique)
    seen.clear()
    grm_job._stage_cold_start(ctx, tmp_path)
    pairs = seen["pairs"]
    assert len(pairs) == copies * len(train)
    for (prompt, text), g in zip(pairs, train * copies):
      j = parse_judgement(text, len(g["responses"]))
      assert j.valid and len(j.principles) == k
      assert bool(j.critique) == critique


def test_saved_run_context_overrides_constrained_only_when_asked(tmp_path):
  """experiments.grm_yardstick --constrained: the run's benchmark.constrained replaced,
  or kept when the flag is not given."""
  c = grm_config.get_config("tiny")
  (tmp_path / "config.json").write_text(json.dumps(c.to_dict()))
  assert grm_job.saved_run_context(tmp_path, (1,)).config.benchmark.constrained is False
  for want in (True, False):
    ctx = grm_job.saved_run_context(tmp_path, (1, 4), constrained=want)
    assert ctx.config.benchmark.constrained is want and tuple(ctx.config.benchmark.ks) == (1, 4)


def test_grm_reward_strong_variant_uses_the_strong_worlds_model_and_grm_strong_stages():
  """grm_reward.py:strong: the strong world's model (BPE), its writing SFT as the
  policy, grm_strong's rule-RL GRM and BT RM as the rewards; it passes the job checks."""
  from experiments import jobs  # noqa: PLC0415
  from experiments.configs import grm_reward as grm_reward_config  # noqa: PLC0415
  c = grm_reward_config.get_config("strong")
  assert c.model.to_dict() == specialists_config.get_config("strong").model.to_dict()
  assert (c.init, c.grm_init, c.bt_init) == (
      "workdirs/strong/writing/sft/checkpoints", "workdirs/grm_strong/rule_rl/checkpoints",
      "workdirs/grm_strong/bt_rm/checkpoints")
  strong_grm = grm_config.get_config("strong")
  assert c.grm.max_new_tokens == strong_grm.benchmark.max_new_tokens
  assert c.bt.seq_len == strong_grm.rm.bt_seq_len
  assert c.grpo.max_new_tokens == specialists_config.get_config("strong").grpo.max_new_tokens
  jobs.validate(c)
