"""Multi-teacher on-policy distillation: cold start and OPD (docs/DESIGN.md §3).

  # after the specialists pipeline (experiments/configs/specialists.py):
  python -m experiments.launch --config=experiments/configs/distill.py:job=cold_start \
      --workdir=workdirs/distill_cold_start   # use a separate workdir per job
  python -m experiments.launch --config=experiments/configs/distill.py \
      --workdir=workdirs/distill --config.student.init=workdirs/distill_cold_start/checkpoints
  # CI smoke test / quick look: builds two tiny specialists (math, instruct) itself
  python -m experiments.launch --config=experiments/configs/distill.py:tiny \
      --workdir=workdirs/distill_tiny
  python -m experiments.launch --config=experiments/configs/distill.py:tiny,steps=100 \
      --workdir=workdirs/distill_tiny100
  # the same with a mixture-of-experts math teacher beside the dense instruct one
  # (measured, 8 OPD steps: reverse KL math 0.22 -> 0.15, instruct 0.41 -> 0.36, 0 skips)
  python -m experiments.launch --config=experiments/configs/distill.py:tiny,moe \
      --workdir=workdirs/distill_tiny_moe
  python -m experiments.launch --config=experiments/configs/distill.py:tiny,v4 \
      --workdir=workdirs/distill_tiny_v4     # DeepSeek-V4 student and math teacher
  # the advantage form (docs/DESIGN.md §3, "Loss form") plus 0.5 x GRPO's outcome
  # advantage; every OPDConfig field is in config.opd (the loss's in config.opd.loss:
  # form, adv_gamma, adv_beta, adv_alpha, is_cap; defaults: the exact form)
  python -m experiments.launch --config=experiments/configs/distill.py:tiny \
      --config.opd.loss.form=advantage --config.opd.loss.adv_alpha=0.5 \
      --workdir=workdirs/distill_tiny_advantage

The variant argument: ``job=opd|cold_start``, ``tiny``, ``steps=N`` (OPD steps),
``ablation=estimator|cold_start|weighting`` (below), ``demo=DIR``,
``teachers_dir=DIR``, ``moe`` (with ``tiny``: the math teacher is a
DeepSeek-style mixture of experts, ``MOE_TEACHER``; docs/DESIGN.md §2).
Teachers are ``config.teachers.<name>`` (``init``, ``domain``, ``model``); the
student is ``config.student`` (``init``, ``model``); only the student is
trained and checkpointed.

Reference machine (2 CPU cores): tiny ≈ 1 min (two 20-step teacher SFTs,
8 OPD steps, mostly compiles); tiny,steps=100 ≈ 2 min (82 s of OPD).
Expected result: the held-out reverse KL to each teacher
(``final_metrics.json``: ``rkl_initial/<t>`` → ``rkl_final/<t>``) falls, the
top-8 overlap (``overlap@8_last/<t>``) rises, no skips; the cache holds
``D_k × 2`` bytes per token against ``V × 4`` for logits. Measured, tiny,steps=100:
reverse KL instruct 0.41 → 0.053, math 0.11 → 0.056; top-8 overlap
instruct 0.47 → 0.79, math 0.17 → 0.51 (noisy, 64 sampled tokens); 0 skips;
96 bytes per token (D=48, bf16) against 1080 for V=270 float32 logits.
Curves: ``rkl.png``, ``overlap.png``, ``skips.png`` in the workdir. The
default needs the specialists pipeline's checkpoints (not measured here).

Ablations (docs/DESIGN.md §3, "Baselines and curve metrics"), each a sweep
whose first arm is the reference, three seeds per arm, the same steps,
``opd.verify`` on (``reward/mean`` per step), no annealing
(``opd.weighting.anneal_steps=0``):

  # estimator: full / top-k (k=10, 32) / token-level, 12 runs
  python -m experiments.sweep --config=experiments/configs/distill.py:ablation=estimator \
      --workdir=workdirs/ablation/estimator
  python -m experiments.ablation_report --sweep_dir=workdirs/ablation/estimator
  # cold start on vs off (student init: the cold-start checkpoint vs the base)
  python -m experiments.sweep --config=experiments/configs/distill.py:ablation=cold_start \
      --workdir=workdirs/ablation/cold_start
  # teacher weighting: routing / confidence / uniform
  python -m experiments.sweep --config=experiments/configs/distill.py:ablation=weighting \
      --workdir=workdirs/ablation/weighting
  # CI / notebook form: tiny teachers, 16 steps (teachers_dir=DIR reuses
  # teachers built once, DIR/<name>/checkpoints; without it each run builds its own)
  python -m experiments.sweep \
      --config=experiments/configs/distill.py:tiny,ablation=estimator --workdir=/tmp/abl

The full-size ablations use a finished ``make demo`` workdir (``demo=DIR``,
default workdirs/demo): teachers ``DIR/<domain>/grpo/checkpoints``, student
``DIR/student/seed0/cold_start/checkpoints`` (the base ``DIR/base/checkpoints``
for "cold start off"), and the demo's OPD stage settings (experiments/configs/v4.py:
80 steps of 8 prompts × 4 samples × ≤ 80 tokens; ``steps=N`` shortens).
``config.run_label`` names a run's arm for the report and changes nothing else.
Measured (2 shared cores, load ~10): tiny estimator sweep in one process
(``experiments.ablation_report.run_tiny_ablation``) ≈ 2.5 min for its 12 runs
(the notebook runs the first 8, two seeds; 200 CPU-s for all 12 with a cold
compilation cache); full size at the demo's 80 steps, 4–12 min per run
through experiments.sweep on the shared machine (~4 min alone).
"""
import copy

