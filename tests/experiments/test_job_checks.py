"""Job-start checks (``experiments.jobs.validate`` / ``experiments.job_checks``).

A bad value of any stage's config is refused when the job starts, naming the
field, before ``config.json`` is written or any stage runs (on the old code
these failed at the first training step, or after hours of earlier stages).
The suite runs with 8 fake CPU devices, so ``mesh=(-1, 1, 1)`` has 8 batch
shards.
"""
import pathlib
import re

import jax
import pytest

from experiments import common, jobs, launch
from opd.config import overrides as config_utils
from opd.parallel import sharding

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs"


def _load(name, *overrides):
  config = config_utils.load_config(f"{CONFIG_DIR / name}.py:tiny")
  return config_utils.apply_overrides(config, list(overrides)) or config


def _refused(config, workdir, pattern):
  with pytest.raises(ValueError, match=pattern):
    launch.launch(config, workdir)
  assert not (workdir / launch.CONFIG_FILE).exists()
  assert [p.name for p in workdir.iterdir()] == [".lock"]  # no stage, no teacher, no log


def test_the_suite_has_eight_batch_shards():
  assert jax.device_count() == 8


@pytest.mark.parametrize("name,overrides,pattern", [
    ("pretrain", ["train.batch_size=12"],
     r"config.train.batch_size=12 is not divisible by the 8 batch shards"),
    ("sft", ["train.batch_size=4"], r"config.train.batch_size=4 is not divisible by the 8 batch"),
    ("grpo", ["grpo.prompts_per_step=3"],
     r"config.grpo.prompts_per_step \* config.grpo.group_size \(= 3 \* 4\)=12 is not divisible"),
    ("distill", ["opd.rollout.group_size=4", "opd.rollout.prompts_per_step=1"],
     r"config.opd.rollout.prompts_per_step \* config.opd.rollout.group_size \(= 1 \* 4\)=4 is "
     r"not divisible"),
    ("distill", ["opd.rollout.prompts_per_step=4", "opd.loss.estimator=bogus"], r"config.opd.*estimator"),
    ("specialists", ["sft.train.batch_size=12"], r"config.sft.train.batch_size=12 is not"),
    ("v4", ["cold_start.batch_size=8", "opd.rollout.prompts_per_step=4", "opd.loss.aggregation=bogus"],
     r"config.opd.*aggregation"),
    ("v4", ["cold_start.batch_size=8", "opd.rollout.prompts_per_step=4", "anneal_optim.lr=-1.0"],
     r"config.anneal_optim.*lr"),
    ("v4", ["cold_start.batch_size=6"], r"config.cold_start.batch_size=6 is not divisible"),
    ("v4", ["cold_start.batch_size=8", "opd.rollout.prompts_per_step=4"],
     r"config.baselines.grpo.prompts_per_step \* config.baselines.grpo.group_size \(= 5 \* 2\)"),
    ("compat", ["opd.rollout.prompts_per_step=3"],
     r"config.opd.rollout.prompts_per_step \* config.opd.rollout.group_size \(= 3 \* 2\)=6 is "
     r"not divisible"),
    ("compat", ["student_sft.train.batch_size=4"], r"config.student_sft.train.batch_size=4 is"),
    ("baselines", ["offpolicy.batch_size=12"], r"config.offpolicy.batch_size=12 is not divisible"),
    ("baselines", ["offpolicy.batch_size=8", "rl_optim.lr=-1.0"], r"config.rl_optim.*lr"),
    ("grm", ["benchmark.ks=(1, 0)"], r"config.benchmark ks for 'rft'=\(1, 0\) must be"),
])
def test_a_late_stage_config_is_refused_at_job_start(tmp_path, name, overrides, pattern):
  _refused(_load(name, *overrides), tmp_path, pattern)


def test_grm_benchmark_ks_by_stage_names_grm_stages(tmp_path):
  config = _load("grm")
  config.benchmark.ks_by_stage.rule_rll = (1, 2)
  _refused(config, tmp_path, r"config.benchmark.ks_by_stage names \['rule_rll'\], which are not "
                             r"GRM stages")


