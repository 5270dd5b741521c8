"""The V4 post-training pipeline at toy size: what ``make demo`` runs (docs/DESIGN.md §3, §11).

  make demo                                    # = the command below
  python -m experiments.demo --workdir=workdirs/demo
  python -m experiments.launch --config=experiments/configs/v4.py --workdir=workdirs/demo
  # three student seeds (cold start, OPD, annealing each), mean ± std across seeds:
  python -m experiments.launch --config=experiments/configs/v4.py:seeds=3 --workdir=workdirs/demo
  # every baseline (adds off-policy KD and sequential RL to the default's three):
  python -m experiments.launch --config=experiments/configs/v4.py:all_baselines \
      --workdir=workdirs/demo
  # CI smoke test: every stage at a few steps
  python -m experiments.launch --config=experiments/configs/v4.py:tiny --workdir=workdirs/v4_tiny

The variant argument: ``tiny``, ``seeds=N`` (student seeds 0..N-1),
``all_baselines``, ``strong`` (the stronger toy world of
experiments/configs/specialists.py, with the positive control on and 200 test
examples per domain). Stages are shared with the separate jobs (``specialists``,
``cold_start``/``opd`` in experiments/configs/distill.py, the baselines in
experiments/configs/baselines.py), so the same workdir extends step by step:
``seeds=3`` after a default run trains and evaluates only seeds 1 and 2.
A lever in its own workdir reuses the finished stages of another:

  python -m experiments.launch --config=experiments/configs/v4.py --workdir=workdirs/v4_seqmean \
      --config.reuse_from=workdirs/demo --config.opd.loss.aggregation=sequence_mean

Levers (docs/RESULTS.md, "Levers"): ``opd.loss.teacher_temperature``,
``opd.rollout.temperature`` (the student's sampling temperature), ``opd_optim.lr``,
``cold_start.num_prompts`` / ``samples_per_prompt`` / ``steps`` (cold-start
length) and ``student_width`` (a wider student with its own base; the
student-side baselines train the same wide network).

Budget (the same for OPD and the RL baselines): OPD 80 steps + annealing 20
steps of 8 prompts × 4 samples × ≤ 80 new tokens (100 updates, ≤ 256,000
sampled tokens); mixed RL 100 GRPO steps of the same shape; merging trains
nothing. Reference machine (2 CPU cores): see the README for the measured
wall time of ``make demo`` (the specialists ≈ 10–20 min, the rest below).
Expected result: see docs/RESULTS.md ("V4 pipeline"), read honestly.
"""
import ml_collections

from experiments.configs import baselines as baselines_config
from experiments.configs import common as common_config
from experiments.configs import specialists as specialists_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.eval.evaluation import EvalConfig