import ml_collections

from experiments.configs import common as common_config
from experiments.configs import pretrain as pretrain_config
from experiments.configs import specialists as specialists_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.models.config import ModelConfig
from opd.training.optim import OptimConfig

DOMAINS = ("math", "instruct")
ABLATIONS = ("estimator", "cold_start", "weighting")
# (label, estimator, top_k); the first is the reference arm of the report.
ESTIMATOR_ARMS = (("full", "full", None), ("top-10", "top_k", 10), ("top-32", "top_k", 32),
                  ("token", "token", None))
WEIGHTING_ARMS = ("routing", "confidence", "uniform")
SEEDS = (0, 1, 2)
TINY_ABLATION_STEPS = 16  # the smallest that leaves loss_fluctuation a few steps to measure
# ``tiny,moe``'s math teacher: 4 routed experts (top-2, sigmoid scores with the
# auxiliary-loss-free bias update, 2 groups) plus a shared one, after a dense first layer.
MOE_TEACHER = dict(n_routed_experts=4, experts_per_token=2, moe_d_ff=48, n_shared_experts=1,
                   router="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=1.0,
                   first_k_dense=1, seq_aux_loss_coef=1e-3, bias_update_rate=1e-3)


def _teacher(model, init, domain):
  """A teacher's group with its own copy of ``model``: an override of one
  teacher's model must never change another's (a shared ConfigDict would)."""
  return ml_collections.ConfigDict(dict(init=init, domain=domain, model=copy.deepcopy(model)))


def _parse(arg):
  arg = config_utils.parse_arg(arg, tiny=False, job="opd", steps=0, ablation="",
                               demo="workdirs/demo", teachers_dir="", moe=False, v4=False)
  if arg["v4"] and not arg["tiny"]:
    raise ValueError("config arg v4 needs tiny (a toy DeepSeek-V4 student and math teacher)")
  if arg["moe"] and not arg["tiny"]:
    raise ValueError("config arg moe needs tiny (the full-size teachers' architecture is their "
                     "checkpoints')")
  if arg["job"] not in ("opd", "cold_start"):
    raise ValueError(f"config arg job={arg['job']!r}: expected 'opd' or 'cold_start'")
  if arg["ablation"] and arg["ablation"] not in ABLATIONS:
    raise ValueError(f"config arg ablation={arg['ablation']!r}: expected one of {ABLATIONS}")
  if arg["ablation"] and arg["job"] != "opd":
    raise ValueError(f"config arg ablation={arg['ablation']!r} needs job=opd, got "
                     f"job={arg['job']!r}")
  if arg["ablation"] == "cold_start" and arg["tiny"]:
    raise ValueError("config arg ablation='cold_start' has no tiny form: it needs the demo's "
                     "cold-start checkpoint (demo=DIR)")
  return arg


def _ablation(c, arg):
  """The OPD run every arm of ``arg["ablation"]`` starts from (reference arm's settings)."""
  c.run_label = ""
  if arg["tiny"]:
    # One padded length and no diagnostics: one compile of each program per run.
    c.opd.rollout.length_bucket = 0
    c.opd.diag_every = 0
    steps = TINY_ABLATION_STEPS
    c.train.update(steps=steps, save_every=steps)
    c.optim.update(decay_steps=steps - c.optim.warmup_steps)
    if arg["teachers_dir"]:
      for name, group in c.teachers.items():
        group.init = f"{arg['teachers_dir']}/{name}/checkpoints"
  else:
    # The demo's OPD stage (experiments/configs/v4.py runs the same groups).
    spec, demo = specialists_config.get_config(), arg["demo"]
    stages = common_config.demo_student_stages(tiny=False)
    model = spec.model
    c.mesh, c.sharding_rules = spec.mesh, spec.sharding_rules
    c.student = ml_collections.ConfigDict(dict(
        init=f"{demo}/student/seed0/cold_start/checkpoints",
        model=ml_collections.ConfigDict(model.to_dict())))
    c.teachers = ml_collections.ConfigDict(
        {d: _teacher(ml_collections.ConfigDict(model.to_dict()), f"{demo}/{d}/grpo/checkpoints", d)
         for d in spec.domains})
    c.data, c.opd = stages.data, stages.opd
    c.optim, c.train = stages.opd_optim, stages.opd_train
  c.opd.verify = True
  c.opd.weighting.anneal_steps = 0


