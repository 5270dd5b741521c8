"""Every config in experiments/configs/ runs its ``tiny`` variant end to end.

Each run is the real command line, ``python -m experiments.launch
--config=FILE.py:tiny --workdir=...``, in a subprocess with one CPU device
(the suite's 8 fake devices would only slow the compile), and is checked for
what a user looks at: final metrics, checkpoints, metrics.jsonl and plots.
"""
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from opd.config import overrides as config_utils
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs"
# distill: tests/experiments/test_distill_job.py runs its tiny variant through the CLI.
# compat: tests/experiments/test_compat_job.py does; gencluster: test_gencluster_job.py;
# mathv2: test_mathv2_job.py; opd_forms: test_opd_forms_experiment.py.
SMOKE_TESTED = {"pretrain", "sft", "grpo", "specialists", "distill", "baselines", "v4", "grm",
                "grm_reward", "compat", "gencluster", "mathv2", "opd_forms"}


def _load(name, arg="tiny"):
  return config_utils.load_config(f"{CONFIG_DIR / name}.py:{arg}")


def _launch(name, workdir, *overrides, arg="tiny"):
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG_DIR / name}.py:{arg}",
         f"--workdir={workdir}", *overrides]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                        cwd=CONFIG_DIR.parents[1])
  if proc.returncode:
    raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads((pathlib.Path(workdir) / "final_metrics.json").read_text())


def test_every_config_has_a_smoke_test():
  # common.py holds groups the configs share; it is no config (no get_config).
  configs = {p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("__init__", "common")}
  assert configs == SMOKE_TESTED, f"configs without a smoke test: {configs - SMOKE_TESTED}"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pretrain")
  return workdir, _launch("pretrain", workdir)


def test_pretrain_tiny(pretrained):
  workdir, metrics = pretrained
  cfg = _load("pretrain")
  assert metrics["steps"] == cfg.train.steps
  # A fresh model predicts ~uniformly over the vocabulary: loss ≈ ln(V).
  assert abs(metrics["train_loss_first"] - math.log(cfg.model.vocab_size)) < 0.3
  assert metrics["train_loss_final"] < metrics["train_loss_first"]
  assert math.isfinite(metrics["eval_loss"])
  assert (workdir / "checkpoints" / str(cfg.train.steps)).is_dir()
  assert pathlib.Path(metrics["plot"]).is_file()
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any("eval/loss" in r for r in rows) and any("loss" in r for r in rows)
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(workdir), size_guidance={"histograms": 0, "tensors": 0})
  events.Reload()
  tags = events.Tags()
  assert "loss" in tags["scalars"] and "eval/loss" in tags["scalars"]
  assert any(t.startswith("params/") for t in tags["histograms"])
  assert "samples" in tags["tensors"]


@pytest.fixture(scope="module")
def fine_tuned(pretrained, tmp_path_factory):
  base_dir, _ = pretrained
  workdir = tmp_path_factory.mktemp("sft")
  metrics = _launch("sft", workdir, f"--config.init={base_dir / 'checkpoints'}",
                    "--config.data.domains=('agent', 'code')")
  return workdir, metrics


def test_sft_tiny_from_pretrained(fine_tuned):
  workdir, metrics = fine_tuned
  cfg = _load("sft")
  assert metrics["steps"] == cfg.train.steps
  assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
  assert (workdir / "checkpoints" / str(cfg.train.steps)).is_dir()


def test_grpo_tiny_from_sft(fine_tuned, tmp_path):
  """The job runs GRPO as configured, from the SFT checkpoint.

  Checked per step: the documented metrics, finite; P * G scored samples of
  the configured domains; the optimizer's configured schedule; and at step 1
  the policy equals its frozen reference (both are the loaded checkpoint),
  so their KL is rounding noise. The tiny SFT model's 16-token samples are
  all malformed (reward 0), so this run cannot show learning;
  tests/opd/rl/test_grpo.py does (bandit, same-prompt groups).
  """
  from experiments import common
  from opd.training.optim import make_schedule

  sft_dir, _ = fine_tuned
  cfg = _load("grpo")
  domains = ("agent", "math")
  metrics = _launch("grpo", tmp_path, f"--config.init={sft_dir / 'checkpoints'}",
                    f"--config.data.domains={domains}")
  upb, batch = cfg.grpo.updates_per_batch, cfg.grpo.prompts_per_step * cfg.grpo.group_size
  assert metrics["steps"] == cfg.train.steps
  assert metrics["updates"] == cfg.train.steps * upb
  assert 0.0 <= metrics["reward_first"] <= 1.0 and 0.0 <= metrics["reward_last"] <= 1.0
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, cfg.train.steps + 1))
  documented = ("reward/mean", "reward/std", "groups/zero_std_fraction", "advantage/abs_mean",
                "reward_reason/error_fraction", "response/length_mean",
                "response/truncation_rate", "response/policy_tokens", "train/loss",
                "train/policy_loss", "train/kl", "train/entropy", "train/ratio_mean",
                "train/grad_norm", "train/lr", "perf/step_time_s")
  schedule = make_schedule(common.optim_config(cfg.optim))
  seen_domains = set()
  for r in rows:
    missing = [k for k in documented if k not in r]
    assert not missing, (r["step"], missing)
    assert all(math.isfinite(r[k]) for k in documented), r
    reasons = {k: v for k, v in r.items() if k.startswith("reward_reason/")
               and k not in ("reward_reason/error_fraction", "reward_reason/bad_example")}
    assert sum(reasons.values()) == batch, (r["step"], reasons)
    seen_domains |= {k.split("/")[2] for k in r if k.startswith("reward/domain/")}
    updates = range((r["step"] - 1) * upb, r["step"] * upb)
    lr = float(np.mean([float(schedule(u)) for u in updates]))
    assert r["train/lr"] == pytest.approx(lr, rel=4 * float(np.finfo(np.float32).eps)), r["step"]
  assert seen_domains and seen_domains <= set(domains), seen_domains
  # Step 1: policy == reference, so k3 ~ d^2 / 2 for a log-prob difference d
  # from rounding only, |d| <~ eps * V (a logsumexp over V O(1) logits). A
  # policy not loaded from --config.init (or another reference) is O(1) away.
  V = cfg.model.vocab_size
  assert 0.0 <= rows[0]["train/kl"] <= 0.5 * (np.finfo(np.float32).eps * V) ** 2, rows[0]
  assert (tmp_path / "checkpoints" / str(cfg.train.steps)).is_dir()


