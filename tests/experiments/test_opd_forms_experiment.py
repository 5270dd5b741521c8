"""The opd_forms job (experiments/opd_forms_experiment.py): its stage configs
against the positive control's, the α choice and the summary against plain
numpy, a cross-tokenizer teacher's missing tokenizer refused, and the tiny
variant end to end through the CLI (test_configs' smoke test of the config)."""
import copy
import json
import pathlib
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from experiments import distill as distill_job
from experiments import opd_forms_experiment as forms
from experiments import positive_control, v4
from experiments.configs import opd_forms as forms_config
from opd.eval.results import DomainResult, EvalConfig, EvalResult
from opd.eval.stats import Estimate
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEACHER, COLD = pathlib.Path("w/strong/code/grpo"), pathlib.Path("w/v4/student/seed0/cold_start")


def _config():
  return forms_config.get_config()


def test_exact_arm_is_the_positive_control_stage_and_the_others_change_only_their_fields():
  config = _config()
  control = positive_control.stage_config(config.world, "code", TEACHER, COLD,
                                          v4.student_stage_config).to_dict()
  assert forms.arm_stage_config(config, "exact", "code", 0, TEACHER, COLD).to_dict() == control
  xmodel = forms.cross_specialists_config(config).model
  for arm, alpha, gamma in (("advantage", 0.0, 0.0), ("advantage_outcome", 0.5, 0.0),
                            ("advantage_g1", 0.0, 1.0), ("cross_tokenizer", 0.0, 0.0),
                            ("cross_tokenizer_g1", 0.0, 1.0)):
    got = forms.arm_stage_config(config, arm, "code", 2, TEACHER, COLD, alpha=0.5,
                                 teacher_model=xmodel).to_dict()
    want = copy.deepcopy(control)
    want["seed"] = 2
    want["opd"]["loss"].update(form="advantage", adv_gamma=gamma, adv_beta=1.0, is_cap=0.0,
                               adv_alpha=alpha)
    if arm.startswith("cross_tokenizer"):
      want["teachers"]["code"]["model"].update(tokenizer="bpe:512", vocab_size=512)
    assert got == want, arm
  for arm in forms.CROSS_ARMS:
    with pytest.raises(ValueError, match=f"arm '{arm}' needs teacher_model"):
      forms.arm_stage_config(config, arm, "code", 0, TEACHER, COLD)
  with pytest.raises(ValueError, match="arm='token'"):
    forms.arm_stage_config(config, "token", "code", 0, TEACHER, COLD)


def test_the_sweep_stage_is_short_with_its_own_schedule():
  config = _config()
  c = forms.arm_stage_config(config, "advantage_outcome", "code", 0, TEACHER, COLD, alpha=1.0,
                             steps=80)
  assert (c.train.steps, c.train.save_every, c.opd.loss.adv_alpha) == (80, 80, 1.0)
  assert c.optim.decay_steps == 80 - c.optim.warmup_steps
  assert config.world.positive_control.steps == 160  # the world's own group is untouched


def test_cross_specialists_config_changes_the_tokenizer_and_keeps_the_shared_sft_domains():
  config = _config()
  x = forms.cross_specialists_config(config)
  spec = config.world.specialists
  assert (x.model.tokenizer, x.model.vocab_size, tuple(x.domains)) == ("bpe:512", 512, ("code",))
  assert tuple(x.shared_sft.domains) == tuple(spec.domains)
  rest = {k: v for k, v in x.model.to_dict().items() if k not in ("tokenizer", "vocab_size")}
  assert rest == {k: v for k, v in spec.model.to_dict().items()
                  if k not in ("tokenizer", "vocab_size")}


def test_choose_alpha_takes_the_highest_mean_of_the_last_rewards():
  rewards = {0.25: [0.9, 0.1, 0.5, 0.6], 1.0: [0.0, 0.2, 0.7, 0.5]}
  # last 2: 0.25 -> 0.55, 1.0 -> 0.6; last 3: 0.4 vs 0.4667; last 4: 0.525 vs 0.35
  assert forms.choose_alpha(rewards, 2) == 1.0
  assert forms.choose_alpha(rewards, 4) == 0.25
  assert forms.choose_alpha({1.0: [0.5], 0.25: [0.5]}, 1) == 0.25  # a tie: the smaller α
  with pytest.raises(ValueError, match="fewer than last=5"):
    forms.choose_alpha(rewards, 5)