def get_sweep(arg=None):
  """The runs of ``ablation=...``: every arm × ``SEEDS``, seed by seed (a sweep
  stopped early still has every arm), the reference arm first."""
  arg = _parse(arg)
  if not arg["ablation"]:
    raise ValueError("get_sweep needs config arg ablation=estimator|cold_start|weighting")
  if arg["ablation"] == "estimator":
    arms = [dict(run_label=label, **{"opd.loss.estimator": est},
                 **({"opd.loss.top_k": k} if k is not None else {}))
            for label, est, k in ESTIMATOR_ARMS]
  elif arg["ablation"] == "weighting":
    arms = [{"run_label": s, "opd.weighting.schedule": s} for s in WEIGHTING_ARMS]
  else:
    demo = arg["demo"]
    arms = [{"run_label": "cold start",
             "student.init": f"{demo}/student/seed0/cold_start/checkpoints"},
            {"run_label": "no cold start", "student.init": f"{demo}/base/checkpoints"}]
  return [{**arm, "seed": seed} for seed in SEEDS for arm in arms]


def v4_model(width: int) -> dict:
  """A toy DeepSeek-V4 model (``tiny,v4``): byte vocabulary, 3 layers (sliding
  window + hash-routed MoE, CSA + MoE, HCA + MoE), window 16, one kv head."""
  return dict(
      vocab_size=270, d_model=width, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=16,
      moe=dict(n_routed_experts=8, experts_per_token=2, moe_d_ff=16, n_shared_experts=1,
               router="sqrtsoftplus", routed_scaling_factor=1.5, aux_loss_coef=0.01),
      v4=dict(layer_types=("sliding_attention", "compressed_sparse_attention",
                           "heavily_compressed_attention"),
              mlp_layer_types=("hash_moe", "moe", "moe"), q_lora_rank=24, rope_dim=8,
              sliding_window=16, o_groups=2, o_lora_rank=12, csa_compress_rate=4,
              hca_compress_rate=8, index_n_heads=4, index_head_dim=12, index_topk=4,
              swiglu_limit=5.0))


def get_config(arg=None):
  arg = _parse(arg)
  base = pretrain_config.get_config("tiny" if arg["tiny"] else None)
  c = ml_collections.ConfigDict()
  c.job = arg["job"]
  c.seed = 0
  c.mesh = base.mesh
  c.sharding_rules = base.sharding_rules
  c.student = ml_collections.ConfigDict(dict(init="workdirs/specialists/base/checkpoints",
                                             model=base.model,
                                             lora=common_config.lora_group()))
  c.teachers = ml_collections.ConfigDict(
      {d: _teacher(ml_collections.ConfigDict(base.model.to_dict()),
                   f"workdirs/specialists/{d}/grpo/checkpoints", d) for d in DOMAINS})
  groups = common_config.opd_groups(arg["tiny"])
  c.opd = groups.opd
  c.optim = to_group(OptimConfig, lr=3e-4, warmup_steps=5, decay_steps=95, schedule="cosine")
  c.train = ml_collections.ConfigDict(dict(steps=100, save_every=50, keep_checkpoints=2,
                                           eval_every=10))
  c.data, c.cold_start = groups.data, groups.cold_start
  c.build_teachers = ml_collections.ConfigDict(dict(
      sft_steps=0, num_train=64, batch_size=8,
      optim=to_group(OptimConfig, lr=3e-3, warmup_steps=2, decay_steps=18, schedule="cosine")))
  if arg["tiny"]:
    # Teachers of another width and depth than the student, built here.
    wide = to_group(ModelConfig, vocab_size=270, qk_norm=True, tie_embeddings=True, d_model=48,
                    n_layers=1, d_ff=96)
    c.student.init = ""  # a random init
    c.teachers = ml_collections.ConfigDict({d: _teacher(wide, "", d) for d in DOMAINS})
    if arg["moe"]:
      c.teachers.math.model.n_layers = 2
      c.teachers.math.model.moe = ml_collections.ConfigDict(MOE_TEACHER)
    if arg["v4"]:  # the DeepSeek-V4 architecture as student and math teacher
      c.student.model = to_group(ModelConfig, **v4_model(32))
      c.teachers.math.model = to_group(ModelConfig, **v4_model(48))
    c.build_teachers.sft_steps = 20
    c.optim.update(lr=3e-3, warmup_steps=1, decay_steps=7)
    c.train.update(steps=8, save_every=4, eval_every=4)
  if arg["ablation"]:
    _ablation(c, arg)
  if arg["steps"]:
    c.train.update(steps=arg["steps"], save_every=arg["steps"],
                   eval_every=max(1, arg["steps"] // 10))
    c.optim.update(decay_steps=max(1, arg["steps"] - c.optim.warmup_steps))
    c.opd.weighting.anneal_steps = min(c.opd.weighting.anneal_steps, arg["steps"])
  if arg["ablation"]:
    c.train.eval_every = c.train.steps  # held-out reverse KL before and after, not between
  return c
