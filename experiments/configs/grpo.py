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

from experiments.configs import common as common_config
from experiments.configs import pretrain
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.rl.config import GRPOConfig
from opd.tasks import AgentRewardConfig
from opd.training.optim import OptimConfig


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
  c.grpo = to_group(GRPOConfig, clip_eps_high=0.28, kl_coef=0.1, max_new_tokens=80)
  c.lora = common_config.lora_group()  # rank > 0: LoRA adapters on the frozen init
  c.optim = to_group(OptimConfig, lr=2e-4, warmup_steps=2, end_lr_ratio=1.0, b2=0.99)
  c.train = ml_collections.ConfigDict(dict(steps=40, save_every=20, keep_checkpoints=1))
  c.data = ml_collections.ConfigDict(dict(domains=("math",), num_prompts=1000, difficulties=(1,)))
  c.agent_reward = to_group(AgentRewardConfig)
  if arg["tiny"]:
    c.grpo.update(group_size=4, prompts_per_step=2, max_new_tokens=16, seq_len=128)
    c.train.update(steps=2, save_every=2)
    c.data.update(num_prompts=16)
  return c
