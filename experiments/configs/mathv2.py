"""Job ``mathv2``: DeepSeekMath-V2 on the toy proof domain (docs/DESIGN.md §7).

Base → generator / verifier / meta-verifier SFT on rule-written texts →
verifier GRPO with ``R_format·R_score`` and with ``R_format·R_score·R_meta``
→ generator GRPO with the self-verification reward → evaluation (single
pass, refinement at 1/2/4 rounds, search, verifier accuracy and issue
faithfulness, auto-labelling agreement). See ``experiments/mathv2.py``.

  nice -n 10 .venv/bin/python -m experiments.launch --config=experiments/configs/mathv2.py \
      --workdir=workdirs/mathv2
  python -m experiments.launch --config=experiments/configs/mathv2.py:tiny \
      --workdir=workdirs/mathv2_tiny          # CI smoke test: a few steps per stage

Reference machine (2 CPU cores shared with other jobs, load average 5-8):
default 51 min wall, the sum of the stages' walls over two launches (the
first with the earlier 800-step generator SFT, whose generator stages were
then rerun at this config): base 5.5 min, generator SFT 30 min, verifier and
meta SFT 3.2 + 3.5 min, verifier GRPO 2.2 + 2.0 min, generator GRPO 2.0 min,
evaluation 2.9 min; each launch used 0.62 CPU-seconds per wall-second (34 and
35 min wall, 1,291 and 1,312 s user + sys CPU). Tiny: the job test (two
launches) 3 min 53 s under load ~7.

Measured result (32 test problems, 96 test proofs; every text sampled from
our models, every score the rule checker's; ± one SE):

  proofs the checker scores 1 (%)   single     refine@1   refine@2   refine@4
  generator_sft                     3.1 ± 3.1  3.1 ± 3.1  3.1 ± 3.1  3.1 ± 3.1
  generator_rl                      6.2 ± 4.3  6.2 ± 4.3  6.2 ± 4.3  6.2 ± 4.3
  search (generator_rl + verifier_rl_meta, 8 problems, pool 8): 0.0

  verifier              score accuracy %   faithfulness %   issues stated
  verifier_sft          60.4 ± 5.0         50.9             108
  verifier_rl           63.5 ± 4.9         50.4             123
  verifier_rl_meta      58.3 ± 5.1         48.5             101
  (always answering 0 scores 43.8%: 42 of the 96 test proofs score 0)

  auto-labelling agreement % (32 proofs; always 0 would agree on 40.6%)
  n (rows), m   1       3
  1          34.4    40.6
  2          43.8    46.9
  4          50.0    59.4

Reading: the verifiers are above the majority class but the meta-verifier
adds nothing measurable (its own score agrees with the rule meta-verification
on 60% of noisy test analyses, against 56% for always answering 1), so
R_meta is close to noise and faithfulness does not rise. Labelling agreement
rises with n and m. The generator is the weak part: it copies the problem
(100% at difficulty 1 after 2,400 SFT steps, 66% after 800) but its
arithmetic steps are mostly wrong, and its self-evaluation says "Score: 1"
on 92 of 96 greedy proofs (4 correct), so refinement stops at once and never
repairs a proof; single pass, refinement and search all stay near 0.
"""
import ml_collections

