"""The grads-function contract of the training entry and its reference (docs/DESIGN.md §4).

Every implementation of :func:`pallas_kernels.train_loss.fused_reverse_kl_train`
(``"reference"`` here, ``"chunked"`` in :mod:`pallas_kernels.train_loss`,
``"pallas"`` in :mod:`pallas_kernels.pallas_train`) returns a :class:`TrainOut`
whose ``loss`` is :func:`weighted_loss` of its per-token KL; the signature and
the meaning of each argument are in :mod:`pallas_kernels.train_loss`'s module
docstring. This module sits below all of them, so none imports another's.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import reference

__all__ = ["TrainOut", "train_grads_reference", "weighted_loss"]


class TrainOut(NamedTuple):
  """Result of a grads function (see module docstring).

  Attributes:
    loss: [] float32 ``Σ_t c_t Σ_k ŵ_tk KL_tk``.
    kl: [T, K] float32 per-teacher reverse KL of every token.
    ent: [T] float32 student entropy of every token.
    dh_s: [T, Ds] ``dloss/dh_s`` in the dtype of ``h_s``.
    dw_s: [Ds, V] ``dloss/dW_s`` in the dtype of ``w_s``.
  """
  loss: jax.Array
  kl: jax.Array
  ent: jax.Array
  dh_s: jax.Array
  dw_s: jax.Array


def weighted_loss(coef, w_hat, kl):
  """``Σ_t c_t Σ_k ŵ_tk KL_tk``; an absent teacher adds an exact 0 even if its
  KL were inf (``where``, not a bare product); NaN weights propagate."""
  return jnp.sum(coef * jnp.sum(jnp.where(w_hat != 0, w_hat * kl, 0.0), axis=1))


def train_grads_reference(h_s, w_s, h_k, w_k, w_hat, coef, *, temperature: float, sizes=None,
                          shared_head: bool = False) -> TrainOut:
  """Materialised ``[T, V]`` logits; gradients by ``jax.grad`` of the loss."""
  del shared_head  # separate heads with equal values give the same result
  if sizes is not None:
    raise ValueError(f"block_sizes={sizes!r}: impl='reference' takes no block sizes")

  def obj(h_s, w_s):
    _, kl, ent = reference.reverse_kl_reference(h_s, w_s, h_k, w_k, w_hat, None, temperature)
    return weighted_loss(coef, w_hat, kl), (kl, ent)

  (loss, (kl, ent)), (dh, dw) = jax.value_and_grad(obj, argnums=(0, 1), has_aux=True)(h_s, w_s)
  return TrainOut(loss, kl, ent, dh, dw)
