"""Next-token objectives over ``opd.training.data`` batches (pre-training, SFT).

Both take the batch layout of ``opd.training.data`` — ``tokens``, ``targets``,
``loss_mask``, ``mask``, ``positions``, ``segment_ids``, all ``[B, T]`` — and
return ``loss_fn(params, batch, rng) -> (loss, metrics)`` for
``opd.training.train_step.make_train_step``.

With ``fused=True`` the LM head is applied inside the fused cross-entropy
(hidden states and the head in), so ``[B, T, V]`` logits are never
materialised — the path to use at a 128K vocabulary. By default that is
``pallas_kernels.train_ce.fused_cross_entropy_train``, which computes the
mean loss and its gradients in one pass (docs/DESIGN.md §4);
``gradient_in_forward=False`` takes the per-token
``pallas_kernels.losses.fused_cross_entropy`` under autodiff (same value and
gradient; it also has a Pallas statistics kernel).
"""
from __future__ import annotations

import jax.numpy as jnp

from opd.models import ModelConfig, forward, head_matrix, moe_balance, token_logprobs

REQUIRED_KEYS = ("tokens", "targets", "loss_mask", "mask")


def _check_batch(batch):
  missing = [k for k in REQUIRED_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
  shapes = {k: tuple(batch[k].shape) for k in REQUIRED_KEYS}
  if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 2:
    raise ValueError(f"batch arrays must all be [B, T]; got {shapes}")


def lm_loss(cfg: ModelConfig, *, fused: bool = False, impl: str = "auto",
            block_sizes=None, gradient_in_forward: bool = True):
  """Mean cross-entropy of ``targets`` over tokens with ``loss_mask * mask``.

  ``impl`` / ``block_sizes`` go to the fused loss (``fused=True``): with
  ``gradient_in_forward`` those of ``fused_cross_entropy_train``
  (``"auto" | "chunked" | "reference"``, ``TrainChunkSizes``), else those of
  ``fused_cross_entropy``.

  Metrics: ``tokens`` (the number of trained targets) and ``accuracy``
  (argmax == target; unfused path only, the fused one never sees logits).
  An MoE model (``cfg.moe``) adds its balance losses to the loss and its
  router statistics to the metrics (``opd.models.moe_balance.balance_terms``).
  """
  from pallas_kernels import losses as fused_losses  # jax-only dependency
  from pallas_kernels import train_ce

  def loss_fn(params, batch, rng):
    del rng
    _check_batch(batch)
    tokens, targets = batch["tokens"], batch["targets"]
    weights = batch["loss_mask"].astype(jnp.float32) * batch["mask"].astype(jnp.float32)
    out = forward(cfg, params, tokens, batch.get("positions"), batch["mask"],
                  segment_ids=batch.get("segment_ids"), return_logits=not fused,
                  return_hidden=fused)
    metrics = {}
    total = jnp.sum(weights)
    coef = weights / jnp.maximum(total, 1.0)  # [B, T]: the mean as Σ c_t nll_t
    if fused:
      B, T, D = out.hidden.shape
      h, w_head, y = out.hidden.reshape(B * T, D), head_matrix(cfg, params), targets.reshape(B * T)
      if gradient_in_forward:
        loss = train_ce.fused_cross_entropy_train(h, w_head, y, coef.reshape(B * T), impl=impl,
                                                  block_sizes=block_sizes)
      else:
        nll = fused_losses.fused_cross_entropy(h, w_head, y, mask=weights.reshape(B * T) > 0,
                                               impl=impl, block_sizes=block_sizes)
        loss = jnp.sum(nll * coef.reshape(B * T))
    else:
      nll = -token_logprobs(out.logits, targets)
      correct = (jnp.argmax(out.logits, axis=-1) == targets).astype(jnp.float32)
      metrics["accuracy"] = jnp.sum(correct * weights) / jnp.maximum(total, 1.0)
      loss = jnp.sum(nll * coef)
    metrics["tokens"] = total
    if cfg.moe is not None:
      balance, router = moe_balance.balance_terms(cfg.moe, out.moe)
      loss = loss + balance
      metrics.update(router)
    return loss, metrics

  return loss_fn


def next_token_loss(cfg: ModelConfig):
  """``lm_loss`` on a plain ``{"tokens": int [B, T+1]}`` batch.

  Optional ``"loss_mask"`` / ``"mask"`` are ``[B, T+1]`` too (a target's
  weight sits at the target token; position 0 is never a target). For quick
  experiments and tests that have whole sequences rather than ``opd.training.data``
  batches.
  """
  inner = lm_loss(cfg)

  def loss_fn(params, batch, rng):
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
      raise ValueError(f"batch['tokens'] must be [B, T+1] with T >= 1, got {tokens.shape=}")
    mask = batch.get("mask")
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    weights = batch.get("loss_mask")
    weights = jnp.ones(tokens.shape, jnp.float32) if weights is None else weights
    # The target at t+1 is trained only if both it and its input are real.
    shifted = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
               "mask": mask[:, :-1],
               "loss_mask": weights[:, 1:].astype(jnp.float32) * mask[:, 1:]}
    return inner(params, shifted, rng)

  return loss_fn