DEFAULT_BASELINES = ("merge", "task_arithmetic", "mixed_rl")
ALL_BASELINES = ("merge", "task_arithmetic", "mixed_rl", "sequential_rl", "offpolicy_kd")


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False, seeds=1, all_baselines=False, strong=False)
  if arg["seeds"] < 1:
    raise ValueError(f"config arg seeds={arg['seeds']}: expected >= 1")
  variant = "tiny" if arg["tiny"] else None
  spec = specialists_config.get_config(",".join(k for k in ("tiny", "strong") if arg[k]))
  if arg["tiny"]:
    spec.domains = ("math", "instruct")  # two domains keep the CI smoke test short
  bl = baselines_config.get_config(variant)
  c = ml_collections.ConfigDict()
  c.job = "v4"
  c.seed = 0
  # Finished workdirs (comma-separated) whose stages are read, not rerun,
  # when their stage config matches (experiments.common.Stages).
  c.reuse_from = ""
  # The student's width D (0: the specialists' model). Another width gets its
  # own base, pre-trained by the specialists' base recipe (experiments/v4.py).
  c.student_width = 0
  c.specialists = spec
  c.student_seeds = tuple(range(arg["seeds"]))
  # Negative control: OPD and annealing route domain i's prompts to the
  # specialist of domain i + teacher_shift (0: the right one). Run it with
  # --config.positive_control.steps=0 in its own workdir (docs/RESULTS.md).
  c.teacher_shift = 0
  c.report_metric = "reward@1"
  # Held-out test sets: every row scored the same way, greedy and mean@4.
  c.eval = to_group(EvalConfig, omit=("domains",), n_per_domain=60, max_new_tokens=80,
                    num_samples=4)
  # The student's stages: data, cold start, OPD, annealing (shared with the
  # full-size distillation ablations, experiments/configs/common.py).
  for name, group in common_config.demo_student_stages(arg["tiny"]).items():
    setattr(c, name, group)
  # Single-teacher OPD per domain from the first seed's cold start, scored at
  # every checkpoint (experiments/positive_control.py); 0 steps: none.
  # only=True: stop after the control (an estimator or loss-form arm in its
  # own workdir: --config.positive_control.domains=code --config.opd.loss.estimator=token).
  c.positive_control = ml_collections.ConfigDict(dict(steps=0, eval_every=40, domains=(),
                                                      prompts_per_step=0, only=False))
  if arg["strong"] and arg["tiny"]:
    c.positive_control.update(steps=2, eval_every=1)
  elif arg["strong"]:
    c.positive_control.update(steps=160, eval_every=40, prompts_per_step=8)
    # Every distinct level-1 test problem up to 200 per domain (writing holds
    # 62, instruct 195; EvalConfig.all_if_fewer).
    c.eval.update(n_per_domain=200, all_if_fewer=True)
    c.cold_start.update(seq_len=128, max_new_tokens=48)
    # The budget the positive control sets (docs/RESULTS.md, "A stronger toy
    # world"): one teacher alone reached 90% in ~100 steps of 8 prompts of
    # its domain (code; math had not at 160); 400 domain-balanced steps of
    # 10 prompts give each domain 800 prompts, as 100 single-domain steps.
    c.opd.rollout.update(seq_len=128, max_new_tokens=48, prompts_per_step=10,
                         domain_balance=True)
    c.opd_train.update(steps=400, save_every=100, eval_every=100)
    c.opd_optim.update(decay_steps=395)

  c.baselines = bl
  c.baselines.baselines = ALL_BASELINES if arg["all_baselines"] else DEFAULT_BASELINES
  c.baselines.domains = spec.domains
  c.baselines.model = ml_collections.ConfigDict(spec.model.to_dict())  # e.g. the strong world's
  c.baselines.teachers = ml_collections.ConfigDict({
      d: ml_collections.ConfigDict(dict(init="", domain=d, model=ml_collections.ConfigDict(
          spec.model.to_dict()))) for d in spec.domains})  # inits: the specialists, at run time
  c.baselines.sequential.order = spec.domains
  c.baselines.grpo.update(max_new_tokens=80, seq_len=256)
  c.baselines.rl_train.update(steps=100)
  if arg["tiny"]:
    c.eval.update(n_per_domain=4, num_samples=2, max_new_tokens=16, batch_size=8,
                  bootstrap_samples=50)
    c.baselines.grpo.update(prompts_per_step=5, group_size=2, max_new_tokens=8, seq_len=128)
    c.baselines.rl_train.update(steps=2, save_every=2)
    c.baselines.kd.update(steps=2, save_every=2, eval_every=2)
    c.baselines.kd_optim.update(decay_steps=1)  # warmup 1 + decay 1 = its 2 steps
  if arg["strong"] and not arg["tiny"]:
    # Mixed RL at the same updates (OPD 400 + annealing 20) and sampled tokens.
    c.baselines.grpo.update(prompts_per_step=10, max_new_tokens=48, seq_len=128)
    c.baselines.rl_train.update(steps=c.opd_train.steps + c.anneal.steps, save_every=105)
  # Off-policy KD distils the same kind of text the cold start keeps: the
  # specialists' answers at the cold start's temperature, length and reward
  # filter (at the baselines' own 48 tokens and min_reward 1.0, every agent
  # and writing answer was truncated or rejected: 180 of 2,560 kept, none
  # for those two domains; docs/LOG.md).
  c.baselines.offpolicy.update(max_new_tokens=c.cold_start.max_new_tokens,
                               temperature=c.cold_start.temperature,
                               min_reward=c.cold_start.min_reward, seq_len=c.cold_start.seq_len)
  return c
