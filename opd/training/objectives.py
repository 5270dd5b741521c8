"""Next-token objectives over ``opd.training.data`` batches (pre-training, SFT).

Both take the batch layout of ``opd.training.data`` — ``tokens``, ``targets``,
``loss_mask``, ``mask``, ``positions``, ``segment_ids``, all ``[B, T]`` — and
return ``loss_fn(params, batch, rng) -> (loss, metrics)`` for
``opd.training.train_step.make_train_step``.

With ``fused=True`` the LM head is applied inside
``pallas_kernels.losses.fused_cross_entropy`` (hidden states and the head in,
per-token loss out), so ``[B, T, V]`` logits are never materialised — the
path to use at a 128K vocabulary.
"""
from __future__ import annotations

import jax.numpy as jnp

from opd.models import ModelConfig, forward, head_matrix, token_logprobs

REQUIRED_KEYS = ("tokens", "targets", "loss_mask", "mask")


def _check_batch(batch):
  missing = [k for k in REQUIRED_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
  shapes = {k: tuple(batch[k].shape) for k in REQUIRED_KEYS}
  if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 2:
    raise ValueError(f"batch arrays must all be [B, T]; got {shapes}")


def lm_loss(cfg: ModelConfig, *, fused: bool = False, impl: str = "auto",
            block_sizes=None):
  """Mean cross-entropy of ``targets`` over tokens with ``loss_mask * mask``.

  Metrics: ``tokens`` (the number of trained targets) and ``accuracy``
  (argmax == target; unfused path only, the fused one never sees logits).
  """
  from pallas_kernels import losses as fused_losses  # jax-only dependency

  def loss_fn(params, batch, rng):
    del rng
    _check_batch(batch)
    tokens, targets = batch["tokens"], batch["targets"]
    weights = batch["loss_mask"].astype(jnp.float32) * batch["mask"].astype(jnp.float32)
    out = forward(cfg, params, tokens, batch.get("positions"), batch["mask"],
                  segment_ids=batch.get("segment_ids"), return_logits=not fused,
                  return_hidden=fused)
    metrics = {}
    if fused:
      B, T, D = out.hidden.shape
      nll = fused_losses.fused_cross_entropy(
          out.hidden.reshape(B * T, D), head_matrix(cfg, params), targets.reshape(B * T),
          mask=weights.reshape(B * T) > 0, impl=impl, block_sizes=block_sizes).reshape(B, T)
    else:
      nll = -token_logprobs(out.logits, targets)
      correct = (jnp.argmax(out.logits, axis=-1) == targets).astype(jnp.float32)
      metrics["accuracy"] = jnp.sum(correct * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    total = jnp.sum(weights)
    loss = jnp.sum(nll * weights) / jnp.maximum(total, 1.0)
    metrics["tokens"] = total
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
