"""Teacher compatibility (the V4 issue's claim 4; docs/DESIGN.md §3, "Teacher compatibility").

  python -m experiments.launch --config=experiments/configs/compat.py --workdir=workdirs/compat
  # CI smoke test: every stage at a few steps
  python -m experiments.launch --config=experiments/configs/compat.py:tiny \
      --workdir=workdirs/compat_tiny

One domain (``domain=math`` by default; ``domain=NAME`` picks another) is
distilled into the same student from two teachers trained by the
specialists' recipe (experiments/configs/specialists.py: SFT, then GRPO,
with that domain's ``per_domain`` settings):

* teacher A from base A, the student's own base (pre-trained with
  ``base_seeds[0]``);
* teacher B from base B, pre-trained with ``base_seeds[1]``: another init and
  another sample and order of the pre-training text.

The SFT and GRPO stages of both teachers use ``config.seed``, so the bases
are the only difference. The student is a short SFT of base A on the domain
(``student_sft``, its own data seed ``seed + 1``), weak at the task, then
``opd`` steps of OPD in each arm with the same settings and seed.

The variant argument: ``tiny``, ``domain=NAME``, ``opd_steps=N`` (OPD steps;
only the two OPD stages and the evaluation change, so in an existing
workdir move ``opd_a/``, ``opd_b/`` and ``compat/`` aside and the bases,
teachers and student are reused).

The report (WORKDIR/compat/report.md, summary.json, compat.png): each
teacher's score (greedy reward@1 and mean@4 on the held-out test set, with
bootstrap SEs) and their difference; the initial top-8 overlap and reverse
KL (student at step 0 against each teacher); the OPD gain (student after −
before); the reverse KL by trajectory position (first 25% / middle 50% /
last 25% of each response), first logged point and mean of the last three.

Measured on the 2-core machine (2026-12-01, shared with one other job): the
default took 16.3 min wall, 12.4 min user + 3.0 min sys CPU (the bases and
teachers are most of it); an earlier run under load 11–15 took 34.5 min.
Tiny: 71 s CPU with a cold compilation cache, ~25 s warm. Result (seed 0,
math, 100 test examples; docs/RESULTS.md, "Teacher compatibility"): the
teachers are not of equal score (A 44.0 ± 5.0, B 60.0 ± 4.9 greedy
reward@1); the same-base teacher starts at a higher top-8 overlap (0.75 vs
0.58) and lower reverse KL (0.32 vs 0.41); neither arm raises the student's
greedy score in 40 steps (−3.0 ± 4.5, −2.0 ± 4.6); the per-position KL is
smallest in the first 25% and largest in the last 25% of these short answers
and falls most in the first 25% (−96% / −88%) and least in the last 25%
(−17% / −15%). On code and instruct the two teachers tie (20.2 vs 19.2;
42.7 vs 42.7); with ``opd_steps=160`` the same-base teacher's student ends
2.3 ± 1.0 (code) and 2.7 ± 1.4 (instruct) mean@4 points above the other's,
paired over test examples, the greedy difference within one SE
(docs/RESULTS.md, "Teacher compatibility").
"""
import ml_collections

from experiments.configs import specialists as specialists_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.distill.source import OPDConfig
from opd.eval.evaluation import EvalConfig
from opd.tasks import ALL_DOMAINS
from opd.training.optim import OptimConfig


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False, domain="math", opd_steps=0)
  if arg["domain"] not in ALL_DOMAINS:
    raise ValueError(f"config arg domain={arg['domain']!r}: expected one of {ALL_DOMAINS}")
  spec = specialists_config.get_config("tiny" if arg["tiny"] else None)
  d = arg["domain"]
  c = ml_collections.ConfigDict()
  c.job = "compat"
  c.seed = 0  # SFT, GRPO, OPD and evaluation: the same in both arms
  c.domain = d
  c.base_seeds = (0, 1)  # base A (the student's and teacher A's), base B (teacher B's)
  c.model = spec.model
  c.mesh = spec.mesh
  c.sharding_rules = spec.sharding_rules
  c.base = spec.base
  # The teachers: the specialists' SFT and GRPO with this domain's settings.
  per = spec.per_domain[d]
  c.sft = spec.sft
  c.sft.data.domains = (d,)
  if per.sft_steps:
    c.sft.train.update(steps=per.sft_steps, save_every=per.sft_steps)
    c.sft.optim.decay_steps = max(1, per.sft_steps - c.sft.optim.warmup_steps)
  c.grpo = spec.grpo
  c.grpo_optim = spec.grpo_optim
  if per.grpo_lr:
    c.grpo_optim.lr = per.grpo_lr
  c.grpo_train = spec.grpo_train
  if per.grpo_steps:
    c.grpo_train.update(steps=per.grpo_steps, save_every=per.grpo_steps)
  c.grpo_data = spec.grpo_data
  c.grpo_data.domains = (d,)
  c.agent_reward = spec.agent_reward
  # The student: a short SFT of base A (math: 40 steps ≈ a weak model; the
  # teachers get 160).
  c.student_sft = ml_collections.ConfigDict(dict(
      optim=to_group(OptimConfig, lr=1e-3, warmup_steps=5, decay_steps=35, schedule="cosine"),
      train=ml_collections.ConfigDict(spec.sft.train.to_dict()),
      data=ml_collections.ConfigDict(spec.sft.data.to_dict())))
  c.student_sft.train.update(steps=40, save_every=40, eval_every=40)
  # OPD: one teacher, the same in both arms but for its checkpoint.
  c.data = ml_collections.ConfigDict(dict(num_prompts=256, num_heldout=16, difficulties=(1,)))
  c.opd = to_group(OPDConfig, rollout=dict(prompts_per_step=8, group_size=4, max_new_tokens=48,
                                            seq_len=192),
                   weighting=dict(anneal_steps=0), diag_every=4, diag_tokens=512)
  c.opd_optim = to_group(OptimConfig, lr=3e-4, warmup_steps=3, decay_steps=37, end_lr_ratio=0.3,
                         schedule="cosine")
  c.opd_train = ml_collections.ConfigDict(dict(steps=40, save_every=40, keep_checkpoints=1,
                                               eval_every=10))
  c.eval = to_group(EvalConfig, omit=("domains",), n_per_domain=100, max_new_tokens=48,
                    num_samples=4)
  c.report_metric = "reward@1"
  if arg["tiny"]:
    c.student_sft.optim.update(warmup_steps=1, decay_steps=2)
    c.student_sft.train.update(steps=3, save_every=3, eval_every=3)
    c.data.update(num_prompts=8, num_heldout=2)
    c.opd.rollout.update(prompts_per_step=2, group_size=2, max_new_tokens=12, seq_len=128,
                         length_bucket=0)
    c.opd.update(diag_every=1, diag_tokens=64)
    c.opd_optim.update(warmup_steps=1, decay_steps=1)
    c.opd_train.update(steps=2, save_every=2, eval_every=2)
    c.eval.update(n_per_domain=4, num_samples=2, max_new_tokens=12, batch_size=8,
                  bootstrap_samples=50)
  if arg["opd_steps"] < 0:
    raise ValueError(f"config arg opd_steps={arg['opd_steps']}: expected >= 0 (0: the default)")
  if arg["opd_steps"]:
    n = arg["opd_steps"]
    c.opd_train.update(steps=n, save_every=n, eval_every=max(1, n // 4))
    c.opd_optim.decay_steps = max(1, n - c.opd_optim.warmup_steps)
  return c
