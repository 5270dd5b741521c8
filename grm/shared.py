"""Shared-backbone GRM + meta-RM: one decoder, two heads, one joint loss (docs/DESIGN.md §6).

The seed's "actor-critic joint optimisation": the GRM's LM head writes the
judgement (the actor) and a scalar head on the same trunk judges that
judgement's quality (the critic, the meta-RM). A rule-RL rollout row is
exactly the meta-RM's input (the GRM prompt followed by the sampled
judgement, ``grm.meta_rm.meta_input_ids``), so both heads train on the same
batch::

  L = L_rule-RL(LM head; GRPO batch) + w · BCE(m, y)
  m_b = value head at row b's last real token,  y_b = 1 iff judgement b was
  correct (its rule reward is +1, ``grm.correctness``)

``shared_loss_fn`` is that loss for ``opd.training.train_step``; the batch is
the GRPO batch (``opd.rl.loss.BATCH_KEYS``) plus ``meta_labels [B]``. The
GRPO part's LM head gets no gradient from the BCE and the value head none
from the policy loss; the trunk gets both. ``meta_labels_from_rewards``
turns the rule rewards (+1/-1) into labels. ``train_shared_rule_rl`` is the
trainer: stage (c)'s rule RL (``grm.training.train_rule_rl``) on the
shared decoder, where each rollout batch also carries the labels of its own
judgements (``train_grpo``'s ``batch_extras``) and the loss is the joint one.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from grm.meta_rm import binary_cross_entropy
from grm.scalar_rm import sequence_rewards
from opd.config.fields import check_float
from opd.models import ModelConfig
from opd.rl.config import GRPOConfig
from opd.rl import GRPOExtras, train_grpo
from opd.rl.loss import make_grpo_loss
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from grm.training import RuleReward, rl_examples, rule_rl_config

__all__ = ["meta_labels_from_rewards", "shared_loss_fn", "train_shared_rule_rl"]


def meta_labels_from_rewards(rewards) -> np.ndarray:
  """``[B]`` float32 labels, 1 where the rule reward is positive (a correct judgement)."""
  r = np.asarray(rewards, np.float64)
  if r.ndim != 1 or not np.all(np.isfinite(r)):
    raise ValueError(f"rewards must be a finite [B] array, got shape {r.shape}")
  return (r > 0).astype(np.float32)


def shared_loss_fn(model_cfg: ModelConfig, grpo_cfg: GRPOConfig, meta_weight: float):
  """``loss_fn(params, batch, rng) -> (loss, metrics)``: rule-RL + ``meta_weight`` · meta BCE.

  Args:
    model_cfg: the shared decoder (``scalar_head=True``: the LM head and the
      value head on one trunk).
    grpo_cfg: the rule-RL settings (``grm.training.rule_rl_config``).
    meta_weight: w >= 0, the BCE's weight.

  The batch: the GRPO keys (``tokens``, ``targets``, ``mask``, ``loss_mask``,
  ``old_logprobs`` ``[B, L]``, ``advantages [B]``, optional ``ref_logprobs``)
  and ``meta_labels [B]`` in {0, 1}. Metrics: the GRPO loss's, plus
  ``rl_loss``, ``meta_bce`` and ``meta_accuracy`` (``m > 0`` agrees with y).
  """
  if not model_cfg.scalar_head:
    raise ValueError("shared_loss_fn: ModelConfig.scalar_head=False; the shared backbone "
                     "needs the scalar (meta-RM) head")
  w = check_float("shared_loss_fn", "meta_weight", meta_weight, min_value=0.0)
  rl_loss = make_grpo_loss(model_cfg, grpo_cfg)

  def loss_fn(params, batch, rng):
    if "meta_labels" not in batch:
      raise ValueError(f"batch is missing 'meta_labels'; it has {sorted(batch)}")
    labels = batch["meta_labels"].astype(jnp.float32)
    if labels.shape != batch["tokens"].shape[:1]:
      raise ValueError(f"meta_labels must be [B]={batch['tokens'].shape[:1]}, got "
                       f"{labels.shape}")
    rl, metrics = rl_loss(params, {k: v for k, v in batch.items() if k != "meta_labels"}, rng)
    m = sequence_rewards(model_cfg, params, batch["tokens"], batch["mask"].astype(bool))
    bce = binary_cross_entropy(m, labels)
    agree = ((m > 0).astype(jnp.float32) == labels).astype(jnp.float32)
    return rl + w * bce, {**metrics, "rl_loss": rl, "meta_bce": bce,
                          "meta_accuracy": jnp.mean(agree)}

  return loss_fn


def _meta_label_extras(episodes, rewards) -> dict[str, np.ndarray]:
  del episodes
  return {"meta_labels": meta_labels_from_rewards(rewards)}


def train_shared_rule_rl(model_cfg: ModelConfig, params, groups, cfg: GRPOConfig, optim,
                         loop: LoopConfig, io: RunIO | None = None, *, runtime: Runtime,
                         meta_weight: float, kl_multiplier: float = 2.0):
  """Rule RL of the shared decoder with the joint loss (module docstring).

  As ``grm.training.train_rule_rl`` (same prompts, ``RuleReward``, KL
  ``kl_multiplier`` x ``cfg.kl_coef``, reference = ``params``), but
  ``model_cfg.scalar_head`` must be True and every update minimises
  ``L_rule-RL + meta_weight * BCE(value head, judgement correct)`` on the
  batch's own judgements. ``loop``, ``io`` and ``runtime`` go to ``train_grpo``.
  Returns its ``GRPORun``; ``train/meta_bce`` and ``train/meta_accuracy`` are logged.
  """
  rl_cfg = rule_rl_config(cfg, kl_multiplier)
  loss_fn = shared_loss_fn(model_cfg, rl_cfg, meta_weight)
  return train_grpo(model_cfg, params, params, rl_examples(groups, seed=runtime.seed), rl_cfg,
                    optim, loop, io, runtime=runtime,
                    extras=GRPOExtras(reward_fn=RuleReward(), loss_fn=loss_fn,
                                      batch_extras=_meta_label_extras))
