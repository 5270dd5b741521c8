"""Gradient-in-forward training entry of the fused reverse KL (docs/DESIGN.md §4).

For training the reduction over tokens is known in advance::

    loss = Σ_t c_t L_t,   L_t = Σ_k ŵ_{t,k} KL(p_t ‖ q_{t,k}),

with ``c`` a per-token coefficient (e.g. mask / token count) and ``ŵ`` the
renormalised teacher weights. :func:`fused_reverse_kl_train` computes the
loss, ``dL/dh_s`` and ``dL/dW_s`` in ONE pass over token chunks × vocabulary
tiles; its ``custom_vjp`` backward only scales the saved gradients by the
incoming scalar cotangent (as Liger-Kernel's fused linear losses do). With
``z = h_s W_s / τ``, ``y = Σ_k ŵ_k x_k`` and ``b = z − y``::

    ∂L_t/∂z_v = c_t p_v (b_v − E_p[b]),
    dh_s = τ⁻¹ (∂L/∂z) W_sᵀ,   dW_s = τ⁻¹ h_sᵀ (∂L/∂z).

Head matmuls: ``1 + K`` logit products plus 2 gradient products, against
``2(1 + K) + 2`` for ``fused_reverse_kl`` under ``jax.grad``, whose backward
recomputes every logit tile.

Implementations are "grads functions" (:data:`GRADS_FUNCTIONS`, keyed by
``impl``) with one signature::

    grads_fn(h_s, w_s, h_k, w_k, w_hat, coef, *, temperature, sizes, shared_head)
        -> TrainOut(loss, kl, ent, dh_s, dw_s)

* ``h_s`` [T, Ds], ``w_s`` [Ds, V] (any float dtype);
* ``h_k`` / ``w_k``: tuples of K arrays [T, Dt_k] / [Dt_k, V]; with
  ``shared_head=True`` every ``w_k[i]`` is the same head (and every Dt_k
  equal), so an implementation may use ``w_k[0]`` for all K teachers and
  compute a tile's teacher logits as one ``[K·C, Dt] × [Dt, tile]`` product;
* ``w_hat`` [T, K] float32: renormalised weights (rows sum to 1, or all 0 for
  a token that is absent; NaN rows for bad weights must give a NaN loss);
* ``coef`` [T] float32: ``c_t``, already 0 on every token whose ``w_hat``
  row is 0 (the caller guarantees it), so an implementation never needs a
  separate mask; ``∂L/∂z = c·p·(b − E_p[b])`` is then exactly 0 there;
* ``temperature``: Python float τ > 0; ``sizes``: the implementation's
  block-size object or None (defaults);
* returns float32 ``loss`` [] ``= Σ_t c_t Σ_k [ŵ_tk ≠ 0] ŵ_tk KL_tk``,
  ``kl`` [T, K] per-teacher ``KL(p ‖ q_k)`` and ``ent`` [T] student entropy
  for every token (the caller masks them), ``dh_s`` [T, Ds] in ``h_s.dtype``
  and ``dw_s`` [Ds, V] in ``w_s.dtype``. Teachers get no gradient.

``"reference"`` materialises ``[T, V]`` logits and differentiates the loss
with ``jax.grad``; ``"chunked"`` (:func:`train_grads_chunked`) scans token
chunks of ``block_t`` rows and, inside each, vocabulary tiles twice: pass 1
computes the tile's ``z`` and ``b`` (1 + K matmuls) into a ``[C, V]`` buffer
pair and folds them into the online statistics of
:mod:`pallas_kernels.tile_math`; pass 2 walks the buffers once the
per-token normaliser is known and accumulates ``dh_s`` and ``dW_s`` (2
matmuls). ``"pallas"`` is ``pallas_kernels.pallas_train.train_grads_pallas``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import api, chunked, inputs as inputs_lib, reference, tile_math


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


# Default memory budget of the chunk buffers: (2 + K)·32 MiB, i.e. the
# per-token chunked path's (4 + 2K)·T·block_v·4 bytes of tiles at T = 2048,
# block_v = 2048 (96 MiB at K = 1, 160 MiB at K = 3).
BUFFER_BUDGET_PER_TEACHER = 2 ** 25


@dataclasses.dataclass(frozen=True)
class TrainChunkSizes:
  """Block sizes of the chunked training path.

  Attributes:
    block_t: tokens per chunk ``C``, or None: the largest multiple of 8 with
      the chunk's ``[C, V]`` float32 ``z`` / ``b`` buffers (``2·C·V·4``
      bytes, :func:`default_block_t`) within ``(2 + K)·32 MiB`` — no more
      than the per-token chunked path's ``(4 + 2K)·T·block_v·4`` bytes of
      tiles at T = 2048 (C = 96 at K = 1 and 160 at K = 3 for V = 131072).
      Larger C means fewer read-modify-writes of ``dW_s`` (one per chunk).
    block_v: vocabulary columns per tile of both passes.
  """
  block_t: int | None = None
  block_v: int = 2048

  def __post_init__(self):
    for name in ("block_t", "block_v"):
      val = getattr(self, name)
      if name == "block_t" and val is None:
        continue
      if not (isinstance(val, int) and val > 0):
        raise ValueError(f"TrainChunkSizes.{name}={val!r} must be a positive int")


def default_block_t(num_teachers: int, vocab: int, buffers: int = 2) -> int:
  """C with ``buffers·C·V·4`` bytes within ``(2 + K)·32 MiB`` (multiple of 8, >= 8)."""
  c = (2 + num_teachers) * BUFFER_BUDGET_PER_TEACHER // (4 * buffers * vocab)
  return max(8, c // 8 * 8)


def fold_chunks(body, carry, t: int, block_t: int):
  """``carry, ys = body(carry, start, size)`` over token chunks; ys concatenated
  along T (one ``lax.scan`` over full chunks plus one static remainder chunk)."""
  bt = min(block_t, t)
  n_full, rem = t // bt, t % bt
  carry, ys = lax.scan(lambda c, i: body(c, i * bt, bt), carry, jnp.arange(n_full))
  ys = jax.tree.map(lambda a: a.reshape(n_full * bt, *a.shape[2:]), ys)
  if rem:
    carry, ys_rem = body(carry, n_full * bt, rem)
    ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys, ys_rem)
  return carry, ys


def gradient_pass(g_tile, h_c, w_s, dw, block_v: int):
  """Pass 2 of a chunk: ``dh_c = Σ_tiles g W_tileᵀ`` and ``dW_tile += h_cᵀ g``.

  Args:
    g_tile: ``g_tile(start, size) -> [C, size]`` f32 gradient w.r.t. the
      tile's logits ``h W``, chain-rule factor 1/τ and ``c`` included.
    h_c: [C, Ds]; w_s: [Ds, V]; dw: [Ds, V] f32, updated in place per tile.

  Returns:
    ``(dh_c [C, Ds] f32, dw)``.
  """
  mm_dtype = jnp.promote_types(h_c.dtype, w_s.dtype)

  def step(carry, start, size):
    dh, dw = carry
    g = g_tile(start, size).astype(mm_dtype)
    w_t = lax.dynamic_slice_in_dim(w_s, start, size, axis=1)
    dh = dh + jnp.einsum("TV,DV->TD", g, w_t, preferred_element_type=jnp.float32)
    dw_t = lax.dynamic_slice_in_dim(dw, start, size, axis=1) + jnp.einsum(
        "TD,TV->DV", h_c, g, preferred_element_type=jnp.float32)
    return dh, lax.dynamic_update_slice_in_dim(dw, dw_t, start, axis=1)

  dh0 = tile_math.match_vma(jnp.zeros(h_c.shape, jnp.float32), h_c, w_s)
  return chunked.fold_tiles(step, (dh0, dw), w_s.shape[1], block_v)


def _chunk_pass(h_c, w_s, hk_c, w_k, wh_c, c_c, dw, *, inv_tau, block_v, shared_head):
  """Both vocabulary passes of one token chunk.

  Args:
    h_c: [C, Ds]; hk_c: K arrays [C, Dt_k]; wh_c: [C, K] ŵ; c_c: [C] c.
    dw: [Ds, V] float32 running ``dW_s`` (columns updated in place).

  Returns:
    ``(dw, (dh_c [C, Ds] f32, lse [C], ent [C], e_k [C, K], lse_k [C, K]))``.
  """
  rows, k, vocab = h_c.shape[0], len(hk_c), w_s.shape[1]
  hk_stack = jnp.concatenate(hk_c, axis=0) if shared_head and k > 1 else None  # [K·C, Dt]

  def teacher_logits(start, size):
    if hk_stack is not None:  # one [K·C, Dt] x [Dt, tile] product: the tile is loaded once
      x = chunked.logit_tile(hk_stack, w_k[0], start, size, inv_tau)[0]
      return [x[i * rows:(i + 1) * rows] for i in range(k)]
    return chunked.teacher_tiles(hk_c, w_k, start, size, inv_tau)

  # Pass 1: z and b = z − Σ_k ŵ_k x_k of every tile into the buffers, plus the
  # online statistics (running max, Σe^{z−m}, E_p[z − x_k], lse_k).
  def pass1(carry, start, size):
    acc, zbuf, bbuf = carry
    z, _ = chunked.logit_tile(h_c, w_s, start, size, inv_tau)
    xs = teacher_logits(start, size)
    acc = tile_math.acc_update(acc, z, xs, None)
    b = z
    for i, x in enumerate(xs):
      b = b - wh_c[:, i:i + 1] * x
    zbuf = lax.dynamic_update_slice_in_dim(zbuf, z, start, axis=1)
    return acc, zbuf, lax.dynamic_update_slice_in_dim(bbuf, b, start, axis=1)

  buf = jnp.zeros((rows, vocab), jnp.float32)
  init = tile_math.match_vma((tile_math.acc_init(rows, k), buf, buf), h_c, w_s)
  acc, zbuf, bbuf = chunked.fold_tiles(pass1, init, vocab, block_v)
  lse, ent, e_k, lse_k = tile_math.acc_finalize(acc)
  # E_p[b] = Σ_k ŵ_k E_p[z − x_k] (Σ_k ŵ_k = 1 wherever c ≠ 0).
  e_b = sum((wh_c[:, i:i + 1] * e for i, e in enumerate(e_k)), jnp.zeros_like(lse))
  g_scale = (c_c * inv_tau)[:, None]  # chain rule through z = h W / τ

  # Pass 2: ∂L/∂z = c p (b − E_p[b]) per tile.
  def g_tile(start, size):
    z = lax.dynamic_slice_in_dim(zbuf, start, size, axis=1)
    b = lax.dynamic_slice_in_dim(bbuf, start, size, axis=1)
    return g_scale * jnp.exp(z - lse) * (b - e_b)

  dh, dw = gradient_pass(g_tile, h_c, w_s, dw, block_v)
  st = tile_math.stats_from_columns(lse, ent, e_k, lse_k, k)
  return dw, (dh, st.lse, st.ent, st.e_k, st.lse_k)


def train_grads_chunked(h_s, w_s, h_k, w_k, w_hat, coef, *, temperature: float,
                        sizes: TrainChunkSizes | None = None,
                        shared_head: bool = False) -> TrainOut:
  """Token chunks × vocabulary tiles in ``lax.scan`` (module docstring).

  Transient memory: the ``[C, V]`` float32 ``z`` / ``b`` buffers
  (:class:`TrainChunkSizes`), a few ``[C, block_v]`` tiles, and the
  gradients themselves (``dW_s`` accumulates in float32). No head is padded
  or copied: a remainder chunk and a remainder tile are static-size calls.
  """
  if sizes is not None and not isinstance(sizes, TrainChunkSizes):
    raise ValueError(f"block_sizes={sizes!r}: impl='chunked' takes a TrainChunkSizes")
  sizes = sizes or TrainChunkSizes()
  inv_tau = 1.0 / temperature
  t = h_s.shape[0]
  run = functools.partial(_chunk_pass, w_s=w_s, w_k=w_k, inv_tau=inv_tau,
                          block_v=sizes.block_v, shared_head=shared_head)

  def body(dw, start, size):
    rows = lambda a: lax.dynamic_slice_in_dim(a, start, size, axis=0)
    return run(rows(h_s), hk_c=[rows(h) for h in h_k], wh_c=rows(w_hat), c_c=rows(coef), dw=dw)

  dw0 = tile_math.match_vma(jnp.zeros(w_s.shape, jnp.float32), h_s, w_s)
  block_t = sizes.block_t or default_block_t(len(h_k), w_s.shape[1])
  dw, (dh, lse, ent, e_k, lse_k) = fold_chunks(body, dw0, t, block_t)
  kl = tile_math.kl_from_stats(tile_math.Stats(lse, ent, e_k, lse_k))
  return TrainOut(weighted_loss(coef, w_hat, kl), kl, ent, dh.astype(h_s.dtype),
                  dw.astype(w_s.dtype))


def _pallas(*args, **kwargs) -> TrainOut:
  from pallas_kernels import pallas_train  # lazy: Pallas is imported only when asked for
  return pallas_train.train_grads_pallas(*args, **kwargs)


GRADS_FUNCTIONS: dict[str, Callable[..., TrainOut]] = {
    "reference": train_grads_reference, "chunked": train_grads_chunked, "pallas": _pallas}


def grads_function(impl: str) -> Callable[..., TrainOut]:
  """The grads function of ``impl`` (``"auto"``: Pallas on TPU/GPU, else chunked)."""
  return GRADS_FUNCTIONS[api.resolve_impl(impl)]


def saved_gradient_vjp(run):
  """``f(h_s, w_s, rest) -> outs`` with ``(outs, (dh_s, dw_s)) = run(h_s, w_s, rest)``.

  ``outs[0]`` is the scalar loss; the VJP w.r.t. ``(h_s, w_s)`` is the saved
  gradient times the loss cotangent (the other outputs must leave through
  ``stop_gradient``: their cotangents are ignored). ``rest`` (a tuple of
  arrays) gets no gradient. Shared by every gradient-in-forward loss.
  """
  @jax.custom_vjp
  def f(h_s, w_s, rest):
    return run(h_s, w_s, rest)[0]

  def fwd(h_s, w_s, rest):
    return run(h_s, w_s, rest)

  def bwd(grads, g):
    scale = lambda d: (d.astype(jnp.float32) * g[0]).astype(d.dtype)
    return scale(grads[0]), scale(grads[1]), None

  f.defvjp(fwd, bwd)
  return f


@functools.lru_cache(maxsize=None)
def _train_fn(impl: str, sizes, temperature: float, shared_head: bool):
  """Jitted ``f(h_s, w_s, (h_k, w_k, w_hat, coef)) -> (loss, kl, ent)`` of ``impl``."""
  grads_fn = functools.partial(GRADS_FUNCTIONS[impl], temperature=temperature, sizes=sizes,
                               shared_head=shared_head)

  def run(h_s, w_s, rest):
    out = grads_fn(h_s, w_s, *rest)
    return (out.loss, out.kl, out.ent), (out.dh_s, out.dw_s)
  return jax.jit(saved_gradient_vjp(run))


def check_coef(coef, t: int) -> jax.Array:
  """[T] float32 coefficients; ValueError on a bad shape / dtype / value."""
  c = jnp.asarray(coef)
  if c.shape != (t,):
    raise ValueError(f"coef.shape={c.shape}: expected [T]=({t},) from student_hidden")
  if not (jnp.issubdtype(c.dtype, jnp.floating) or jnp.issubdtype(c.dtype, jnp.integer)
          or c.dtype == jnp.bool_):
    raise ValueError(f"coef.dtype={c.dtype}: expected a real dtype")
  if not isinstance(c, jax.core.Tracer):
    cn = np.asarray(c, np.float64)
    bad = ~np.isfinite(cn)
    if bad.any():
      i = int(np.argwhere(bad)[0, 0])
      raise ValueError(f"coef must be finite; coef[{i}]={cn[i]} ({int(bad.sum())} bad entries)")
  return c.astype(jnp.float32)


def _shared(teacher_heads, shared_head) -> bool:
  """Whether every teacher uses one head: the flag, else identity of the arrays."""
  if shared_head is not None:
    if not isinstance(shared_head, bool):
      raise ValueError(f"shared_head={shared_head!r}: expected True, False or None")
    return shared_head
  return (isinstance(teacher_heads, (list, tuple)) and len(teacher_heads) > 1
          and all(w is teacher_heads[0] for w in teacher_heads))


def fused_reverse_kl_train(student_hidden, student_head, teacher_hidden, teacher_heads,
                           teacher_weights, coef, temperature=1.0, impl: str = "auto",
                           block_sizes=None, shared_head: bool | None = None,
                           return_aux: bool = False):
  """Scalar training loss ``Σ_t c_t Σ_k ŵ_tk KL(p_t ‖ q_tk)``, gradient in forward.

  Equal in value and gradient to
  ``jnp.sum(coef * fused_reverse_kl(..., mask=coef != 0))``, at 1 + K + 2
  head matmuls instead of 2(1 + K) + 2 (module docstring).

  Args:
    student_hidden: [T, Ds]; student_head: [Ds, V].
    teacher_hidden: [K, T, Dt] or K arrays [T, Dt_k].
    teacher_heads: [K, Dt, V] or K arrays [Dt_k, V].
    teacher_weights: [T, K], >= 0; renormalised per token over the teachers
      with non-zero weight (all-zero row: the token contributes 0).
    coef: [T] finite per-token coefficients ``c_t`` (e.g. ``mask / n``). A
      token with ``c_t = 0`` is outside the loss (and its aux values are 0).
      No gradient flows to it.
    temperature: τ > 0.
    impl: ``"auto" | "pallas" | "chunked" | "reference"``.
    block_sizes: the implementation's sizes (:class:`TrainChunkSizes`
      for chunked, ``pallas_train``'s for Pallas), None for defaults.
    shared_head: True if all K teachers use one head array (the shared-head
      fast path loads each head tile once for all K); None detects it when
      ``teacher_heads`` is a sequence holding the same array object K times
      (under ``jit``, pass the flag: K jit arguments are K distinct tracers).
    return_aux: also return ``{"kl": [T, K], "entropy": [T]}`` (0 where
      ``c_t = 0``; stop-gradient).

  Returns:
    ``loss`` [] float32, or ``(loss, aux)``. Differentiable w.r.t.
    ``student_hidden`` and ``student_head`` only.

  Raises:
    ValueError: as ``fused_reverse_kl``, plus a bad ``coef`` (shape, dtype,
      non-finite value), ``shared_head=True`` with heads of different shapes,
      or ``block_sizes`` of the wrong type.
  """
  shared = _shared(teacher_heads, shared_head)
  inp = inputs_lib.check_inputs(student_hidden, student_head, teacher_hidden, teacher_heads,
                                teacher_weights, None, temperature)
  impl = api.resolve_impl(impl)
  if shared and any(w.shape != inp.w_k[0].shape for w in inp.w_k):
    raise ValueError(f"shared_head=True but teacher_heads have shapes "
                     f"{[tuple(w.shape) for w in inp.w_k]}")
  c = jax.lax.stop_gradient(check_coef(coef, inp.h_s.shape[0]))
  keep = c != 0
  w_hat = inputs_lib.normalized_weights(jax.lax.stop_gradient(inp.weights), keep)
  # c_eff: 0 where no teacher is present (the grads-function contract); NaN
  # weights (only reachable under jit) compare != 0 and so keep their c.
  c_eff = jnp.where(jnp.any(w_hat != 0, axis=1), c, 0.0)
  h_k = tuple(jax.lax.stop_gradient(h) for h in inp.h_k)
  w_k = tuple(jax.lax.stop_gradient(w) for w in inp.w_k)
  fn = _train_fn(impl, block_sizes, inp.temperature, shared)
  loss, kl, ent = fn(inp.h_s, inp.w_s, (h_k, w_k, w_hat, c_eff))
  if not return_aux:
    return loss
  aux = {"kl": jnp.where(keep[:, None], jax.lax.stop_gradient(kl), 0.0),
         "entropy": jnp.where(keep, jax.lax.stop_gradient(ent), 0.0)}
  return loss, aux
