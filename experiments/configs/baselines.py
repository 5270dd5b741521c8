"""The baselines OPD is measured against (docs/DESIGN.md §3, "Baselines and curve metrics").

  # after the specialists pipeline and the cold start (experiments/configs/distill.py):
  python -m experiments.launch --jobs_module=experiments.baselines \
      --config=experiments/configs/baselines.py --workdir=workdirs/baselines \
      --config.student.init=workdirs/distill_cold_start/checkpoints
  # one baseline alone (merge | task_arithmetic | offpolicy_kd | mixed_rl | sequential_rl):
  python -m experiments.launch --jobs_module=experiments.baselines \
      --config=experiments/configs/baselines.py:job=mixed_rl --workdir=workdirs/mixed_rl
  # CI smoke test: builds a random base and two tiny specialists (math, instruct) itself
  python -m experiments.launch --jobs_module=experiments.baselines \
      --config=experiments/configs/baselines.py:tiny --workdir=workdirs/baselines_tiny

The variant argument: ``job=baselines|merge|task_arithmetic|offpolicy_kd|mixed_rl|
sequential_rl`` (``baselines``, the default, runs the five as stages of one
workdir, each in ``WORKDIR/<job>/``), ``tiny``. Every baseline writes a
checkpoint of the model it produces (``<dir>/checkpoints``, for
``opd.training.checkpoints.load_params``) and ``final_metrics.json``.

Inputs: ``config.teachers.<name>`` (``init``, ``domain``, ``model``: the
specialists; merging needs them to share ``config.model``'s architecture),
``config.base.init`` (the model the specialists were fine-tuned from: task
arithmetic's θ_base and the off-policy student's start) and
``config.student.init`` (the cold-start student the RL baselines start
from, as OPD does; "" means the base).

Budget, matched to OPD's default (experiments/configs/distill.py: 100 steps
of 8 prompts × 4 samples × ≤ 48 new tokens, one update per step): mixed RL
100 GRPO steps of the same shape (≤ 153,600 sampled tokens, 100 updates);
sequential RL 5 domains × 20 steps (the same totals); off-policy KD 100
updates of 32 teacher sequences (the teachers sample ≤ 2 × 256 × 5 answers
of ≤ 48 tokens once; the student samples nothing); merging and task
arithmetic train nothing. The jobs report ``sampled_tokens`` and ``updates``.

Reference machine (2 CPU cores): tiny ≈ 1 min of CPU (52 s user time with a
cold compilation cache, mostly compiles; 2.3 min wall on a machine loaded
by other jobs); the default is not measured here (mixed RL ≈ one specialist's
GRPO stage at 5× the steps). Expected result: every stage finishes and
writes its checkpoint; OPD's claim (docs/DESIGN.md §3) is that the OPD
student keeps each specialist's score where these baselines lose some
(merging: interference between task vectors; mixed RL: competing domains;
sequential RL: forgetting of the earlier domains). ``task_arithmetic.scale``
(λ) is fixed a priori; choose it on a validation split, never the test split.
"""
import ml_collections

from experiments.configs import grpo as grpo_config
from experiments.configs import pretrain as pretrain_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.distill.offpolicy import OffPolicyConfig
from opd.tasks import ALL_DOMAINS
from opd.training.optim import OptimConfig

