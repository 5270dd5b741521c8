"""Issue #32's experiments on the strong toy world (``experiments/opd_forms_experiment.py``).

  python -m experiments.launch --config=experiments/configs/opd_forms.py \\
      --workdir=workdirs/opd_forms --config.reuse_from=workdirs/v4_strong,workdirs/strong
  # CI smoke test: every stage at a few steps
  python -m experiments.launch --config=experiments/configs/opd_forms.py:tiny \\
      --workdir=workdirs/opd_forms_tiny

Single-teacher OPD from the V4 student's seed-0 cold start towards one
specialist on its own domain (the positive control's setting,
``experiments/positive_control.py``: equal updates and equal sampled tokens
by construction), in these arms:

  exact              the full-vocabulary reverse KL (the positive control itself)
  advantage          the sampled-token advantage form (``opd.loss.form="advantage"``)
  advantage_outcome  advantage + α · GRPO's outcome advantage, α from ``alpha_sweep``
                     (run on the first of ``domains``, its α used on every domain)
  cross_tokenizer    the advantage form towards a specialist of the same
                     recipe trained with ``cross.tokenizer`` (another tokenizer)

``world``: the strong world's V4 config (``experiments/configs/v4.py:strong``),
whose specialists, cold start, OPD group, evaluation and positive-control
length are reused as they are.

Two more arms take γ = 1 (the unbiased sequence-level form) instead of
``advantage.adv_gamma``:

  advantage_g1        the advantage form with γ = 1
  cross_tokenizer_g1  the cross-tokenizer arm with γ = 1

{advantage, cross_tokenizer} × {γ = 0, γ = 1} asks whether the other
tokenizer's deficit depends on the form. It was meant to separate the span
alignment's credit placement (γ = 0 puts a span's signal on its last student
token only; γ = 1 spreads it over the span) from the teacher itself, but in
the strong world every bpe:1024 token ends at a bpe:512 boundary (no span
holds two student tokens in 64k tokens of code and math text), so
placement plays no part there.

The math domain reuses every finished stage and the code sweep's α:
  python -m experiments.launch --config=experiments/configs/opd_forms.py \\
      --workdir=workdirs/opd_forms_h4 --config.domains="('code','math')" \\
      --config.reuse_from=workdirs/opd_forms_A,workdirs/opd_forms_B,workdirs/v4_strong,workdirs/strong
(run so in workdirs/opd_forms_h4a (code), opd_forms_h4b (math, seed 0, every
arm) and opd_forms_h4 (math seeds 1 and 2 without the cross arms).)
"""
import ml_collections

from experiments.configs import v4 as v4_config
from opd.config import overrides as config_utils

ARMS = ("exact", "advantage", "advantage_outcome", "advantage_g1", "cross_tokenizer",
        "cross_tokenizer_g1")


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, tiny=False)
  c = ml_collections.ConfigDict()
  c.job = "opd_forms"
  c.seed = 0
  # Finished workdirs (comma-separated) whose stages are read, not rerun.
  c.reuse_from = ""
  c.world = v4_config.get_config("tiny,strong" if arg["tiny"] else "strong")
  # The domains whose specialist is the single teacher (each its own runs).
  c.domains = ("math",) if arg["tiny"] else ("code",)
  # OPD seeds of every arm (the OPD stage's seed: prompts and samples), all
  # from the first student seed's cold start.
  c.seeds = (0,) if arg["tiny"] else (0, 1, 2)
  c.arms = ARMS
  # The advantage form's fields of the advantage arms (opd.distill.advantage):
  # γ = 0 is the immediate per-token advantage the field's systems use.
  c.advantage = ml_collections.ConfigDict(dict(adv_gamma=0.0, adv_beta=1.0, is_cap=0.0))
  # α of advantage_outcome: each α trains ``steps`` steps (seed ``seed``,
  # first domain); the one with the highest mean verified train reward over
  # the last ``last`` steps wins (no test example is read to choose it).
  c.alpha_sweep = ml_collections.ConfigDict(dict(alphas=(0.25, 1.0), steps=80, last=20, seed=0))
  # The cross-tokenizer teacher: the world's specialist recipe (base,
  # shared SFT of every domain, the domain's SFT and GRPO) with this tokenizer.
  c.cross = ml_collections.ConfigDict(dict(tokenizer="bpe:512", vocab_size=512, seeds=(0,)))
  if arg["tiny"]:
    c.alpha_sweep.update(alphas=(1.0,), steps=1, last=1)
    c.cross.update(tokenizer="byte", vocab_size=270)
  return c