# Warmup longer than the stage that runs it (and a decay that outlasts it), for
# every trainer a job runs: refused at job start, naming the optimizer field and
# the step field of that stage. The tiny configs' step counts, read by the
# test from the loaded config, are the stage's real length: each case sets
# the warmup to that + 1 (or the decay so warmup + decay is that + 1).
_WARMUP_CASES = [
    # (config, step field the stage runs, optimizer field)
    ("pretrain", "train.steps", "optim"),
    ("sft", "train.steps", "optim"),
    ("grpo", "train.steps", "optim"),
    ("distill", "train.steps", "optim"),  # OPD
    ("distill:job=cold_start", "cold_start.steps", "optim"),
    ("distill", "build_teachers.sft_steps", "build_teachers.optim"),
    ("specialists", "base.train.steps", "base.optim"),
    ("specialists", "grpo_train.steps", "grpo_optim"),
    ("v4", "cold_start.steps", "cold_start_optim"),
    ("v4", "opd_train.steps", "opd_optim"),
    ("v4", "anneal.steps", "anneal_optim"),
    ("v4", "specialists.sft.train.steps", "specialists.sft.optim"),
    ("baselines:job=offpolicy_kd", "kd.steps", "kd_optim"),
    ("baselines:job=mixed_rl", "rl_train.steps", "rl_optim"),
    ("baselines", "build.sft_steps", "build.optim"),
    ("compat", "opd_train.steps", "opd_optim"),
    ("compat", "student_sft.train.steps", "student_sft.optim"),
]


@pytest.fixture
def one_device(monkeypatch):
  """The job checks build ``config.mesh`` over one device, as a CLI run on a
  one-device machine does (the shipped tiny configs' batches are sized for
  that; the suite's 8 fake devices are for the batch-shard cases above)."""
  def mesh_and_rules(config):
    rules = tuple(config.get("sharding_rules", None) or sharding.DEFAULT_RULES)
    return (sharding.make_mesh(tuple(config.mesh), jax.devices()[:1]),
            sharding.validate_rules(rules))
  monkeypatch.setattr(common, "mesh_and_rules", mesh_and_rules)


def _load_variant(spec, *overrides):
  name, _, extra = spec.partition(":")
  config = config_utils.load_config(f"{CONFIG_DIR / name}.py:tiny{',' + extra if extra else ''}")
  return config_utils.apply_overrides(config, list(overrides)) or config


def _get(config, dotted):
  for key in dotted.split("."):
    config = config[key]
  return config


@pytest.mark.parametrize("spec,steps,optim", _WARMUP_CASES,
                         ids=[f"{c}-{o}" for c, _, o in _WARMUP_CASES])
def test_a_warmup_longer_than_its_stage_is_refused_at_job_start(tmp_path, one_device, spec,
                                                                steps, optim):
  n = _get(_load_variant(spec), steps)
  # A constant schedule: only the warmup can be wrong.
  config = _load_variant(spec, f"{optim}.warmup_steps={n + 1}", f"{optim}.schedule=constant")
  _refused(config, tmp_path, rf"config.{re.escape(optim)}.warmup_steps={n + 1} exceeds "
                             rf"config.{re.escape(steps)}={n}: the run would end before the warmup")


@pytest.mark.parametrize("spec,steps,optim", [
    ("distill", "train.steps", "optim"),
    ("v4", "anneal.steps", "anneal_optim"),
    ("v4", "cold_start.steps", "cold_start_optim"),
    ("baselines:job=offpolicy_kd", "kd.steps", "kd_optim"),
    ("sft", "train.steps", "optim"),
])
def test_a_decay_that_outlasts_its_stage_is_refused_at_job_start(tmp_path, one_device, spec,
                                                                steps, optim):
  config = _load_variant(spec)
  n, warm = _get(config, steps), _get(config, optim).warmup_steps
  assert warm < n  # the case is about the decay alone
  config = _load_variant(spec, f"{optim}.decay_steps={n - warm + 1}", f"{optim}.schedule=cosine")
  _refused(config, tmp_path, rf"config.{re.escape(optim)}.warmup_steps \+ "
                             rf"config.{re.escape(optim)}.decay_steps \(= {warm} \+ "
                             rf"{n - warm + 1}\) exceeds config.{re.escape(steps)}={n}")


def test_specialists_per_domain_step_overrides_are_checked(tmp_path, one_device):
  # math's SFT runs per_domain.math.sft_steps = 3 steps (not sft.train.steps = 5).
  config = _load("specialists", "sft.optim.warmup_steps=4", "sft.optim.decay_steps=1",
                 "per_domain.math.sft_steps=3")
  _refused(config, tmp_path, r"config.sft.optim.warmup_steps=4 exceeds "
                             r"config.per_domain.math.sft_steps=3")
  config = _load("specialists", "per_domain.code.grpo_steps=1")  # grpo_optim warms up 2 steps
  assert config.grpo_optim.warmup_steps == 2
  _refused(config, tmp_path, r"config.grpo_optim.warmup_steps=2 exceeds "
                             r"config.per_domain.code.grpo_steps=1")


