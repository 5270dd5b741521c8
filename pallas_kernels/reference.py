"""Plain-jnp references that materialise the ``[T, V]`` logits.

They are the ground truth the fused paths are tested against (together with
a float64 numpy oracle in the tests) and the "materialised XLA" baseline of
the benchmarks. They use ``log_softmax`` directly, not the online statistics
of :mod:`pallas_kernels.tile_math`, so they check that algebra independently.
Gradients come from ordinary autodiff.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.tile_math import Stats


def logits(h: jax.Array, w: jax.Array, temperature: float) -> jax.Array:
  """``h W / τ`` in float32: [T, D] x [D, V] -> [T, V]."""
  return jnp.einsum("TD,DV->TV", h, w, preferred_element_type=jnp.float32) / temperature


def vocab_stats_reference(h_s, w_s, h_k: Sequence, w_k: Sequence, temperature: float) -> Stats:
  """Materialised :class:`~pallas_kernels.tile_math.Stats` (see that module)."""
  z = logits(h_s, w_s, temperature)
  lp = jax.nn.log_softmax(z, axis=-1)
  p = jnp.exp(lp)
  lse = jax.nn.logsumexp(z, axis=-1)
  ent = -jnp.sum(p * lp, axis=-1)
  e_k, lse_k = [], []
  for h, w in zip(h_k, w_k):
    x = logits(h, w, temperature)
    e_k.append(jnp.sum(p * (z - x), axis=-1))
    lse_k.append(jax.nn.logsumexp(x, axis=-1))
  stack = lambda c: jnp.stack(c, axis=1) if c else jnp.zeros((z.shape[0], 0), jnp.float32)
  return Stats(lse, ent, stack(e_k), stack(lse_k))


def reverse_kl_reference(h_s, w_s, h_k: Sequence, w_k: Sequence, w_hat: jax.Array,
                         mask: jax.Array | None, temperature: float):
  """Materialised multi-teacher reverse KL.

  Args:
    h_s: [T, Ds]; w_s: [Ds, V]; h_k / w_k: K arrays [T, Dt_k] / [Dt_k, V].
    w_hat: [T, K] renormalised weights (zero rows for absent tokens).
    mask: [T] bool or None.
    temperature: τ > 0.

  Returns:
    ``(loss [T], kl [T, K], entropy [T])`` float32; kl and entropy are 0
    outside the mask.
  """
  lp = jax.nn.log_softmax(logits(h_s, w_s, temperature), axis=-1)
  p = jnp.exp(lp)
  kl = jnp.stack([jnp.sum(p * (lp - jax.nn.log_softmax(logits(h, w, temperature), axis=-1)), axis=-1)
                  for h, w in zip(h_k, w_k)], axis=1)
  ent = -jnp.sum(p * lp, axis=-1)
  loss = jnp.sum(w_hat * kl, axis=1)
  if mask is not None:
    kl = jnp.where(mask[:, None], kl, 0.0)
    ent = jnp.where(mask, ent, 0.0)
    loss = jnp.where(mask, loss, 0.0)
  return loss, kl, ent


def _teacher_logprobs(h_k, w_k, temperature):
  return [jax.nn.log_softmax(logits(h, w, temperature), axis=-1) for h, w in zip(h_k, w_k)]


def cross_entropy_reference(h_s, w_s, labels, mask, temperature):
  """−log p(label): [T] (0 outside the mask)."""
  lp = jax.nn.log_softmax(logits(h_s, w_s, temperature), axis=-1)
  nll = -jnp.take_along_axis(lp, labels[:, None], axis=1)[:, 0]
  return nll if mask is None else jnp.where(mask, nll, 0.0)


def forward_kl_reference(h_s, w_s, h_k, w_k, w_hat, temperature):
  """``Σ_k ŵ_k KL(q_k ‖ p)``: [T]."""
  lp = jax.nn.log_softmax(logits(h_s, w_s, temperature), axis=-1)
  kl = [jnp.sum(jnp.exp(lq) * (lq - lp), axis=-1) for lq in _teacher_logprobs(h_k, w_k, temperature)]
  return jnp.sum(w_hat * jnp.stack(kl, axis=1), axis=1)


def jsd_reference(h_s, w_s, h_k, w_k, w_hat, beta, temperature):
  """``Σ_k ŵ_k JSD_β(p, q_k)`` with ``M = β q + (1−β) p`` (see losses.py): [T]."""
  lp = jax.nn.log_softmax(logits(h_s, w_s, temperature), axis=-1)
  p = jnp.exp(lp)
  out = []
  for lq in _teacher_logprobs(h_k, w_k, temperature):
    q = jnp.exp(lq)
    if beta == 0.0:
      out.append(jnp.sum(q * (lq - lp), axis=-1))
    elif beta == 1.0:
      out.append(jnp.sum(p * (lp - lq), axis=-1))
    else:
      lm = jnp.log(beta * q + (1 - beta) * p)
      out.append(beta * jnp.sum(q * (lq - lm), axis=-1) + (1 - beta) * jnp.sum(p * (lp - lm), axis=-1))
  return jnp.sum(w_hat * jnp.stack(out, axis=1), axis=1)


def topk_kl_reference(h_s, w_s, h_k, w_k, w_hat, top_k, temperature):
  """Reverse KL on each teacher's top-k tokens, both sides renormalised: [T]."""
  z = logits(h_s, w_s, temperature)
  out = []
  for h, w in zip(h_k, w_k):
    x = logits(h, w, temperature)
    x_top, idx = jax.lax.top_k(x, top_k)
    z_top = jnp.take_along_axis(z, idx, axis=1)
    lp = jax.nn.log_softmax(z_top, axis=-1)
    lq = jax.nn.log_softmax(x_top, axis=-1)
    out.append(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1))
  return jnp.sum(w_hat * jnp.stack(out, axis=1), axis=1)


def token_level_reference(h_s, w_s, h_k, w_k, w_hat, tokens, temperature):
  """``log p(y_t) − Σ_k ŵ_k log q_k(y_t)`` at the sampled tokens: [T]."""
  lp = jax.nn.log_softmax(logits(h_s, w_s, temperature), axis=-1)
  pick = lambda a: jnp.take_along_axis(a, tokens[:, None], axis=1)[:, 0]
  lq = jnp.stack([pick(l) for l in _teacher_logprobs(h_k, w_k, temperature)], axis=1)
  return pick(lp) - jnp.sum(w_hat * lq, axis=1)
