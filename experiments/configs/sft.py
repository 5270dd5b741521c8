"""SFT of a pre-trained model on task domains (one specialist's first stage).

  python -m experiments.launch --config=experiments/configs/sft.py \
      --workdir=workdirs/sft_math --config.init=workdirs/pretrain/checkpoints \
      --config.data.domains="('math',)"

``config.init`` is a checkpoint directory written by the ``pretrain`` job (the
model fields must match it). Reference machine (2 CPU cores): default ~1 min
per domain; tiny ~30 s. Expected result (math, default): held-out response
loss below 0.3 nats/byte; the specialists pipeline
(``experiments/configs/specialists.py``) reports task scores.
"""
import ml_collections

from experiments.configs import common as common_config
from experiments.configs import pretrain
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.training.optim import OptimConfig


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  base = pretrain.get_config("tiny" if arg["tiny"] else None)
  c = ml_collections.ConfigDict()
  c.job = "sft"
  c.seed = 0
  c.init = ml_collections.config_dict.placeholder(str)
  c.model = base.model
  c.mesh = base.mesh
  c.sharding_rules = base.sharding_rules
  c.lora = common_config.lora_group()  # rank > 0: LoRA adapters on the frozen init
  c.optim = to_group(OptimConfig, lr=1e-3, warmup_steps=10, decay_steps=70, schedule="cosine")
  c.train = ml_collections.ConfigDict(dict(
      steps=80, batch_size=16, seq_len=256, eval_every=40, save_every=80, keep_checkpoints=1))
  c.data = ml_collections.ConfigDict(dict(
      domains=("math",), num_train=4000, num_eval=48, difficulties=(1,), mode="pack"))
  if arg["tiny"]:
    c.optim.update(warmup_steps=1, decay_steps=4)
    c.train.update(steps=5, batch_size=8, seq_len=160, eval_every=5, save_every=5)
    c.data.update(num_train=32, num_eval=8)
  return c
