"""Job ``grm``: preference data → GRM cold start → RFT → rule RL, baselines, benchmark.

See docs/DESIGN.md §6 and ``experiments/grm.py``.

  python -m experiments.launch --config=experiments/configs/grm.py \
      --workdir=workdirs/grm                  # on the models of `make demo` (workdirs/demo)
  python -m experiments.launch --config=experiments/configs/grm.py:tiny \
      --workdir=workdirs/grm_tiny             # CI smoke test: tiny random models

``models`` maps a name to a checkpoint directory (read only); override them
with ``--config.models.base=...``. The tiny variant ignores them and builds
two random tiny models itself (``tiny_models``), and adds each single-turn
example's reference answer as a candidate so groups with a unique best
exist. Reference machine (2 CPU cores, shared with other jobs): tiny
4 min 10 s (mostly compiles; too slow for ``make bench``, so it has no
entry there). Default: not measured; its data stage alone took 8 min at
12 train / 10 test examples per domain (the sampler then runs max(ks)
judgements of ~1k-token prompts per test group and GRM stage). At that
size 49 of 110 examples kept a group (61 had no unique best: the demo's
models often fail alike), 22 in the test split.
Expected result: see docs/RESULTS.md (GRM section) once the default run is
recorded there; the paper's RewardBench figures (85.6 at k=1, 89.6 with
meta-RM voting at k=32) are plotted beside ours.
"""
import ml_collections

from experiments.configs import grpo as grpo_config
from experiments.configs import pretrain as pretrain_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.training.optim import OptimConfig

DEMO = "workdirs/demo"  # what `make demo` writes
# name -> checkpoint dir of the demo's models (base, per-domain SFT and GRPO specialists).
DEMO_MODELS = {"base": f"{DEMO}/base/checkpoints",
               **{f"sft_{d}": f"{DEMO}/{d}/sft/checkpoints" for d in ("math", "instruct")},
               **{f"rl_{d}": f"{DEMO}/{d}/grpo/checkpoints"
                  for d in ("math", "code", "instruct", "writing", "agent")}}


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  variant = "tiny" if arg["tiny"] else None
  pre = pretrain_config.get_config(variant)
  grpo = grpo_config.get_config(variant)
  c = ml_collections.ConfigDict()
  c.job = "grm"
  c.seed = 0
  c.model = pre.model
  c.mesh = pre.mesh
  c.sharding_rules = pre.sharding_rules
  c.tiny_models = 0  # > 0: build this many random models instead of loading c.models
  c.models = ml_collections.ConfigDict(DEMO_MODELS)
  c.data = ml_collections.ConfigDict(dict(
      domains=("math", "code", "instruct", "writing", "agent"), num_train=96, num_test=48,
      difficulties=(1, 2, 3), temperatures=(0.7, 1.0), max_new_tokens=80, sizes=(1, 2, 3, 4),
      include_reference=False, noise=0.2))
  c.sft = ml_collections.ConfigDict(dict(steps=200, batch_size=8, seq_len=2048))
  c.sft_optim = to_group(OptimConfig, lr=3e-4, warmup_steps=10, decay_steps=200,
                         end_lr_ratio=0.1)
  c.rft = ml_collections.ConfigDict(dict(n_rft=4, steps=100, max_new_tokens=320,
                                         temperature=1.0))
  # meta_weight: the shared-backbone stage's meta-BCE weight (grm.shared).
  c.rl = ml_collections.ConfigDict(dict(steps=30, kl_multiplier=2.0, meta_weight=1.0))
  c.grpo = grpo.grpo
  c.grpo.update(max_new_tokens=320, seq_len=2048)
  c.grpo_optim = to_group(OptimConfig, lr=5e-5, warmup_steps=2, end_lr_ratio=1.0, b2=0.99)
  c.rm = ml_collections.ConfigDict(dict(steps=200, batch_size=8, seq_len=1536, meta_k=4))
  c.rm_optim = to_group(OptimConfig, lr=1e-4, warmup_steps=10, decay_steps=200)
  c.benchmark = ml_collections.ConfigDict(dict(ks=(1, 2, 4, 8, 16, 32), temperature=1.0,
                                               max_new_tokens=320, bootstrap_samples=1000,
                                               batch_size=64))
  if arg["tiny"]:
    c.tiny_models = 2
    c.data.update(domains=("math", "instruct"), num_train=4, num_test=4, difficulties=(1, 2),
                  temperatures=(1.0,), max_new_tokens=8, include_reference=True)
    c.sft.update(steps=2, batch_size=2, seq_len=1536)
    c.sft_optim.update(decay_steps=2, warmup_steps=0)
    c.rft.update(n_rft=2, steps=2, max_new_tokens=8)
    c.rl.update(steps=1)
    c.grpo.update(group_size=2, prompts_per_step=1, max_new_tokens=8, seq_len=1536)
    c.rm.update(steps=2, batch_size=2, meta_k=2)
    c.rm_optim.update(decay_steps=2, warmup_steps=0)
    c.benchmark.update(ks=(1, 2), max_new_tokens=8, bootstrap_samples=20, batch_size=16)
  return c