from experiments.configs import grpo as grpo_config
from experiments.configs import pretrain as pretrain_config
from opd.config import overrides as config_utils
from opd.config.fields import to_group
from opd.training.optim import OptimConfig


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  variant = "tiny" if arg["tiny"] else None
  pre = pretrain_config.get_config(variant)
  grpo = grpo_config.get_config(variant)
  c = ml_collections.ConfigDict()
  c.job = "mathv2"
  c.seed = 0
  c.model = pre.model
  c.mesh = pre.mesh
  c.sharding_rules = pre.sharding_rules
  # The base: a checkpoint (``base.init``) or pre-trained here on proof-domain
  # chat text, a ``response_fraction`` share with the reference proof.
  c.base = ml_collections.ConfigDict(dict(
      init="", steps=200, batch_size=8, seq_len=256, num_docs=4000, response_fraction=0.5))
  c.base_optim = to_group(OptimConfig, lr=3e-3, warmup_steps=10, decay_steps=190,
                          weight_decay=0.01)
  # Problems and the proofs the verifier is trained and tested on: each
  # problem's reference proof and ``corruptions`` corrupted copies.
  c.data = ml_collections.ConfigDict(dict(
      num_train=256, num_test=32, difficulties=(1, 2, 3), corruptions=2,
      analysis_noise=0.3, generator_corrupt_fraction=0.3))
  # The three SFTs (generator, verifier, meta-verifier) share these.
  c.sft = ml_collections.ConfigDict(dict(steps=200, batch_size=4, seq_len=512))
  c.sft_optim = to_group(OptimConfig, lr=1e-3, warmup_steps=10, decay_steps=200,
                         end_lr_ratio=0.1)
  # The generator's SFT: more steps and its own (larger) pool of train problems,
  # each with the same corruptions; it must learn to copy and compute, not only grade.
  # refine_fraction: that share of the corrupted proofs also becomes a refinement
  # pair (previous proof + the checker's analysis -> the reference), so the
  # refinement prompt is not unseen; off by default (the measured run below): in a
  # probe at 0.5 the refinement outputs parsed 0-9% of the time, and the full run
  # with it is not measured (docs/LOG.md). With it, use seq_len=384 (its pairs
  # are <= 374 tokens; without, <= 255). Its own lr (the schedule is sft_optim's).
  c.generator = ml_collections.ConfigDict(dict(sft_steps=2400, num_problems=1024, seq_len=256,
                                               batch_size=8, lr=1e-3, refine_fraction=0.0))
  # Every sampler call outside GRPO: fixed rows and prompt length (one compile).
  # constrained_roles: roles among ("verifier", "meta") decoded under their whole
  # grammar (experiments.mathv2.ROLE_PATTERNS; every finished sample then parses
  # valid): evaluation, R_meta and the generator's reward, search and labelling.
  # Empty keeps the measured numbers below.
  c.sample = ml_collections.ConfigDict(dict(
      batch_size=32, prompt_len=512, temperature=1.0, proof_tokens=160, analysis_tokens=64,
      constrained_roles=()))
  c.grpo = grpo.grpo
  c.grpo.update(group_size=4, prompts_per_step=4, max_new_tokens=64, seq_len=512, kl_coef=0.05)
  c.grpo_optim = to_group(OptimConfig, lr=2e-4, warmup_steps=2, end_lr_ratio=1.0, b2=0.99)
  c.rl = ml_collections.ConfigDict(dict(verifier_steps=20, generator_steps=10, alpha=0.76,
                                        beta=0.24, generator_max_new_tokens=160))
  c.eval = ml_collections.ConfigDict(dict(
      rounds=(1, 2, 4), search_pool=8, search_analyses=4, search_kept=2, search_rounds=2,
      search_problems=8, label_ns=(1, 2, 4), label_ms=(1, 3), label_proofs=32))
  if arg["tiny"]:
    c.base.update(steps=2, batch_size=2, seq_len=256, num_docs=20)
    c.base_optim.update(warmup_steps=0, decay_steps=2)
    c.data.update(num_train=4, num_test=2, difficulties=(1,), corruptions=1)
    c.sft.update(steps=2, batch_size=2)
    # the smoke test builds refinement pairs too
    c.generator.update(sft_steps=2, num_problems=4, batch_size=2, refine_fraction=0.5,
                       seq_len=384)
    c.sft_optim.update(warmup_steps=0, decay_steps=2)
    c.sample.update(batch_size=8, proof_tokens=24, analysis_tokens=24)
    c.grpo.update(group_size=2, prompts_per_step=2, max_new_tokens=24, seq_len=512)
    c.rl.update(verifier_steps=1, generator_steps=1, generator_max_new_tokens=24)
    c.eval.update(rounds=(1, 2), search_pool=2, search_analyses=2, search_kept=1,
                  search_rounds=1, search_problems=1, label_ns=(1, 2), label_ms=(1,),
                  label_proofs=2)
  return c