JOBS = ("baselines", "merge", "task_arithmetic", "offpolicy_kd", "mixed_rl", "sequential_rl")


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False, job="baselines")
  if arg["job"] not in JOBS:
    raise ValueError(f"config arg job={arg['job']!r}: expected one of {JOBS}")
  variant = "tiny" if arg["tiny"] else None
  pre, rl = pretrain_config.get_config(variant), grpo_config.get_config(variant)
  c = ml_collections.ConfigDict()
  c.job = arg["job"]
  c.seed = 0
  c.mesh = pre.mesh
  c.sharding_rules = pre.sharding_rules
  c.model = pre.model
  c.domains = ALL_DOMAINS
  # The stages the ``baselines`` job runs, in order.
  c.baselines = JOBS[1:]
  c.base = ml_collections.ConfigDict(dict(init="workdirs/specialists/base/checkpoints"))
  c.student = ml_collections.ConfigDict(dict(init="workdirs/distill_cold_start/checkpoints"))
  c.teachers = ml_collections.ConfigDict({
      d: ml_collections.ConfigDict(dict(init=f"workdirs/specialists/{d}/grpo/checkpoints",
                                        domain=d, model=ml_collections.ConfigDict(
                                            pre.model.to_dict())))
      for d in ALL_DOMAINS})
  # Train prompts per domain (every baseline draws from the same ones) and
  # held-out prompts per domain for the off-policy eval.
  c.data = ml_collections.ConfigDict(dict(num_prompts=512, num_heldout=16, difficulties=(1,)))
  c.task_arithmetic = ml_collections.ConfigDict(dict(scale=0.5))
  c.offpolicy = to_group(OffPolicyConfig, batch_size=32, seq_len=192, max_new_tokens=48,
                         samples_per_prompt=2, min_reward=1.0)
  c.kd = ml_collections.ConfigDict(dict(init="", num_prompts=256, steps=100, save_every=50,
                                        eval_every=10, keep_checkpoints=2))
  c.kd_optim = to_group(OptimConfig, lr=3e-4, warmup_steps=5, decay_steps=95, schedule="cosine")
  c.grpo = rl.grpo
  c.grpo.update(prompts_per_step=8, group_size=4, max_new_tokens=48, seq_len=192)
  c.rl_optim = rl.optim
  c.rl_train = ml_collections.ConfigDict(dict(steps=100, save_every=50, keep_checkpoints=1))
  c.agent_reward = rl.agent_reward
  # Sequential RL: this domain order, rl_train.steps split evenly over it.
  c.sequential = ml_collections.ConfigDict(dict(order=ALL_DOMAINS))
  # Building the inputs where an init is "" (tiny): a random base saved as a
  # checkpoint, then each teacher SFT'd from it on its domain.
  c.build = ml_collections.ConfigDict(dict(
      sft_steps=0, num_train=64, batch_size=8, seq_len=160,
      optim=to_group(OptimConfig, lr=3e-3, warmup_steps=2, decay_steps=18, schedule="cosine")))
  if arg["tiny"]:
    tiny_domains = ("math", "instruct")
    c.domains = c.sequential.order = tiny_domains
    c.base.init = c.student.init = ""
    c.teachers = ml_collections.ConfigDict(
        {d: ml_collections.ConfigDict(dict(init="", domain=d, model=ml_collections.ConfigDict(
            pre.model.to_dict()))) for d in tiny_domains})
    c.build.sft_steps = 20
    c.data.update(num_prompts=8, num_heldout=2)
    # Tiny teachers are rarely right: keep every finished answer.
    # length_bucket=0: one row length, so each program compiles once.
    c.offpolicy.update(batch_size=4, seq_len=160, length_bucket=0, max_new_tokens=12,
                       min_reward=0.0, samples_per_prompt=2, sample_batch_size=16)
    c.kd.update(num_prompts=8, steps=3, save_every=3, eval_every=3)
    c.kd_optim.update(lr=3e-3, warmup_steps=1, decay_steps=2)
    c.grpo.update(prompts_per_step=2, group_size=2, max_new_tokens=8, seq_len=128,
                  length_bucket=0)
    c.rl_train.update(steps=2, save_every=2)
    # Sequential RL's stages have 1 step each (2 over 2 domains): warmup 1.
    c.rl_optim.update(warmup_steps=1)
  return c


def get_sweep(arg=None):
  """λ of task arithmetic (with ``:job=task_arithmetic``; 1/N is the plain
  average, 1 adds every task vector in full)."""
  del arg
  return [{"task_arithmetic.scale": s} for s in (0.3, 0.5, 0.7, 1.0)]
