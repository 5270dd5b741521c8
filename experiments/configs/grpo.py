"""GRPO on task domains with rule verifiers (a specialist's second stage).

  python -m experiments.launch --config=experiments/configs/grpo.py \
      --workdir=workdirs/grpo_math --config.init=workdirs/sft_math/checkpoints \
      --config.data.domains="('math',)"

``config.init`` is a checkpoint directory of the same architecture (usually
the domain's SFT run); it is also the frozen KL reference. Reference machine
(2 CPU cores): default ~1-2 min per domain (code is slower: every sample runs
in the sandbox); tiny ~40 s. Expected result: the mean reward of the rollouts
rises over the run; ``reward.png`` plots it.
"""
import ml_collections

from experiments.configs import pretrain
from opd.config import overrides as config_utils


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  base = pretrain.get_config("tiny" if arg["tiny"] else None)
  c = ml_collections.ConfigDict()
  c.job = "grpo"
  c.seed = 0
  c.init = ml_collections.config_dict.placeholder(str)
  c.model = base.model
  c.mesh = base.mesh
  c.sharding_rules = base.sharding_rules
  c.grpo = ml_collections.ConfigDict(dict(
      group_size=8, prompts_per_step=8, clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1,
      scale_advantages_by_std=True, advantage_eps=1e-6, loss_aggregation="token_mean",
      temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=80, updates_per_batch=1,
      seq_len=256, length_bucket=32, max_error_fraction=0.1, num_text_samples=4))
  c.optim = ml_collections.ConfigDict(dict(
      lr=2e-4, warmup_steps=2, decay_steps=0, schedule="constant", end_lr_ratio=1.0,
      weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0, grad_accum_steps=1))
  c.train = ml_collections.ConfigDict(dict(steps=40, save_every=20, keep_checkpoints=1))
  c.data = ml_collections.ConfigDict(dict(domains=("math",), num_prompts=1000, difficulties=(1,)))
  c.agent_reward = ml_collections.ConfigDict(dict(
      format=0.30, execution=0.25, step=0.20, final_answer=0.25, grm=0.0, user=0.0))
  if arg["tiny"]:
    c.grpo.update(group_size=4, prompts_per_step=2, max_new_tokens=16, seq_len=128)
    c.train.update(steps=2, save_every=2)
    c.data.update(num_prompts=16)
  return c
