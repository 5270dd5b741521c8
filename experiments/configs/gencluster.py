"""Job ``gencluster``: test-time clustering for code (docs/DESIGN.md §7, experiments/gencluster.py).

  nice python -m experiments.launch --config=experiments/configs/gencluster.py \
      --workdir=workdirs/gencluster
  python -m experiments.launch --config=experiments/configs/gencluster.py:tiny \
      --workdir=workdirs/gencluster_tiny      # CI smoke test: a random tiny policy

The policy is the first existing directory of ``policy.checkpoints`` (the V4
run's code specialist, GRPO then SFT), else an SFT of ``policy.base`` on the
code domain (pre-training a base first when that is missing too);
``--config.policy.checkpoints="('DIR',)"`` points it elsewhere. The judge is
the policy unless ``judge.checkpoint`` names a pairwise judge (e.g. the grm
job's ``WORKDIR/pairwise/checkpoints``). The tiny variant uses a random policy
and plants two candidates per subtask that are not model-driven, the
reference program and an off-by-one distractor, so that clusters, a
tournament and solved subtasks exist.

Reference machine (2 CPU cores shared with ~6 other jobs, load average ~12):
tiny 16 s (tests/experiments/test_gencluster_job.py launch). Default, on the
V4 run's code specialist (workdirs/v4_3seeds/code/grpo): 4 min 26 s wall,
1 min 18 s user + 28 s sys CPU (sampling 5,472 policy responses and 1,012
judge prompts; the sandbox ran 4,466 programs at 59 programs/s wall).
Measured result (48 problems x 3 subtasks, K = 32; % of subtasks solved,
mean ± SE over problems):

  budget                        1           2           5           10          50
  GENCLUSTER                    9.0 ± 4.1   12.5 ± 4.8  15.3 ± 5.2  21.5 ± 5.9  25.0 ± 6.3
  tournament, no validators     9.0 ± 4.1   12.5 ± 4.8  15.3 ± 5.2  21.5 ± 5.9  25.0 ± 6.3
  majority cluster only         9.0 ± 4.1    9.0 ± 4.1   9.0 ± 4.1  11.8 ± 4.5  11.8 ± 4.5
  random candidates             5.6 ± 3.0    5.6 ± 3.0   7.6 ± 3.6  15.3 ± 5.2  25.0 ± 6.3
  upper bound (any candidate passes): 27.1

Expected reading: clustering beats random candidates at small budgets and
the majority cluster at large ones; all stay below the upper bound. The
policy wrote no valid judgement (0 of 1,012), so the "tournament" ranks by
cluster size; its generators were used 21 of 288 times and its validators
never (0 of 576: rule-based instead), so the 75% filter removed only 4.9% of
inputs and "no validators" equals GENCLUSTER here.
"""
import ml_collections

from experiments.configs import pretrain as pretrain_config
from experiments.configs import sft as sft_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.training.optim import OptimConfig

DEMO = "workdirs/demo"  # what `make demo` writes (read only here)


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  variant = "tiny" if arg["tiny"] else None
  pre = pretrain_config.get_config(variant)
  sft = sft_config.get_config(variant)
  c = ml_collections.ConfigDict()
  c.job = "gencluster"
  c.seed = 0
  c.model = pre.model
  c.mesh = pre.mesh
  c.sharding_rules = pre.sharding_rules
  sft.data.update(domains=("code",), difficulties=(1, 2, 3))
  c.policy = ml_collections.ConfigDict(dict(
      random_init=False,
      checkpoints=(f"{DEMO}/code/grpo/checkpoints", f"{DEMO}/code/sft/checkpoints"),
      base=f"{DEMO}/base/checkpoints",
      pretrain=ml_collections.ConfigDict(dict(optim=pre.optim, train=pre.train, data=pre.data)),
      sft=ml_collections.ConfigDict(dict(optim=sft.optim, train=sft.train, data=sft.data))))
  c.judge = ml_collections.ConfigDict(dict(
      checkpoint="", max_new_tokens=24, temperature=0.0, train_steps=100, num_train=3000,
      batch_size=16, seq_len=512,
      optim=to_group(OptimConfig, lr=3e-4, warmup_steps=10, decay_steps=90, schedule="cosine")))
  c.problems = ml_collections.ConfigDict(dict(split="test", difficulties=(1, 2, 3),
                                              per_difficulty=16, n_hidden=8))
  c.candidates = ml_collections.ConfigDict(dict(k=32, temperature=1.0, max_new_tokens=48,
                                                plant_reference=False))
  c.tests = ml_collections.ConfigDict(dict(n_generators=2, per_generator=8, n_validators=4,
                                           n_probe=8, max_inputs=12))
  c.tournament = ml_collections.ConfigDict(dict(max_clusters=4, games=1))
  c.submission = ml_collections.ConfigDict(dict(budget=50, report_budgets=(1, 2, 5, 10, 50)))
  c.sandbox = ml_collections.ConfigDict(dict(cpu_s=1.0, wall_s=2.0, memory_mb=256, workers=2,
                                             chunk=32))
  c.sample_batch = 64
  if arg["tiny"]:
    c.policy.random_init = True
    c.problems.update(per_difficulty=1, n_hidden=3)
    c.candidates.update(k=3, max_new_tokens=12, plant_reference=True)
    c.tests.update(n_generators=1, per_generator=4, n_validators=2, n_probe=4, max_inputs=6)
    c.tournament.update(max_clusters=3)
    c.judge.update(max_new_tokens=8, train_steps=2, num_train=12, batch_size=2)
    c.judge.optim.update(warmup_steps=0, decay_steps=2)
    c.submission.update(budget=8, report_budgets=(1, 2, 8))
    c.sample_batch = 16
  return c
