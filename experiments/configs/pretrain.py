"""Pre-training of the tiny byte-level base model on the toy task suite's text.

  python -m experiments.launch --config=experiments/configs/pretrain.py \
      --workdir=workdirs/pretrain
  python -m experiments.launch --config=experiments/configs/pretrain.py:tiny \
      --workdir=workdirs/pretrain_tiny

Reference machine (2 CPU cores): default ~3 min, tiny ~40 s (mostly compile).
Expected result (default): held-out loss falls from ln(270) ≈ 5.6 to ≈ 1.0
nats/byte; the prompts' templates are learned first, answers later.
"""
import ml_collections

from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.models.config import ModelConfig
from opd.parallel import sharding
from opd.training.optim import OptimConfig


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  c = ml_collections.ConfigDict()
  c.job = "pretrain"
  c.seed = 0
  # Groups that are dataclasses hold every field (to_group); the file sets
  # only what differs from the dataclass's defaults.
  c.model = to_group(ModelConfig, vocab_size=270, qk_norm=True, tie_embeddings=True)
  c.mesh = (-1, 1, 1)  # data parallel over every device
  c.sharding_rules = sharding.DEFAULT_RULES
  c.optim = to_group(OptimConfig, lr=3e-3, warmup_steps=10, decay_steps=90, schedule="cosine",
                     weight_decay=0.01)
  c.train = ml_collections.ConfigDict(dict(
      steps=100, batch_size=16, seq_len=256, log_every=10, eval_every=50, save_every=50,
      keep_checkpoints=2, fused_loss=False))
  c.data = ml_collections.ConfigDict(dict(
      num_docs=20_000, num_eval_docs=200, response_fraction=0.0, mode="pack"))
  if arg["tiny"]:
    c.model.update(d_model=32, n_layers=2, d_ff=64)
    c.optim.update(warmup_steps=2, decay_steps=8)
    c.train.update(steps=10, batch_size=8, seq_len=64, log_every=1, eval_every=5, save_every=5)
    c.data.update(num_docs=200, num_eval_docs=20)
  return c


def get_sweep(arg=None):
  del arg
  return [{"optim.lr": lr} for lr in (1e-3, 3e-3, 1e-2)]
