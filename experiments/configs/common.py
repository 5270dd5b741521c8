"""Config groups that several experiment configs share (not a config itself: no ``get_config``).

``opd_groups(tiny)`` is the distillation job's ``data``, ``opd`` and
``cold_start`` (experiments/configs/distill.py); ``demo_student_stages(tiny)``
is what ``make demo``'s student runs on top of them (experiments/configs/v4.py:
data, cold start, OPD, annealing), which the full-size distillation ablations
also run. Each call returns fresh ConfigDicts, so a caller's changes never
reach another's.
"""
import ml_collections

from opd.config.fields import to_group
from opd.distill.source import OPDConfig
from opd.training.optim import OptimConfig


def opd_groups(tiny: bool) -> ml_collections.ConfigDict:
  """The distillation job's ``data``, ``opd`` and ``cold_start`` groups."""
  g = ml_collections.ConfigDict()
  g.opd = to_group(OPDConfig, rollout=dict(prompts_per_step=8, group_size=4, max_new_tokens=48,
                                            seq_len=192),
                   weighting=dict(anneal_steps=10), diag_every=10)
  g.data = ml_collections.ConfigDict(dict(num_prompts=512, num_heldout=16, difficulties=(1,)))
  g.cold_start = ml_collections.ConfigDict(dict(
      num_prompts=256, samples_per_prompt=2, max_new_tokens=48, temperature=1.0, min_reward=1.0,
      sample_batch_size=32, steps=100, batch_size=16, seq_len=192))
  if tiny:
    g.opd.rollout.update(prompts_per_step=2, group_size=2, max_new_tokens=12, seq_len=160)
    g.opd.weighting.anneal_steps = 2
    g.opd.update(diag_every=4, diag_tokens=64, verify=True)
    g.data.update(num_prompts=16, num_heldout=4)
    # Tiny teachers are rarely right: keep every verified answer to exercise the path.
    g.cold_start.update(num_prompts=16, samples_per_prompt=1, max_new_tokens=12, min_reward=0.0,
                        sample_batch_size=16, steps=3, batch_size=4, seq_len=160)
  return g


def demo_student_stages(tiny: bool) -> ml_collections.ConfigDict:
  """The demo student's ``data``, ``cold_start`` (+ ``_optim``), ``opd``, ``opd_optim``,
  ``opd_train``, ``anneal`` and ``anneal_optim`` groups, in that order."""
  base = opd_groups(tiny)
  s = ml_collections.ConfigDict()
  # Student prompts: per domain, from the train split (the eval uses test).
  s.data = base.data
  s.data.update(num_prompts=256, num_heldout=8)
  s.cold_start = base.cold_start
  # Verified answers only: reward >= 0.7 (math/code/instruct rewards are
  # mostly 0/1; agent and writing are graded) and finished, sampled at T=0.5
  # where the specialists are more often right than at T=1 (at T=1, min 1.0:
  # 37 of 640 answers kept, none for writing; docs/LOG.md).
  s.cold_start.update(num_prompts=96, samples_per_prompt=2, max_new_tokens=80, temperature=0.5,
                      min_reward=0.7, steps=150, batch_size=16, seq_len=256,
                      sample_batch_size=64)
  s.cold_start_optim = to_group(OptimConfig, lr=1e-3, warmup_steps=10, decay_steps=140,
                                schedule="cosine")
  s.opd = base.opd
  s.opd.rollout.update(prompts_per_step=8, group_size=4, max_new_tokens=80, seq_len=256)
  s.opd.weighting.update(schedule="routing", anneal_steps=0)
  s.opd.diag_every = 10
  s.opd_optim = to_group(OptimConfig, lr=3e-4, warmup_steps=5, decay_steps=75, end_lr_ratio=0.3,
                         schedule="cosine")
  s.opd_train = ml_collections.ConfigDict(dict(steps=80, save_every=40, keep_checkpoints=2,
                                               eval_every=20))
  # Annealing: teacher weights from routing to uniform over these steps,
  # the learning rate from OPD's last value to 0.
  s.anneal = ml_collections.ConfigDict(dict(steps=20))
  s.anneal_optim = to_group(OptimConfig, lr=9e-5, warmup_steps=0, decay_steps=20,
                            schedule="cosine")
  if tiny:
    s.data.update(num_prompts=8, num_heldout=2)
    # Tiny specialists are rarely right: keep every finished answer.
    s.cold_start.update(num_prompts=4, max_new_tokens=12, steps=2, batch_size=4, seq_len=160,
                        sample_batch_size=16, min_reward=0.0, temperature=1.0)
    s.cold_start_optim.update(warmup_steps=1, decay_steps=1)
    s.opd.rollout.update(prompts_per_step=5, group_size=2, max_new_tokens=12, seq_len=160,
                         length_bucket=0)
    s.opd.diag_every = 2
    # Its schedule fits its 2 steps (the job-start check refuses warmup 5 of 2).
    s.opd_optim.update(warmup_steps=1, decay_steps=1)
    s.opd_train.update(steps=2, save_every=2, eval_every=2)
    s.anneal.steps = 2
    s.anneal_optim.update(decay_steps=2)
  return s


def lora_group(rank: int = 0) -> ml_collections.ConfigDict:
  """A job's ``lora`` group: ``rank`` 0 is a full fine-tune; > 0 trains LoRA
  adapters of that rank on the frozen starting weights, the base stored in
  ``base_dtype`` (docs/DESIGN.md, LoRA; ``experiments.common.lora_student``)."""
  from opd.models.lora import LoRAConfig  # noqa: PLC0415
  d = LoRAConfig()
  return ml_collections.ConfigDict(dict(rank=rank, alpha=d.alpha, targets=d.targets,
                                        base_dtype="bfloat16"))
