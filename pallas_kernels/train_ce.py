"""Gradient-in-forward cross-entropy training loss (docs/DESIGN.md §4).

``loss = Σ_t c_t (lse(z_t) − z_{t,y_t})`` with ``z = h_s W_s / τ`` and
per-token coefficients ``c`` (e.g. mask / token count). Its gradient is

    ∂loss/∂z_tv = c_t (p_tv − [v = y_t]),

so, as in :mod:`pallas_kernels.train_loss`, one pass over token chunks ×
vocabulary tiles computes the loss, ``dL/dh_s`` and ``dL/dW_s``: pass 1
writes each tile of ``z`` into a ``[C, V]`` buffer and folds it into the
online ``lse`` (1 head matmul), pass 2 forms ``c (p − onehot)`` per tile and
accumulates the gradients (2 matmuls). The ``custom_vjp`` backward only
scales them by the loss cotangent. ``fused_cross_entropy`` under autodiff
takes 1 matmul forward and 3 backward (it recomputes each tile).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import chunked, inputs as inputs_lib, reference, tile_math
from pallas_kernels import train_loss
from pallas_kernels.train_loss import TrainChunkSizes

IMPLS = ("auto", "chunked", "reference")


def _chunk_pass(h_c, w_s, y_c, c_c, dw, *, inv_tau, block_v):
  """Both vocabulary passes of one token chunk: ``(dw, (dh_c, nll_c))``."""
  rows, vocab = h_c.shape[0], w_s.shape[1]
  y = y_c[:, None]

  def onehot(start, size):
    return start + lax.broadcasted_iota(jnp.int32, (rows, size), 1) == y

  # Pass 1: z tiles into the buffer; running max m, l = Σ e^{z−m}; z at the label.
  def pass1(carry, start, size):
    acc, z_y, zbuf = carry
    z, _ = chunked.logit_tile(h_c, w_s, start, size, inv_tau)
    acc = tile_math.acc_update(acc, z, [], None)
    z_y = z_y + jnp.sum(jnp.where(onehot(start, size), z, 0.0), axis=1, keepdims=True)
    return acc, z_y, lax.dynamic_update_slice_in_dim(zbuf, z, start, axis=1)

  init = (tile_math.acc_init(rows, 0), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, vocab), jnp.float32))
  acc, z_y, zbuf = chunked.fold_tiles(pass1, tile_math.match_vma(init, h_c, w_s), vocab, block_v)
  lse = tile_math.acc_finalize(acc)[0]
  g_scale = (c_c * inv_tau)[:, None]  # chain rule through z = h W / τ

  # Pass 2: ∂L/∂z = c (p − onehot) per tile.
  def g_tile(start, size):
    z = lax.dynamic_slice_in_dim(zbuf, start, size, axis=1)
    return g_scale * (jnp.exp(z - lse) - onehot(start, size).astype(jnp.float32))

  dh, dw = train_loss.gradient_pass(g_tile, h_c, w_s, dw, block_v)
  return dw, (dh, (lse - z_y)[:, 0])


def ce_grads_chunked(h_s, w_s, labels, coef, *, temperature: float,
                     sizes: TrainChunkSizes | None = None):
  """``((loss, nll [T]), (dh_s, dw_s))`` by token chunks × vocabulary tiles.

  Transient memory: one ``[C, V]`` float32 buffer of ``z`` per chunk.
  """
  if sizes is not None and not isinstance(sizes, TrainChunkSizes):
    raise ValueError(f"block_sizes={sizes!r}: impl='chunked' takes a TrainChunkSizes")
  sizes = sizes or TrainChunkSizes()
  run = functools.partial(_chunk_pass, w_s=w_s, inv_tau=1.0 / temperature, block_v=sizes.block_v)

  def body(dw, start, size):
    rows = lambda a: lax.dynamic_slice_in_dim(a, start, size, axis=0)
    return run(rows(h_s), y_c=rows(labels), c_c=rows(coef), dw=dw)

  dw0 = tile_math.match_vma(jnp.zeros(w_s.shape, jnp.float32), h_s, w_s)
  # One [C, V] buffer (z) instead of two: twice the rows of the K = 0 budget.
  block_t = sizes.block_t or train_loss.default_block_t(0, w_s.shape[1], buffers=1)
  dw, (dh, nll) = train_loss.fold_chunks(body, dw0, h_s.shape[0], block_t)
  return (jnp.sum(coef * nll), nll), (dh.astype(h_s.dtype), dw.astype(w_s.dtype))


def ce_grads_reference(h_s, w_s, labels, coef, *, temperature: float, sizes=None):
  """Materialised ``[T, V]`` logits; gradients by ``jax.grad``."""
  if sizes is not None:
    raise ValueError(f"block_sizes={sizes!r}: impl='reference' takes no block sizes")

  def obj(h_s, w_s):
    nll = reference.cross_entropy_reference(h_s, w_s, labels, None, temperature)
    return jnp.sum(coef * nll), nll
  (loss, nll), grads = jax.value_and_grad(obj, argnums=(0, 1), has_aux=True)(h_s, w_s)
  return (loss, nll), grads


@functools.lru_cache(maxsize=None)
def _ce_fn(impl: str, sizes, temperature: float):
  grads_fn = ce_grads_chunked if impl == "chunked" else ce_grads_reference
  run = lambda h_s, w_s, rest: grads_fn(h_s, w_s, *rest, temperature=temperature, sizes=sizes)
  return jax.jit(train_loss.saved_gradient_vjp(run))


def fused_cross_entropy_train(student_hidden, student_head, labels, coef, temperature=1.0,
                              impl: str = "auto", block_sizes=None, return_aux: bool = False):
  """Scalar ``Σ_t c_t · (−log softmax(h W / τ)[label])``, gradient in forward.

  Equal in value and gradient to
  ``jnp.sum(coef * fused_cross_entropy(..., mask=coef != 0))``.

  Args:
    student_hidden: [T, Ds]; student_head: [Ds, V].
    labels: [T] int ids in [0, V).
    coef: [T] finite per-token coefficients (e.g. ``mask / n``); tokens with
      ``c_t = 0`` are outside the loss.
    temperature: τ > 0.
    impl: ``"auto"`` (= ``"chunked"`` on every backend), ``"chunked"`` or
      ``"reference"`` (materialised).
    block_sizes: :class:`~pallas_kernels.train_loss.TrainChunkSizes` for
      chunked, None for defaults.
    return_aux: also return ``{"nll": [T]}`` (0 where ``c_t = 0``;
      stop-gradient).

  Returns:
    ``loss`` [] float32, or ``(loss, aux)``. Differentiable w.r.t.
    ``student_hidden`` and ``student_head`` only.

  Raises:
    ValueError: bad shapes or dtypes, labels outside [0, V), non-finite
      hidden states or ``coef``, an unknown ``impl``.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}: fused_cross_entropy_train supports {IMPLS}")
  impl = "chunked" if impl == "auto" else impl
  inp = inputs_lib.check_inputs(student_hidden, student_head, (), (), None, None, temperature,
                                need_weights=False)
  t = inp.h_s.shape[0]
  labels = inputs_lib.check_ids(labels, "labels", t, inp.w_s.shape[1])
  c = jax.lax.stop_gradient(train_loss.check_coef(coef, t))
  loss, nll = _ce_fn(impl, block_sizes, inp.temperature)(inp.h_s, inp.w_s, (labels, c))
  if not return_aux:
    return loss
  return loss, {"nll": jnp.where(c != 0, jax.lax.stop_gradient(nll), 0.0)}

