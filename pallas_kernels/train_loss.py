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
``impl``; the contract, ``TrainOut`` and the reference live in
:mod:`pallas_kernels.train_grads`, below every implementation) with one
signature::

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
with ``jax.grad``; ``"chunked"`` (:func:`train_grads_chunked`) scans equal
token chunks of at most ``block_t`` rows and, inside each, vocabulary tiles
twice: pass 1 computes the tile's ``z`` and ``x_k`` (1 + K matmuls), folds
them into the online statistics of :mod:`pallas_kernels.tile_math` and
stores ``e = exp(z − m_j)`` (``m_j`` the running max after tile j) and ``b``
in a ``[C, V]`` buffer pair; pass 2 walks the buffers once the per-token
normaliser is known, forms ``∂L/∂z = c e exp(m_j − lse) (b − E_p[b])`` (no
second exp per logit) and accumulates ``dh_s`` and ``dW_s`` (2 matmuls).
``"pallas"`` is ``pallas_kernels.pallas_train.train_grads_pallas``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import api, chunked, inputs as inputs_lib, pallas_train, tile_math
from pallas_kernels.train_grads import TrainOut, train_grads_reference, weighted_loss


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
      T is then split into equal chunks of at most this many rows
      (:func:`balanced_block_t`). Larger C means fewer passes over the heads
      and over ``dW_s`` (one of each per chunk), so larger, faster matmuls.
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


class _Chunk(NamedTuple):
  """Token inputs of one chunk of C rows."""
  h: jax.Array        # [C, Ds] student hidden states
  hk: tuple           # K arrays [C, Dt_k] teacher hidden states
  wh: jax.Array       # [C, K] ŵ
  c: jax.Array        # [C] c


class _Normaliser(NamedTuple):
  """What pass 2 of a chunk needs once its pass 1 has seen the whole vocabulary."""
  h: jax.Array        # [C, Ds] the chunk's student hidden states
  lse: jax.Array      # [C, 1] lse(z)
  e_b: jax.Array      # [C, 1] E_p[b] = Σ_k ŵ_k E_p[z − x_k]
  g_scale: jax.Array  # [C, 1] c / τ (chain rule through z = h W / τ)