def test_the_specialists_check_refits_an_overridden_sft_decay_as_the_job_does(one_device):
  # sft.optim: warmup 1 + decay 4 = the shared 5 steps. math's override of 3
  # steps is valid: the job refits the cosine decay to 3 - 1 = 2 steps
  # (experiments/specialists.py), so the check must not compare 1 + 4 with 3.
  config = _load("specialists", "per_domain.math.sft_steps=3")
  assert (config.sft.optim.warmup_steps, config.sft.optim.decay_steps) == (1, 4)
  jobs.validate(config)


def test_sequential_rl_checks_the_warmup_against_its_shortest_stage(tmp_path, one_device):
  # 5 steps over 2 domains: stages of 3 and 2 steps, each with a fresh optimizer.
  config = _load_variant("baselines:job=sequential_rl", "rl_train.steps=5",
                         "rl_optim.warmup_steps=3")
  _refused(config, tmp_path, r"config.rl_optim.warmup_steps=3 exceeds config.rl_train.steps // "
                             r"len\(config.sequential.order\) \(= 5 // 2")
  config = _load_variant("baselines:job=sequential_rl", "rl_train.steps=1")
  _refused(config, tmp_path, r"config.rl_train.steps=1 is fewer than the 2 stages of "
                             r"config.sequential.order")


# Every shipped config, default and tiny, with the job variants of those that
# have them, passes every job-start check.
_SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("__init__", "common"))
_VARIANTS = ([(n, v) for n in _SHIPPED for v in ("", "tiny")]
             + [(n, f"{t}job={j}") for t in ("", "tiny,") for n, j in (
                 ("distill", "cold_start"), ("baselines", "offpolicy_kd"),
                 ("baselines", "mixed_rl"), ("baselines", "sequential_rl"))]
             + [("v4", "all_baselines"), ("v4", "tiny,all_baselines")])


@pytest.mark.parametrize("name,variant", _VARIANTS, ids=[f"{n}:{v}" for n, v in _VARIANTS])
def test_every_shipped_config_passes_its_job_start_check(one_device, name, variant):
  config = config_utils.load_config(f"{CONFIG_DIR / name}.py" + (f":{variant}" if variant else ""))
  jobs.validate(config)


def test_a_model_that_cannot_fit_the_device_is_refused_at_job_start(one_device, monkeypatch):
  """The memory model (opd.parallel.memory) at job start: the same config fits a
  device of its estimate's size and is refused, naming the batch fields, on one
  byte less; the estimate is computed here independently of the check."""
  from opd.models import to_model_config  # noqa: PLC0415
  from opd.parallel import memory  # noqa: PLC0415
  config = config_utils.load_config(f"{CONFIG_DIR / 'pretrain'}.py:tiny")
  est = memory.estimate_memory(to_model_config(config.model), (1, 1, 1),
                               config.train.batch_size, config.train.seq_len)
  monkeypatch.setattr(memory, "device_bytes", lambda: est.total)
  jobs.validate(config)
  monkeypatch.setattr(memory, "device_bytes", lambda: est.total - 1)
  with pytest.raises(memory.DoesNotFitError,
                     match=r"config.train.batch_size x config.train.seq_len: layout mesh .* "
                           r"needs .* GiB per device"):
    jobs.validate(config)


def test_device_bytes_is_the_host_memory_shared_by_the_cpu_devices():
  import jax  # noqa: PLC0415
  from opd.parallel import memory  # noqa: PLC0415
  with open("/proc/meminfo", encoding="utf-8") as f:
    avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
  got = memory.device_bytes()
  # MemAvailable moves between the two reads: within 5% of the host's memory.
  assert abs(got * jax.local_device_count() - avail) <= 0.05 * avail


@pytest.mark.parametrize("name", [n for n, *_ in __import__(
    "experiments.replicate", fromlist=["RUNS"]).RUNS])
def test_every_replication_run_builds_and_passes_its_job_start_check(one_device, name):
  """``experiments.replicate``: each run's config spec and ``--config.*``
  overrides name real fields of the right type, and the result passes the
  job-start checks the launcher runs."""
  from experiments import replicate  # noqa: PLC0415
  (_, argv), = replicate.commands("workdirs", only=[name])
  spec = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
  overrides = [a[len("--config."):] for a in argv if a.startswith("--config.")]
  config = config_utils.load_config(spec)
  config_utils.apply_overrides(config, overrides)
  assert all(a.startswith(("--config", "--workdir=workdirs/")) for a in argv[3:])
  jobs.validate(config)


def test_replicate_refuses_an_unknown_run_name():
  from experiments import replicate  # noqa: PLC0415
  with pytest.raises(ValueError, match=r"--only names \['nope'\]"):
    replicate.commands("workdirs", only=["nope"])
