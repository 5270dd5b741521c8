"""Job ``grm_reward``: a writing specialist's GRPO under three rewards (docs/DESIGN.md §6).

The same policy is trained three times on writing prompts, rewarded by the
GRM (``grm.reward.GRMReward``: k pointwise judgements voted, 1..10 -> [0, 1]),
by the Bradley–Terry RM (``grm.reward.BTReward``) and by the hidden rubric
itself (the writing verifier). Each trained policy is then scored on the
test split with the hidden rubric: a learned reward that the policy games
shows as a rise in its own reward without a rise in the rubric score.

  python -m experiments.launch --config=experiments/configs/grm_reward.py \
      --workdir=workdirs/grm_reward --config.init=workdirs/demo/writing/sft/checkpoints \
      --config.grm_init=workdirs/grm/<GRM stage>/checkpoints \
      --config.bt_init=workdirs/grm/<BT stage>/checkpoints
  python -m experiments.launch --config=experiments/configs/grm_reward.py:tiny \
      --workdir=workdirs/grm_reward_tiny      # CI smoke test: tiny random models
  # the strong world (bpe:1024): its writing SFT, the GRM and BT RM of grm.py:strong
  python -m experiments.launch --config=experiments/configs/grm_reward.py:strong \
      --workdir=workdirs/grm_reward_strong

``grm_init`` / ``bt_init`` are checkpoints of the ``grm`` job (same
architecture as ``model``; the BT RM with its scalar head). The tiny variant
ignores ``init``/``grm_init``/``bt_init`` and builds random tiny models.
Reference machine (2 CPU cores): tiny about 2-3 min (compiles). Default: 41
min on the machine shared with one other job (the GRM-rewarded run 34 min).
Result (docs/RESULTS.md, "The GRM as a GRPO reward"; rubric, sampled mean@4,
change from the start paired over 64 test prompts): rubric-trained +7.3 ± 1.5,
BT-trained +1.3 ± 1.3 while its own BT score rises +5.0 ± 0.7 (gamed),
GRM-trained +2.6 ± 1.3 (the GRM scores almost every answer 1/10: no signal).
"""
import ml_collections

from experiments.configs import pretrain
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.rl.config import GRPOConfig
from opd.training.optim import OptimConfig


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False, strong=False)
  base = pretrain.get_config("tiny" if arg["tiny"] else None)
  c = ml_collections.ConfigDict()
  c.job = "grm_reward"
  c.seed = 0
  c.tiny_models = False  # True: random policy, GRM and BT RM (smoke test)
  c.init = ml_collections.config_dict.placeholder(str)
  c.grm_init = ml_collections.config_dict.placeholder(str)
  c.bt_init = ml_collections.config_dict.placeholder(str)
  c.model = base.model
  c.mesh = base.mesh
  c.sharding_rules = base.sharding_rules
  c.rewards = ("grm", "bt", "rubric")
  # The GRM judges each episode alone (n = 1): k samples of <= 200 tokens, voted.
  # T = 0.7 as in the grm job's RFT, rule RL and benchmark: at T = 1 its cold
  # start wrote 8 of 32 valid judgements (experiments/configs/grm.py).
  # constrained: the GRM's scores line decoded under its grammar (off: as before).
  c.grm = ml_collections.ConfigDict(dict(k=4, max_new_tokens=320, temperature=0.7,
                                         fallback=0.0, batch_size=32, constrained=False))
  c.bt = ml_collections.ConfigDict(dict(seq_len=256, batch_size=32))
  # The writing specialist's GRPO (experiments/configs/grpo.py, 8 prompts x 8 = 64
  # rollouts a step, 40 steps: +4.1 mean@4 on the rubric in `make demo`); a
  # smaller run (24 rollouts x 30 steps) moved no policy's rubric score beyond
  # noise, the rubric-trained one included (docs/LOG.md). The GRM-rewarded run
  # samples 64 x k = 256 judgements a step.
  c.grpo = to_group(GRPOConfig, clip_eps_high=0.28, kl_coef=0.1, max_new_tokens=80,
                    group_size=8, prompts_per_step=8)
  c.optim = to_group(OptimConfig, lr=2e-4, warmup_steps=2, end_lr_ratio=1.0, b2=0.99)
  c.train = ml_collections.ConfigDict(dict(steps=40, save_every=10))
  # Test scoring: greedy (rubric, GRM, BT) and num_samples sampled answers per
  # prompt at the GRPO temperature (rubric mean@n).
  c.eval = ml_collections.ConfigDict(dict(num_samples=4))
  # Difficulty 1: the writing specialist's and the GRM's training distribution.
  c.data = ml_collections.ConfigDict(dict(num_prompts=256, num_test=64, difficulties=(1,)))
  if arg["strong"]:
    _strong(c)
  if arg["tiny"]:
    c.tiny_models = True
    c.grm.update(k=2, max_new_tokens=8, batch_size=4)  # 8 samples a step: two chunks
    c.bt.update(seq_len=512, batch_size=8)
    c.grpo.update(group_size=2, prompts_per_step=2, max_new_tokens=8, seq_len=512)
    c.train.update(steps=1, save_every=1)
    c.eval.update(num_samples=2)
    c.data.update(num_prompts=4, num_test=2, difficulties=(1,))
  return c


def _strong(c) -> None:
  """The strong toy world's models (experiments/configs/specialists.py:strong,
  BPE ``bpe:1024``): its writing SFT as the policy, the rule-RL GRM and the
  BT RM of ``grm.py:strong`` (workdirs/grm_strong, stages ``rule_rl`` and
  ``bt_rm``) as the learned rewards; the lengths the strong world's GRPO and
  GRM benchmark use (48 answer tokens, judgements of <= 192, BT rows of 128)."""
  c.model.update(tokenizer="bpe:1024", vocab_size=1024)  # as specialists.strengthen
  c.init = "workdirs/strong/writing/sft/checkpoints"
  c.grm_init = "workdirs/grm_strong/rule_rl/checkpoints"
  c.bt_init = "workdirs/grm_strong/bt_rm/checkpoints"
  c.grm.update(max_new_tokens=192)
  c.bt.update(seq_len=128)
  c.grpo.update(max_new_tokens=48, seq_len=128)
