"""GRPO's settings (docs/DESIGN.md §5): one frozen, hashable dataclass."""
from __future__ import annotations

import dataclasses

from opd.config import fields
from opd.rollout.batches import RolloutConfig, check_rollout_fields

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum_norm")
# The GRPOConfig fields the loss (``opd.rl.loss.make_grpo_loss``) reads.
LOSS_FIELDS = ("clip_eps_low", "clip_eps_high", "kl_coef", "loss_aggregation", "temperature",
               "max_new_tokens")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Everything GRPO-specific; hashable and JSON-ready (``to_dict``).

  Attributes:
    group_size: G, samples per prompt (>= 2: a group of one has no baseline).
    prompts_per_step: P, prompts per rollout batch; the batch has B = P * G rows.
    clip_eps_low: ratio clipped below at ``1 - clip_eps_low`` (in [0, 1)).
    clip_eps_high: ratio clipped above at ``1 + clip_eps_high``; larger than
      ``clip_eps_low`` gives DAPO's asymmetric "clip-higher".
    kl_coef: weight of the k3 KL(pi || pi_ref) term in the loss (0 = none;
      then no reference model is needed).
    scale_advantages_by_std: divide by the group std (GRPO); False keeps the
      plain mean-centred reward (Dr. GRPO).
    advantage_eps: added to the group std before dividing.
    loss_aggregation: one of ``LOSS_AGGREGATIONS`` (``opd.rl.loss``).
    temperature: sampling temperature T > 0, also used for every log-prob.
    top_k, top_p: sampling truncation (log-probs stay untruncated).
    max_new_tokens: N, tokens per sampled turn; also the ``token_sum_norm``
      normaliser.
    updates_per_batch: mu, optimizer steps on one rollout batch (the ratio
      moves away from 1 from the second on).
    seq_len: L, the longest training row; a prompt must leave room for a full
      turn (``len(prompt) + N - 1 <= L``), longer agent episodes are cut.
    length_bucket: each step's arrays are padded only to its longest episode
      rounded up to a multiple of this (at most ``seq_len``), so short
      responses do not pay for ``seq_len`` and only a few shapes compile;
      0 always pads to ``seq_len``.
    max_error_fraction: a step whose share of verifier errors and malformed
      prompts exceeds this stops the run (``VerifierFailureError``).
    num_text_samples: rollouts written to TensorBoard as text (0 = none).
    domain_balance: every batch draws the domains equally
      (``opd.rollout.batches.DomainBalancedStream``).
  """
  group_size: int = 8
  prompts_per_step: int = 8
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.04
  scale_advantages_by_std: bool = True
  advantage_eps: float = 1e-6
  loss_aggregation: str = "token_mean"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 64
  updates_per_batch: int = 1
  seq_len: int = 256
  length_bucket: int = 32
  max_error_fraction: float = 0.1
  num_text_samples: int = 4
  domain_balance: bool = False

  def __post_init__(self):
    owner = "GRPOConfig"
    check_rollout_fields(self, owner, min_group_size=2)  # a group of one has no baseline
    fields.check_fields(
        self, owner, ints={"top_k": 0, "updates_per_batch": 1, "num_text_samples": 0},
        non_negative=("clip_eps_high", "kl_coef", "advantage_eps"),
        floats={"clip_eps_low": dict(min_value=0, max_value=1, max_exclusive=True),
                "top_p": dict(min_value=0, max_value=1, min_exclusive=True),
                "max_error_fraction": dict(min_value=0, max_value=1)},
        bools=("scale_advantages_by_std", "domain_balance"),
        choices={"loss_aggregation": LOSS_AGGREGATIONS})

  @property
  def rollout(self) -> RolloutConfig:
    """The rollout fields (P, G, sampling, L and its bucket) as one typed config."""
    return RolloutConfig(**{f.name: getattr(self, f.name)
                            for f in dataclasses.fields(RolloutConfig)})

  @property
  def batch_size(self) -> int:
    """B = prompts_per_step * group_size."""
    return self.prompts_per_step * self.group_size

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "GRPOConfig":
    return dataclasses.replace(self, **changes)