def _domain(name, greedy, sampled):
  g, s = np.asarray(greedy, float), np.asarray(sampled, float)
  metrics = {"reward@1": Estimate(100 * g.mean(), 0.0), "mean@4": Estimate(100 * s.mean(), 0.0)}
  return DomainResult(name, metrics, [f"{name}{i}" for i in range(len(g))], g.tolist(), None,
                      s.tolist(), None, {}, [])


def _result(name, rng, p, domains=("code",), n=60):
  return EvalResult(name, EvalConfig(domains=tuple(domains)), {
      d: _domain(d, rng.uniform(size=n) < p, rng.uniform(size=(n, 4)) < p) for d in domains}, {})


def test_summary_against_numpy():
  rng = np.random.default_rng(0)
  cold = _result("cold", rng, 0.3, ("code", "math"))
  teacher = _result("teacher", rng, 0.8)
  runs = {arm: {s: [_result("step40", rng, 0.3 + q / 2), _result("step80", rng, 0.3 + q,
                                                                  ("code", "math"))]
                for s in seeds}
          for arm, q, seeds in (("exact", 0.4, (0, 1, 2)), ("advantage", 0.2, (0, 1, 2)),
                                ("cross_tokenizer", 0.3, (0,)))}
  walls = {"exact": {0: 10.0, 1: 11.0, 2: 12.0}}
  out = forms.summarize(runs, walls, cold, teacher, None, "code", ["math"], "mean@4", 2000)

  def greedy(r, d="code"):
    return np.asarray(r.domains[d].greedy_rewards)

  t = 100 * greedy(teacher).mean()
  for arm, by_seed in runs.items():
    a = out["arms"][arm]
    curve = np.mean([[100 * greedy(cold).mean()] + [100 * greedy(r).mean() for r in by_seed[s]]
                     for s in sorted(by_seed)], axis=0)
    np.testing.assert_allclose(a["greedy"], curve, rtol=1e-12)
    assert a["steps"] == [0, 40, 80]
    assert a["greedy_retention"] == pytest.approx(curve[-1] / t)
    # steps to 90%: the first crossing of 0.9 t, linear between evaluations.
    want = None
    for i in range(1, 3):
      if curve[i] >= 0.9 * t > curve[i - 1]:
        want = a["steps"][i - 1] + (0.9 * t - curve[i - 1]) * 40 / (curve[i] - curve[i - 1])
        break
    assert (a["greedy_steps_to_90"] is None) == (want is None)
    if want is not None:
      assert a["greedy_steps_to_90"] == pytest.approx(want)
    # Other domains: the last checkpoint's per-example scores averaged over seeds, minus the cold start.
    d = np.mean([greedy(by_seed[s][-1], "math") for s in by_seed], axis=0) - greedy(cold, "math")
    o = a["others"]["math"]
    assert o["diff"] == pytest.approx(100 * d.mean())
    assert o["se"] == pytest.approx(100 * d.std(ddof=1) / np.sqrt(d.size), rel=0.1)
    assert o["ci95"] == pytest.approx(1.96 * o["se"]) and o["mde"] == pytest.approx(2.8 * o["se"])
  assert out["arms"]["exact"]["wall_s"] == [10.0, 11.0, 12.0]
  # Paired on the own domain, over the seeds both arms ran (cross: seed 0 only).
  c = out["comparisons"]["cross_tokenizer − advantage"]
  assert c["seeds"] == [0]
  x = np.asarray(runs["cross_tokenizer"][0][-1].domains["code"].sampled_rewards).mean(axis=1)
  y = np.asarray(runs["advantage"][0][-1].domains["code"].sampled_rewards).mean(axis=1)
  assert c["sampled"]["diff"] == pytest.approx(100 * (x - y).mean())
  e = out["comparisons"]["advantage − exact"]
  dx = np.mean([greedy(runs["advantage"][s][-1]) - greedy(runs["exact"][s][-1]) for s in (0, 1, 2)],
               axis=0)
  assert e["seeds"] == [0, 1, 2] and e["greedy"]["diff"] == pytest.approx(100 * dx.mean())
  assert "advantage_outcome − exact" not in out["comparisons"]  # that arm did not run
  text = forms.render({"domains": {"code": out}, "alpha": None, "alpha_sweep": {}})
  assert "| exact | 3 |" in text and "| cross_tokenizer − advantage | 1 |" in text
  assert not any(k.startswith("(") for k in out["comparisons"])  # no γ = 1 arms: no interaction


