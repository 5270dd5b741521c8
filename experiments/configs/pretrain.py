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
from opd.parallel import sharding


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  c = ml_collections.ConfigDict()
  c.job = "pretrain"
  c.seed = 0
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=270, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=None,
      d_ff=384, rope_theta=10_000.0, norm_eps=1e-6, qk_norm=True, qkv_bias=False,
      o_bias=False, tie_embeddings=True, scalar_head=False, dtype="float32",
      param_dtype="float32", remat=False))
  c.mesh = (-1, 1, 1)  # data parallel over every device
  c.sharding_rules = sharding.DEFAULT_RULES
  c.optim = ml_collections.ConfigDict(dict(
      lr=3e-3, warmup_steps=10, decay_steps=90, schedule="cosine", end_lr_ratio=0.1,
      weight_decay=0.01, b1=0.9, b2=0.95, eps=1e-8, clip_norm=1.0, grad_accum_steps=1))
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