def _pass1(w_s, w_k, bufs, chunk: _Chunk, *, inv_tau, block_v, shared_head):
  """Pass 1 of a chunk: the 1 + K logit matmuls per vocabulary tile, the online
  statistics (running max m, Σe^{z−m}, E_p[z − x_k], lse_k) and the buffers.

  Args:
    bufs: ``(ebuf [C, V], bbuf [C, V], mbuf [C, n_tiles])`` float32, filled
      per tile j with ``e = exp(z − m_j)`` (``m_j`` the running max after
      tile j), ``b = z − Σ_k ŵ_k x_k`` and ``m_j``.

  Returns:
    ``(bufs, (lse, ent, e_k, lse_k))``, columns [C, 1] (lists of K for e_k / lse_k).
  """
  rows, k = chunk.h.shape[0], len(chunk.hk)
  bv = min(block_v, w_s.shape[1])
  hk_stack = jnp.concatenate(chunk.hk, axis=0) if shared_head and k > 1 else None  # [K·C, Dt]

  def teacher_logits(start, size):
    if hk_stack is not None:  # one [K·C, Dt] x [Dt, tile] product: the tile is loaded once
      x = chunked.logit_tile(hk_stack, w_k[0], start, size, inv_tau)[0]
      return [x[i * rows:(i + 1) * rows] for i in range(k)]
    return chunked.teacher_tiles(chunk.hk, w_k, start, size, inv_tau)

  def step(carry, start, size):
    acc, (ebuf, bbuf, mbuf) = carry
    z, _ = chunked.logit_tile(chunk.h, w_s, start, size, inv_tau)
    xs = teacher_logits(start, size)
    acc = tile_math.acc_update(acc, z, xs, None)
    # exp(z − m_j) is the expression acc_update sums: XLA computes it once, and
    # pass 2 gets p = e · exp(m_j − lse) without a second exp per logit.
    e = jnp.exp(z - acc.m)
    b = z
    for i, x in enumerate(xs):
      b = b - chunk.wh[:, i:i + 1] * x
    return acc, (lax.dynamic_update_slice_in_dim(ebuf, e, start, axis=1),
                 lax.dynamic_update_slice_in_dim(bbuf, b, start, axis=1),
                 lax.dynamic_update_slice_in_dim(mbuf, acc.m, start // bv, axis=1))

  acc0 = tile_math.match_vma(tile_math.acc_init(rows, k), chunk.h, w_s)
  acc, bufs = chunked.fold_tiles(step, (acc0, bufs), w_s.shape[1], block_v)
  return bufs, tile_math.acc_finalize(acc)


def _pass2(w_s, bufs, dw, prev: _Normaliser, *, block_v):
  """Pass 2 of a chunk: per tile ``∂L/∂z = c p (b − E_p[b])`` with
  ``p = e · exp(m_j − lse)``, then ``dh += g W_tileᵀ`` and ``dW_tile += hᵀ g``
  (the 2 gradient matmuls; 1/τ is in ``g_scale``).

  Returns:
    ``(dw, dh [C, Ds] f32)``.
  """
  ebuf, bbuf, mbuf = bufs
  bv = min(block_v, w_s.shape[1])

  def g_tile(start, size):
    e = lax.dynamic_slice_in_dim(ebuf, start, size, axis=1)
    b = lax.dynamic_slice_in_dim(bbuf, start, size, axis=1)
    m_j = lax.dynamic_slice_in_dim(mbuf, start // bv, 1, axis=1)
    return (prev.g_scale * jnp.exp(m_j - prev.lse)) * e * (b - prev.e_b)

  dh, dw = gradient_pass(g_tile, prev.h, w_s, dw, block_v)
  return dw, dh


def _normaliser(chunk: _Chunk, cols, inv_tau) -> _Normaliser:
  lse, _, e_k, _ = cols
  # E_p[b] = Σ_k ŵ_k E_p[z − x_k] (Σ_k ŵ_k = 1 wherever c ≠ 0).
  e_b = sum((chunk.wh[:, i:i + 1] * e for i, e in enumerate(e_k)), jnp.zeros_like(lse))
  return _Normaliser(chunk.h, lse, e_b, (chunk.c * inv_tau)[:, None])


def balanced_block_t(t: int, block_t: int) -> int:
  """Rows per chunk when T takes ``n = ceil(T / block_t)`` chunks of equal size:
  ``ceil(T / n)``, rounded up to a multiple of 8 when ``block_t`` is one (still
  <= block_t), so the zero rows padding T to ``n·C`` are fewer than ``n·8``."""
  if t <= block_t:
    return t
  n = -(-t // block_t)
  c = -(-t // n)
  return -(-c // 8) * 8 if block_t % 8 == 0 else c


def train_grads_chunked(h_s, w_s, h_k, w_k, w_hat, coef, *, temperature: float,
                        sizes: TrainChunkSizes | None = None,
                        shared_head: bool = False) -> TrainOut:
  """Token chunks × vocabulary tiles in ``lax.scan`` (module docstring).

  T is split into ``n = ceil(T / block_t)`` chunks of equal size C
  (:func:`balanced_block_t`), the tokens padded with zero rows to ``n·C``
  (``c = 0`` there: exact-zero gradient), so every chunk is one compiled
  body and no remainder chunk holds buffers of its own. No head is padded or
  copied; a remainder vocabulary tile is a static-size call.

  Transient memory: the ``[C, V]`` float32 ``e`` / ``b`` buffers
  (:class:`TrainChunkSizes`), a ``[C, ⌈V / block_v⌉]`` column of running
  maxima, a few ``[C, block_v]`` tiles and the float32 ``dW_s``.
  """
  if sizes is not None and not isinstance(sizes, TrainChunkSizes):
    raise ValueError(f"block_sizes={sizes!r}: impl='chunked' takes a TrainChunkSizes")
  sizes = sizes or TrainChunkSizes()
  inv_tau = 1.0 / temperature
  t, k, vocab = h_s.shape[0], len(h_k), w_s.shape[1]
  rows = balanced_block_t(t, sizes.block_t or default_block_t(k, vocab))
  n = -(-t // rows)

  def chunks(a):  # [T, ...] -> [n, C, ...], zero rows appended
    a = jnp.pad(a, [(0, n * rows - t)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape(n, rows, *a.shape[1:])
  xs = _Chunk(chunks(h_s), tuple(chunks(h) for h in h_k), chunks(w_hat), chunks(coef))
  pass1 = functools.partial(_pass1, w_s, w_k, inv_tau=inv_tau, block_v=sizes.block_v,
                            shared_head=shared_head)

  n_tiles = -(-vocab // min(sizes.block_v, vocab))
  bufs = (jnp.zeros((rows, vocab), jnp.float32), jnp.zeros((rows, vocab), jnp.float32),
          jnp.zeros((rows, n_tiles), jnp.float32))
  dw = jnp.zeros(w_s.shape, jnp.float32)
  bufs, dw = tile_math.match_vma((bufs, dw), h_s, w_s)

  def body(carry, chunk):
    bufs, dw = carry
    bufs, cols = pass1(bufs, chunk)
    dw, dh = _pass2(w_s, bufs, dw, _normaliser(chunk, cols, inv_tau), block_v=sizes.block_v)
    return (bufs, dw), (cols, dh)

  (_, dw), (cols, dh) = lax.scan(body, (bufs, dw), xs)
  flat = lambda a: a.reshape(n * rows, *a.shape[2:])[:t]  # [n, C, ...] -> [T, ...]
  lse, ent, e_k, lse_k = jax.tree.map(flat, cols)
  st = tile_math.stats_from_columns(lse, ent, e_k, lse_k, k)
  dh = flat(dh)
  kl = tile_math.kl_from_stats(st)
  return TrainOut(weighted_loss(coef, w_hat, kl), kl, st.ent, dh.astype(h_s.dtype),
                  dw.astype(w_s.dtype))


GRADS_FUNCTIONS: dict[str, Callable[..., TrainOut]] = {
    "reference": train_grads_reference, "chunked": train_grads_chunked,
    "pallas": pallas_train.train_grads_pallas}


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