def test_the_tokenizer_control_interaction_against_numpy():
  rng = np.random.default_rng(1)
  cold, teacher = _result("cold", rng, 0.3), _result("teacher", rng, 0.8)
  seeds = {"advantage": (0, 1, 2), "advantage_g1": (0, 1, 2), "cross_tokenizer": (0, 1),
           "cross_tokenizer_g1": (1, 2)}
  runs = {arm: {s: [_result("step80", rng, p)] for s in seeds[arm]}
          for arm, p in (("advantage", 0.6), ("advantage_g1", 0.5), ("cross_tokenizer", 0.4),
                         ("cross_tokenizer_g1", 0.35))}
  out = forms.summarize(runs, {}, cold, teacher, None, "code", [], "mean@4", 4000)
  row = out["comparisons"]["(cross_tokenizer_g1 − advantage_g1) − (cross_tokenizer − advantage)"]
  assert row["seeds"] == [1]  # the only seed all four arms ran

  def g(arm):
    return np.asarray(runs[arm][1][-1].domains["code"].greedy_rewards, float)

  d = (g("cross_tokenizer_g1") - g("advantage_g1")) - (g("cross_tokenizer") - g("advantage"))
  assert row["greedy"]["diff"] == pytest.approx(100 * d.mean())
  assert row["greedy"]["se"] == pytest.approx(100 * d.std(ddof=1) / np.sqrt(d.size), rel=0.1)
  c = out["comparisons"]["cross_tokenizer_g1 − advantage_g1"]
  assert c["seeds"] == [1, 2]
  text = forms.render({"domains": {"code": out}, "alpha": None, "alpha_sweep": {}})
  assert "| (cross_tokenizer_g1 − advantage_g1) − (cross_tokenizer − advantage) | 1 |" in text


def test_a_cross_tokenizer_teacher_without_its_tokenizer_is_refused(tmp_path):
  from opd.models import to_model_config  # noqa: PLC0415
  model = ml_collections.ConfigDict(_config().world.specialists.model.to_dict())
  model.update(tokenizer="bpe:512", vocab_size=512)
  with pytest.raises(ValueError, match=r"teacher 'code': tokenizer 'bpe:512'.*no directory"):
    distill_job._run_tokenizer("code", to_model_config(model), str(tmp_path / "checkpoints"))
  assert not (tmp_path / "tokenizer").exists()  # nothing built there


def test_opd_forms_tiny_runs_every_arm_through_the_cli(tmp_path):
  workdir = tmp_path / "forms"
  cmd = [sys.executable, "-m", "experiments.launch",
         "--config=experiments/configs/opd_forms.py:tiny", f"--workdir={workdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=one_device_env(), timeout=1500,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "opd_forms" / "summary.json").read_text())
  assert summary["alpha"] == 1.0  # the tiny sweep's only α
  arms = summary["domains"]["math"]["arms"]
  assert set(arms) == set(forms_config.ARMS)
  for arm, a in arms.items():
    assert a["steps"] == [0, 1, 2] and len(a["greedy"]) == 3, arm
    assert set(a["others"]) == {"instruct"}
  # The cross-tokenizer arm's teacher has the byte tokenizer, the student BPE.
  cfg = json.loads((workdir / "opd_forms/math/cross_tokenizer/seed0/opd/config.json").read_text())
  assert cfg["teachers"]["math"]["model"]["tokenizer"] == "byte"
  assert cfg["student"]["model"]["tokenizer"] != "byte"
  assert cfg["opd"]["loss"]["form"] == "advantage"
  assert "| cross_tokenizer − advantage |" in (workdir / "opd_forms" / "report.md").read_text()
