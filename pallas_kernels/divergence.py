"""Chunked machinery for the companion divergences (forward KL, JSD, top-k).

Reverse KL is linear in ``p`` given the teachers, so one online pass
suffices (:mod:`pallas_kernels.chunked`). Divergences that are nonlinear in
the normalised distributions need the normalisers first:

* **two-pass elementwise divergences** ``L_t = Σ_v f(lp_v, lq_1,v .. lq_K,v)``
  (forward KL, generalized JSD): pass 1 is the statistics pass (``lse(z)``,
  ``lse(x_k)``); pass 2 folds the tiles again, accumulating ``Σ_v f`` and
  ``Σ_v ∂f/∂lp_v``. Since ``∂lp_u/∂z_v = δ_uv − p_v``, the backward pass needs
  only that per-token sum: ``∂L/∂z_v = ∂f/∂lp_v − p_v Σ_u ∂f/∂lp_u``.
  ``∂f/∂lp`` is taken per element with ``jax.jvp``, so a new divergence is
  one elementwise function.
* **streaming top-k** of each teacher's logits over vocabulary tiles (the
  running top-k merged with each tile's), for the top-k KL estimator.

Everything runs as ``lax.scan`` over ``[T, block_v]`` tiles: memory bounded
by a tile, never ``[T, V]``.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import chunked, tile_math

# f(lp [T, v], lqs: K x [T, v], w_hat [T, K]) -> [T, v] elementwise in lp.
ElementFn = Callable[[jax.Array, list, jax.Array], jax.Array]


def forward_kl_elements(lp, lqs, w_hat):
  """``Σ_k ŵ_k q_k (lq_k − lp)``: summed over v it is ``Σ_k ŵ_k KL(q_k‖p)``."""
  out = jnp.zeros_like(lp)
  for k, lq in enumerate(lqs):
    out = out + w_hat[:, k:k + 1] * jnp.exp(lq) * (lq - lp)
  return out


@functools.lru_cache(maxsize=None)
def jsd_elements(beta: float) -> ElementFn:
  """Generalized JSD ``β KL(q‖M) + (1−β) KL(p‖M)``, ``M = β q + (1−β) p``, per element.

  ``beta`` must lie strictly inside (0, 1); the endpoints are the forward /
  reverse KL limits and are dispatched elsewhere. Cached, so that equal
  betas share one compiled loss.
  """
  lb, l1b = jnp.log(beta), jnp.log1p(-beta)

  def f(lp, lqs, w_hat):
    out = jnp.zeros_like(lp)
    for k, lq in enumerate(lqs):
      lm = jnp.logaddexp(lb + lq, l1b + lp)
      out = out + w_hat[:, k:k + 1] * (beta * jnp.exp(lq) * (lq - lm)
                                       + (1 - beta) * jnp.exp(lp) * (lp - lm))
    return out
  return f


def _value_and_dlp(elem_fn, lp, lqs, w_hat):
  """(f, ∂f/∂lp) elementwise: a JVP with a ones tangent of an elementwise map."""
  return jax.jvp(lambda a: elem_fn(a, lqs, w_hat), (lp,), (jnp.ones_like(lp),))


def _second_pass(h_s, w_s, h_k, w_k, w_hat, lse, lse_k, *, elem_fn, inv_tau, block_v):
  """(Σ_v f [T], Σ_v ∂f/∂lp [T]) given the normalisers."""
  def step(carry, start, size):
    total, dsum = carry
    z, _ = chunked.logit_tile(h_s, w_s, start, size, inv_tau)
    xs = chunked.teacher_tiles(h_k, w_k, start, size, inv_tau)
    lqs = [x - lse_k[:, k:k + 1] for k, x in enumerate(xs)]
    f, dlp = _value_and_dlp(elem_fn, z - lse[:, None], lqs, w_hat)
    return total + jnp.sum(f, axis=1), dsum + jnp.sum(dlp, axis=1)

  t = h_s.shape[0]
  init = tile_math.match_vma((jnp.zeros((t,), jnp.float32),) * 2, h_s, w_s)
  return chunked.fold_tiles(step, init, w_s.shape[1], block_v)


@functools.lru_cache(maxsize=None)
def _elementwise_fn(elem_fn: ElementFn, temperature: float, block_v: int):
  static = dict(inv_tau=1.0 / temperature, block_v=block_v)
  stats_fn = functools.partial(chunked.vocab_stats_chunked, temperature=temperature,
                               sizes=chunked.ChunkSizes(block_v))

  def forward(h_s, w_s, h_k, w_k, w_hat):
    stats = stats_fn(h_s, w_s, h_k, w_k)
    total, dsum = _second_pass(h_s, w_s, h_k, w_k, w_hat, stats.lse, stats.lse_k,
                               elem_fn=elem_fn, **static)
    return total, (stats.lse, stats.lse_k, dsum)

  @jax.custom_vjp
  def loss(h_s, w_s, h_k, w_k, w_hat):
    return forward(h_s, w_s, h_k, w_k, w_hat)[0]

  def fwd(h_s, w_s, h_k, w_k, w_hat):
    total, res = forward(h_s, w_s, h_k, w_k, w_hat)
    return total, (h_s, w_s, h_k, w_k, w_hat, res)

  def bwd(res, g):
    h_s, w_s, h_k, w_k, w_hat, (lse, lse_k, dsum) = res

    def dz_fn(z, start, size):
      xs = chunked.teacher_tiles(h_k, w_k, start, size, static["inv_tau"])
      lp = z - lse[:, None]
      _, dlp = _value_and_dlp(elem_fn, lp, [x - lse_k[:, k:k + 1] for k, x in enumerate(xs)],
                              w_hat)
      return g[:, None] * (dlp - jnp.exp(lp) * dsum[:, None])

    dh, dw = chunked.backward_tiles(h_s, w_s, dz_fn, **static)
    return dh, dw, None, None, None

  loss.defvjp(fwd, bwd)
  return loss


def elementwise_divergence(elem_fn: ElementFn, h_s, w_s, h_k, w_k, w_hat, temperature: float,
                           block_v: int) -> jax.Array:
  """``Σ_v f(lp, lq)`` per token, chunked, differentiable w.r.t. ``h_s``, ``w_s``.

  Args:
    elem_fn: elementwise divergence (e.g. :func:`forward_kl_elements`); it
      must be hashable (a module-level function or a cached closure).
    h_s: [T, Ds]; w_s: [Ds, V]; h_k / w_k: K arrays [T, Dt_k] / [Dt_k, V].
    w_hat: [T, K] teacher weights (zero rows give zero loss).
    temperature: τ > 0.
    block_v: vocabulary tile.

  Returns:
    [T] float32.
  """
  return _elementwise_fn(elem_fn, float(temperature), int(block_v))(
      h_s, w_s, tuple(h_k), tuple(w_k), w_hat)


def streaming_top_k(h, w, top_k: int, temperature: float, block_v: int):
  """Top-k logits of ``h W / τ`` per row without materialising ``[T, V]``.

  Args:
    h: [T, D]; w: [D, V]; top_k <= V; temperature: τ; block_v: tile.

  Returns:
    (values [T, top_k] f32 descending, indices [T, top_k] int32).
  """
  inv_tau = 1.0 / temperature

  def step(carry, start, size):
    vals, idx = carry
    x, _ = chunked.logit_tile(h, w, start, size, inv_tau)
    cand = jnp.concatenate([vals, x], axis=1)
    cand_idx = jnp.concatenate(
        [idx, jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), x.shape)], axis=1)
    vals, pos = lax.top_k(cand, top_k)
    return vals, jnp.take_along_axis(cand_idx, pos, axis=1)

  t = h.shape[0]
  init = (jnp.full((t, top_k), -jnp.inf, jnp.float32), jnp.zeros((t, top_k), jnp.int32))
  return chunked.fold_tiles(step, init, w.shape[1], block_v)


def gather_logits(h, w, idx, temperature: float) -> jax.Array:
  """Logits at given vocabulary ids, ``(h W)[t, idx[t, j]] / τ``: [T, n] f32.

  One ``[T, D]`` column gather per j (``lax.map``), so memory stays
  ``O(T D)`` however many ids are gathered; differentiable (the gradient
  w.r.t. ``w`` is a scatter-add of those columns).
  """
  def one(col):
    return jnp.einsum("TD,DT->T", h, jnp.take(w, col, axis=1),
                      preferred_element_type=jnp.float32) / temperature
  return lax.map(one, idx.T).T
