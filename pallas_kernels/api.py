"""Public entry point: the fused LM-head + multi-teacher reverse KL (docs/DESIGN.md §3–4).

``fused_reverse_kl`` validates its inputs, computes the per-token vocabulary
statistics with the chosen implementation and turns them into

    loss_t = Σ_k ŵ_{t,k} KL(p_s,t ‖ q_k,t),   KL_k = E_p[z − x_k] − lse(z) + lse(x_k),

with ``ŵ`` the weights renormalised over the teachers present. Implementations:

* ``"pallas"``: Pallas kernels (TPU tiled / GPU looped layout; interpret mode
  on CPU), :mod:`pallas_kernels.pallas_kl`;
* ``"chunked"``: ``lax.scan`` over vocabulary tiles, any backend,
  :mod:`pallas_kernels.chunked`;
* ``"reference"``: materialised ``[T, V]`` logits, :mod:`pallas_kernels.reference`;
* ``"auto"``: Pallas on TPU / GPU, chunked on CPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import chunked, inputs as inputs_lib, pallas_kl, reference, tile_math
from pallas_kernels.tile_math import Stats

IMPLS = ("auto", "pallas", "chunked", "reference")


def resolve_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
  if impl == "auto":
    return "pallas" if jax.default_backend() in ("tpu", "gpu", "cuda", "rocm") else "chunked"
  return impl


def stats_function(impl: str, block_sizes=None):
  """``f(h_s, w_s, h_k, w_k, temperature) -> Stats`` for ``impl``.

  ``block_sizes`` is a :class:`pallas_kl.BlockSizes` for ``"pallas"`` and a
  :class:`chunked.ChunkSizes` for ``"chunked"`` (None: defaults).
  """
  impl = resolve_impl(impl)
  if impl == "pallas":
    if block_sizes is not None and not isinstance(block_sizes, pallas_kl.BlockSizes):
      raise ValueError(f"block_sizes={block_sizes!r}: impl='pallas' takes a BlockSizes")
    return functools.partial(pallas_kl.vocab_stats_pallas, block_sizes=block_sizes)
  if impl == "chunked":
    if block_sizes is not None and not isinstance(block_sizes, chunked.ChunkSizes):
      raise ValueError(f"block_sizes={block_sizes!r}: impl='chunked' takes a ChunkSizes")
    return functools.partial(chunked.vocab_stats_chunked, sizes=block_sizes)
  if block_sizes is not None:
    raise ValueError(f"block_sizes={block_sizes!r}: impl='reference' takes no block sizes")
  return reference.vocab_stats_reference


def loss_from_stats(stats: Stats, w_hat: jax.Array, mask: jax.Array | None, return_aux: bool):
  """Weighted reverse KL from the statistics (see module docstring).

  Args:
    stats: vocabulary statistics ([T], [T, K]).
    w_hat: [T, K] renormalised weights (all-zero rows for absent tokens).
    mask: [T] bool or None.
    return_aux: also return ``{"kl": [T, K], "entropy": [T]}``.
  """
  kl = tile_math.kl_from_stats(stats)  # [T, K]
  # `where`, not a bare product: an absent teacher or token contributes an
  # exact 0 even if its statistics were inf. NaN weights (bad input under
  # jit) compare != 0 and so propagate into the loss.
  loss = jnp.sum(jnp.where(w_hat != 0, w_hat * kl, 0.0), axis=1)
  if not return_aux:
    return loss
  keep = jnp.ones_like(loss, bool) if mask is None else mask
  aux = {"kl": jnp.where(keep[:, None], kl, 0.0), "entropy": jnp.where(keep, stats.ent, 0.0)}
  return loss, aux


def fused_reverse_kl(student_hidden, student_head, teacher_hidden, teacher_heads,
                     teacher_weights, mask=None, temperature=1.0, impl: str = "auto",
                     block_sizes=None, return_aux: bool = False):
  """Per-token multi-teacher reverse KL from hidden states and output heads.

  Never materialises ``[T, V]`` logits (except ``impl="reference"``).

  Args:
    student_hidden: [T, Ds] student last hidden states.
    student_head: [Ds, V] student output head.
    teacher_hidden: [K, T, Dt], or a sequence of K arrays [T, Dt_k] (widths
      may differ).
    teacher_heads: [K, Dt, V], or a sequence of K arrays [Dt_k, V].
    teacher_weights: [T, K], >= 0. Renormalised per token over the teachers
      with non-zero weight; a token whose weights are all 0 gives loss 0.
    mask: [T] bool / 0-1, or None. Tokens outside it give 0 (and zero
      gradient).
    temperature: τ > 0; divides every logit (student and teachers).
    impl: ``"auto" | "pallas" | "chunked" | "reference"``.
    block_sizes: :class:`pallas_kl.BlockSizes` (pallas) or
      :class:`chunked.ChunkSizes` (chunked); None for defaults.
    return_aux: also return ``{"kl": [T, K] per-teacher reverse KL,
      "entropy": [T] student entropy}`` (0 outside the mask).

  Returns:
    ``loss`` [T] float32, or ``(loss, aux)``. Gradients flow to
    ``student_hidden`` and ``student_head`` only.

  Raises:
    ValueError: mismatched T / K / V / widths, negative or non-finite
      weights, non-finite hidden states (values are checked when the inputs
      are concrete; under ``jit`` a bad weight row gives a NaN loss instead).
  """
  inp = inputs_lib.check_inputs(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, mask, temperature)
  stats_fn = stats_function(impl, block_sizes)
  h_k = [jax.lax.stop_gradient(h) for h in inp.h_k]
  w_k = [jax.lax.stop_gradient(w) for w in inp.w_k]
  stats = stats_fn(inp.h_s, inp.w_s, h_k, w_k, inp.temperature)
  w_hat = inputs_lib.normalized_weights(jax.lax.stop_gradient(inp.weights), inp.mask)
  return loss_from_stats(stats, w_hat, inp.mask, return_aux)
