"""Companion losses of the fused reverse KL, sharing its chunked machinery.

All take hidden states and output heads (never ``[T, V]`` logits) and return
a per-token ``[T]`` float32 loss, 0 outside ``mask``; gradients flow to the
student's hidden states and head only. Temperature divides every logit.

* :func:`fused_cross_entropy`   ``−log p(label)`` (SFT at 128K vocab);
* :func:`fused_forward_kl`      ``Σ_k ŵ_k KL(q_k ‖ p)`` (off-policy distillation);
* :func:`fused_jsd`             generalized JSD(β) (GKD, arXiv 2306.13649):
  ``β KL(q‖M) + (1−β) KL(p‖M)``, ``M = β q + (1−β) p``; β = 0 is taken as
  forward KL and β = 1 as reverse KL (the limits of the divergence divided by
  β resp. 1−β, Liger-Kernel's convention);
* :func:`fused_topk_kl`         top-k estimator: reverse KL restricted to each
  teacher's top-k tokens, student and teacher both renormalised there;
* :func:`fused_token_level_kl`  token-level estimator at the sampled token,
  ``log p(y) − Σ_k ŵ_k log q_k(y)`` (docs/DESIGN.md §3), whose gradient is
  ``∇ log p(y)``; a trainer uses its stop-gradient value as a per-token
  advantage.

``impl``: ``"chunked"`` (default on every backend for forward KL, JSD and
top-k), ``"reference"`` (materialised), and for cross-entropy / token-level
also ``"pallas"`` (they only need the statistics pass). ``"auto"`` picks
Pallas on TPU/GPU where available, else chunked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import api, chunked, divergence, inputs as inputs_lib, reference


def _chunk_v(impl: str, block_sizes) -> int:
  if impl not in ("auto", "chunked", "reference"):
    raise ValueError(f"impl={impl!r}: this loss supports 'auto', 'chunked' or 'reference'")
  if block_sizes is not None and not isinstance(block_sizes, chunked.ChunkSizes):
    raise ValueError(f"block_sizes={block_sizes!r}: expected a ChunkSizes")
  return (block_sizes or chunked.ChunkSizes()).block_v


def _teachers(inp):
  sg = jax.lax.stop_gradient
  return [sg(h) for h in inp.h_k], [sg(w) for w in inp.w_k]


def _masked(loss, mask):
  return loss if mask is None else jnp.where(mask, loss, 0.0)


def fused_cross_entropy(student_hidden, student_head, labels, mask=None, temperature=1.0,
                        impl: str = "auto", block_sizes=None) -> jax.Array:
  """Per-token ``−log softmax(h W / τ)[label]``: [T] float32.

  Args:
    student_hidden: [T, Ds]; student_head: [Ds, V].
    labels: [T] int ids in [0, V).
    mask: [T] or None; temperature: τ > 0.
    impl: ``"auto" | "pallas" | "chunked" | "reference"``.
    block_sizes: as for :func:`pallas_kernels.fused_reverse_kl`.
  """
  inp = inputs_lib.check_inputs(student_hidden, student_head, (), (), None, mask, temperature,
                                need_weights=False)
  labels = inputs_lib.check_ids(labels, "labels", inp.h_s.shape[0], inp.w_s.shape[1])
  if impl == "reference":
    return reference.cross_entropy_reference(inp.h_s, inp.w_s, labels, inp.mask, inp.temperature)
  stats = api.stats_function(impl, block_sizes)(inp.h_s, inp.w_s, [], [], inp.temperature)
  z_y = divergence.gather_logits(inp.h_s, inp.w_s, labels[:, None], inp.temperature)[:, 0]
  return _masked(stats.lse - z_y, inp.mask)


def fused_token_level_kl(student_hidden, student_head, teacher_hidden, teacher_heads,
                         teacher_weights, tokens, mask=None, temperature=1.0,
                         impl: str = "auto", block_sizes=None) -> jax.Array:
  """Token-level estimator ``log p(y_t) − Σ_k ŵ_k log q_k(y_t)``: [T] float32.

  Args: as :func:`pallas_kernels.fused_reverse_kl`, plus ``tokens`` [T] (the
  sampled ids ``y_t``). Tokens with all-zero weights or outside the mask give 0.
  """
  inp = inputs_lib.check_inputs(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, mask, temperature)
  tokens = inputs_lib.check_ids(tokens, "tokens", inp.h_s.shape[0], inp.w_s.shape[1])
  h_k, w_k = _teachers(inp)
  w_hat = inputs_lib.normalized_weights(jax.lax.stop_gradient(inp.weights), inp.mask)
  present = jnp.any(w_hat != 0, axis=1)
  if impl == "reference":
    est = reference.token_level_reference(inp.h_s, inp.w_s, h_k, w_k, w_hat, tokens,
                                          inp.temperature)
    return jnp.where(present, est, 0.0)
  stats = api.stats_function(impl, block_sizes)(inp.h_s, inp.w_s, h_k, w_k, inp.temperature)
  y = tokens[:, None]
  lp_y = divergence.gather_logits(inp.h_s, inp.w_s, y, inp.temperature)[:, 0] - stats.lse
  lq_y = jnp.stack([divergence.gather_logits(h, w, y, inp.temperature)[:, 0] for h, w in
                    zip(h_k, w_k)], axis=1) - jax.lax.stop_gradient(stats.lse_k)
  est = lp_y - jnp.sum(jnp.where(w_hat != 0, w_hat * lq_y, 0.0), axis=1)
  return jnp.where(present, est, 0.0)


def fused_forward_kl(student_hidden, student_head, teacher_hidden, teacher_heads,
                     teacher_weights, mask=None, temperature=1.0, impl: str = "auto",
                     block_sizes=None) -> jax.Array:
  """``Σ_k ŵ_k KL(q_k ‖ p)`` per token: [T] float32 (args as ``fused_reverse_kl``)."""
  return _two_pass(divergence.forward_kl_elements, reference.forward_kl_reference, (),
                   student_hidden, student_head, teacher_hidden, teacher_heads, teacher_weights,
                   mask, temperature, impl, block_sizes)


def fused_jsd(student_hidden, student_head, teacher_hidden, teacher_heads, teacher_weights,
              mask=None, temperature=1.0, beta: float = 0.5, impl: str = "auto",
              block_sizes=None) -> jax.Array:
  """Generalized ``Σ_k ŵ_k JSD_β(p, q_k)`` per token: [T] float32 (see module doc).

  ``beta`` in [0, 1]; 0 gives :func:`fused_forward_kl`, 1 gives
  :func:`pallas_kernels.fused_reverse_kl` (chunked).
  """
  beta = float(beta)
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"beta={beta} must lie in [0, 1]")
  if beta == 1.0:
    _chunk_v(impl, block_sizes)
    return api.fused_reverse_kl(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, mask, temperature,
                                impl="reference" if impl == "reference" else "chunked",
                                block_sizes=block_sizes)
  if beta == 0.0:
    return fused_forward_kl(student_hidden, student_head, teacher_hidden, teacher_heads,
                            teacher_weights, mask, temperature, impl, block_sizes)
  return _two_pass(divergence.jsd_elements(beta), reference.jsd_reference, (beta,),
                   student_hidden, student_head, teacher_hidden, teacher_heads, teacher_weights,
                   mask, temperature, impl, block_sizes)


def _two_pass(elem_fn, ref_fn, ref_args, student_hidden, student_head, teacher_hidden,
              teacher_heads, teacher_weights, mask, temperature, impl, block_sizes):
  block_v = _chunk_v(impl, block_sizes)
  inp = inputs_lib.check_inputs(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, mask, temperature)
  h_k, w_k = _teachers(inp)
  w_hat = inputs_lib.normalized_weights(jax.lax.stop_gradient(inp.weights), inp.mask)
  if impl == "reference":
    return _masked(ref_fn(inp.h_s, inp.w_s, h_k, w_k, w_hat, *ref_args, inp.temperature),
                   inp.mask)
  loss = divergence.elementwise_divergence(elem_fn, inp.h_s, inp.w_s, h_k, w_k, w_hat,
                                           inp.temperature, block_v)
  return _masked(loss, inp.mask)


def fused_topk_kl(student_hidden, student_head, teacher_hidden, teacher_heads, teacher_weights,
                  mask=None, temperature=1.0, top_k: int = 32, impl: str = "auto",
                  block_sizes=None) -> jax.Array:
  """Top-k reverse-KL estimator per token: [T] float32 (see module doc).

  For each teacher the support is its ``top_k`` highest logits; student and
  teacher are renormalised on it and ``Σ_k ŵ_k KL(p̃‖q̃_k)`` is returned.
  """
  block_v = _chunk_v(impl, block_sizes)
  inp = inputs_lib.check_inputs(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, mask, temperature)
  v = inp.w_s.shape[1]
  if not (isinstance(top_k, int) and 1 <= top_k <= v):
    raise ValueError(f"top_k={top_k!r} must be an int in [1, V={v}]")
  h_k, w_k = _teachers(inp)
  w_hat = inputs_lib.normalized_weights(jax.lax.stop_gradient(inp.weights), inp.mask)
  if impl == "reference":
    return _masked(reference.topk_kl_reference(inp.h_s, inp.w_s, h_k, w_k, w_hat, top_k,
                                               inp.temperature), inp.mask)
  kls = []
  for h, w in zip(h_k, w_k):
    x_top, idx = divergence.streaming_top_k(h, w, top_k, inp.temperature, block_v)
    z_top = divergence.gather_logits(inp.h_s, inp.w_s, idx, inp.temperature)
    lp = jax.nn.log_softmax(z_top, axis=-1)
    lq = jax.nn.log_softmax(x_top, axis=-1)
    kls.append(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1))
  kl = jnp.stack(kls, axis=1)
  return _masked(jnp.sum(jnp.where(w_hat != 0, w_hat * kl, 0.0), axis=1), inp.mask)
