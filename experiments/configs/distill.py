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

The variant argument: ``job=opd|cold_start``, ``tiny``, ``steps=N`` (OPD steps).
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
"""
import ml_collections

from experiments.configs import pretrain as pretrain_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.distill.source import OPDConfig
from opd.models.config import ModelConfig
from opd.training.optim import OptimConfig

DOMAINS = ("math", "instruct")


def _teacher(model, init, domain):
  return ml_collections.ConfigDict(dict(init=init, domain=domain, model=model))


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False, job="opd", steps=0)
  if arg["job"] not in ("opd", "cold_start"):
    raise ValueError(f"config arg job={arg['job']!r}: expected 'opd' or 'cold_start'")
  base = pretrain_config.get_config("tiny" if arg["tiny"] else None)
  c = ml_collections.ConfigDict()
  c.job = arg["job"]
  c.seed = 0
  c.mesh = base.mesh
  c.sharding_rules = base.sharding_rules
  c.student = ml_collections.ConfigDict(dict(init="workdirs/specialists/base/checkpoints",
                                             model=base.model))
  c.teachers = ml_collections.ConfigDict(
      {d: _teacher(ml_collections.ConfigDict(base.model.to_dict()),
                   f"workdirs/specialists/{d}/grpo/checkpoints", d) for d in DOMAINS})
  c.opd = to_group(OPDConfig, prompts_per_step=8, group_size=4, max_new_tokens=48, seq_len=192,
                   diag_every=10, anneal_steps=10)
  c.optim = to_group(OptimConfig, lr=3e-4, warmup_steps=5, decay_steps=95, schedule="cosine")
  c.train = ml_collections.ConfigDict(dict(steps=100, save_every=50, keep_checkpoints=2,
                                           eval_every=10))
  c.data = ml_collections.ConfigDict(dict(num_prompts=512, num_heldout=16, difficulties=(1,)))
  c.cold_start = ml_collections.ConfigDict(dict(
      num_prompts=256, samples_per_prompt=2, max_new_tokens=48, temperature=1.0, min_reward=1.0,
      sample_batch_size=32, steps=100, batch_size=16, seq_len=192))
  c.build_teachers = ml_collections.ConfigDict(dict(
      sft_steps=0, num_train=64, batch_size=8,
      optim=to_group(OptimConfig, lr=3e-3, warmup_steps=2, decay_steps=18, schedule="cosine")))
  if arg["tiny"]:
    # Teachers of another width and depth than the student, built here.
    wide = to_group(ModelConfig, vocab_size=270, qk_norm=True, tie_embeddings=True, d_model=48,
                    n_layers=1, d_ff=96)
    c.student.init = ""  # a random init
    c.teachers = ml_collections.ConfigDict({d: _teacher(wide, "", d) for d in DOMAINS})
    c.build_teachers.sft_steps = 20
    c.opd.update(prompts_per_step=2, group_size=2, max_new_tokens=12, seq_len=160,
                 diag_every=4, anneal_steps=2, diag_tokens=64, verify=True)
    c.optim.update(lr=3e-3, warmup_steps=1, decay_steps=7)
    c.train.update(steps=8, save_every=4, eval_every=4)
    c.data.update(num_prompts=16, num_heldout=4)
    # Tiny teachers are rarely right: keep every verified answer to exercise the path.
    c.cold_start.update(num_prompts=16, samples_per_prompt=1, max_new_tokens=12, min_reward=0.0,
                        sample_batch_size=16, steps=3, batch_size=4, seq_len=160)
  if arg["steps"]:
    c.train.update(steps=arg["steps"], save_every=arg["steps"],
                   eval_every=max(1, arg["steps"] // 10))
    c.optim.update(decay_steps=max(1, arg["steps"] - c.optim.warmup_steps))
    c.opd.anneal_steps = min(c.opd.anneal_steps, arg["steps"])
  return c
