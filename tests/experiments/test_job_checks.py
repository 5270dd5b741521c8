"""Job-start checks (``experiments.jobs.validate`` / ``experiments.job_checks``).

A bad value of any stage's config is refused when the job starts, naming the
field, before ``config.json`` is written or any stage runs (on the old code
these failed at the first training step, or after hours of earlier stages).
The suite runs with 8 fake CPU devices, so ``mesh=(-1, 1, 1)`` has 8 batch
shards.
"""
import pathlib

import jax
import pytest

from experiments import launch
from opd.config import overrides as config_utils

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
    ("distill", ["opd.group_size=4", "opd.prompts_per_step=1"],
     r"config.opd.prompts_per_step \* config.opd.group_size \(= 1 \* 4\)=4 is not divisible"),
    ("distill", ["opd.prompts_per_step=4", "opd.estimator=bogus"], r"config.opd.*estimator"),
    ("specialists", ["sft.train.batch_size=12"], r"config.sft.train.batch_size=12 is not"),
    ("v4", ["cold_start.batch_size=8", "opd.prompts_per_step=4", "opd.aggregation=bogus"],
     r"config.opd.*aggregation"),
    ("v4", ["cold_start.batch_size=8", "opd.prompts_per_step=4", "anneal_optim.lr=-1.0"],
     r"config.anneal_optim.*lr"),
    ("v4", ["cold_start.batch_size=6"], r"config.cold_start.batch_size=6 is not divisible"),
    ("v4", ["cold_start.batch_size=8", "opd.prompts_per_step=4"],
     r"config.baselines.grpo.prompts_per_step \* config.baselines.grpo.group_size \(= 5 \* 2\)"),
    ("compat", ["opd.prompts_per_step=3"],
     r"config.opd.prompts_per_step \* config.opd.group_size \(= 3 \* 2\)=6 is not divisible"),
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