def test_specialists_tiny(tmp_path):
  """The whole pipeline: every stage's run directory, the table and the heatmap."""
  cfg = _load("specialists")
  metrics = _launch("specialists", tmp_path)
  for d in cfg.domains:
    for stage in ("sft", "grpo"):
      assert (tmp_path / d / stage / "final_metrics.json").is_file(), (d, stage)
  assert (tmp_path / "base" / "final_metrics.json").is_file()
  assert pathlib.Path(metrics["heatmap"]).is_file()
  report = pathlib.Path(metrics["report"]).read_text()
  for d in cfg.domains:
    assert f"| {d} |" in report
    assert 0.0 <= metrics[f"specialist/{d}"] <= 100.0
  # Per-domain GRPO learning rates reach the stage configs (0: shared value).
  for d in cfg.domains:
    stage = json.loads((tmp_path / d / "grpo" / "config.json").read_text())
    want = cfg.per_domain[d].grpo_lr or cfg.grpo_optim.lr
    assert stage["optim"]["lr"] == pytest.approx(want), d
  assert cfg.per_domain.math.grpo_lr != cfg.grpo_optim.lr  # the override is exercised


@pytest.mark.parametrize("field,value,pattern", [
    ("per_domain.poetry", {"sft_steps": 3}, r"per_domain.poetry: unknown domain 'poetry'"),
    ("per_domain.math.grpo_lr", -1e-4, r"per_domain.math.grpo_lr=-0.0001"),
    ("per_domain.code.sft_steps", -3, r"per_domain.code.sft_steps=-3"),
])
def test_specialists_bad_per_domain_names_the_field(tmp_path, field, value, pattern):
  import ml_collections
  from experiments import specialists
  cfg = _load("specialists")
  *parents, leaf = field.split(".")
  group = cfg
  for name in parents:
    group = group[name]
  with cfg.unlocked():
    group[leaf] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
  with pytest.raises(ValueError, match=pattern):
    specialists.run(cfg, str(tmp_path))
  assert not (tmp_path / "base").exists()  # refused before any work


def test_sft_without_init_names_the_field(tmp_path):
  from experiments import launch
  with pytest.raises(ValueError, match="config.init must name a checkpoint directory"):
    launch.launch(_load("sft"), tmp_path)


@pytest.mark.parametrize("group,field,value,pattern", [
    ("grpo", "bogus", 1, r"config.grpo has unknown field\(s\) \['bogus'\]"),
    ("grpo", "group_size", 0, r"config.grpo: .*group_size"),
    ("agent_reward", "format", -0.3,
     r"config.agent_reward: AgentRewardConfig.format must be a finite number >= 0, got -0.3"),
    ("agent_reward", "tool_use", 0.1, r"config.agent_reward has unknown field\(s\) \['tool_use'\]"),
    ("optim", "lr_peak", 1e-3, r"config.optim has unknown field\(s\) \['lr_peak'\]"),
])
def test_job_config_groups_name_the_field(group, field, value, pattern):
  """Config groups become dataclasses through one helper that names the group."""
  from experiments import common
  from experiments import grpo as grpo_job
  build = {"grpo": grpo_job.grpo_config, "agent_reward": grpo_job.agent_reward_config,
           "optim": common.optim_config}[group]
  values = dict(_load("grpo")[group].to_dict(), **{field: value})
  with pytest.raises(ValueError, match=pattern):
    build(values)


def _groups_by_identity(config, path=""):
  """``[(path, ConfigDict)]`` of every group reachable from ``config``."""
  import ml_collections
  out = []
  for key in config.keys():
    value = config[key]
    if isinstance(value, ml_collections.ConfigDict):
      out.append((f"{path}{key}", value))
      out += _groups_by_identity(value, f"{path}{key}.")
  return out


@pytest.mark.parametrize("name", sorted(SMOKE_TESTED))
def test_config_groups_are_never_shared_between_roles(name):
  """Two roles holding one ConfigDict object (``distill.py:tiny``'s teachers
  did) means overriding one changes the other."""
  for arg in ("tiny", None):
    config = config_utils.load_config(f"{CONFIG_DIR / name}.py" + (f":{arg}" if arg else ""))
    seen = {}
    for path, group in _groups_by_identity(config):
      assert id(group) not in seen, f"{name}:{arg}: {path} is the same group as {seen[id(group)]}"
      seen[id(group)] = path


def test_overriding_one_distill_teacher_leaves_the_other():
  config = _load("distill")
  first, second = list(config.teachers)[:2]
  before = config.teachers[second].model.to_dict()
  config_utils.apply_overrides(config, [f"teachers.{first}.model.d_model=64"])
  assert config.teachers[first].model.d_model == 64
  assert config.teachers[second].model.to_dict() == before
