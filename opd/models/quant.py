"""int8 weight-only quantisation of a frozen model (docs/DESIGN.md §2, int8 teachers).

Each matmul weight ``W`` becomes ``q = round(W / s)`` in int8 with one
symmetric scale per output channel, ``s = max |W| / 127`` over the weight's
contraction axes (``q [D, H, Dh]``: one scale per (head, dim); ``o [H, Dh,
D]`` and ``down [F, D]``: one per output dim; the embedding: one per
vocabulary row, which serves both the lookup and a tied head). Norm scales,
biases and weights outside the table stay as they are. The rounding error
of an element is at most ``s / 2``.

``dequantize`` rebuilds float weights ``q · s``; ``forward_int8`` runs the
decoder on them inside one jit, so only the int8 tree is resident between
calls (the dequantised copy is a transient of the computation).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from opd.models.config import ModelConfig
from opd.models.decoder import forward

PyTree = Any

# Weight name -> (its rank, its contraction axes: the scale is shared along them).
CONTRACTION_AXES: dict[str, tuple[int, tuple[int, ...]]] = {
    "q": (3, (0,)), "k": (3, (0,)), "v": (3, (0,)), "o": (3, (0, 1)),
    "gate": (2, (0,)), "up": (2, (0,)), "down": (2, (0,)),
    "embedding": (2, (1,)), "lm_head": (2, (0,)),
}


def _is_quantized(x) -> bool:
  return isinstance(x, dict) and set(x) == {"int8", "scale"}


def quantize_int8(params: PyTree) -> PyTree:
  """``params`` with every weight named in ``CONTRACTION_AXES`` as ``{"int8", "scale"}``.

  A weight whose rank does not fit its table entry (e.g. MoE experts stacked
  ``[E, D, F]``) stays float.
  """
  def walk(tree):
    out = {}
    for name, x in tree.items():
      if isinstance(x, dict):
        out[name] = walk(x)
      elif name in CONTRACTION_AXES and x.ndim == CONTRACTION_AXES[name][0]:
        out[name] = _quantize(x, CONTRACTION_AXES[name][1])
      else:
        out[name] = x
    return out
  return walk(params)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w, axes):
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return {"int8": q, "scale": scale}


def dequantize(qparams: PyTree, dtype=jnp.float32) -> PyTree:
  """Float params ``int8 · scale`` in ``dtype`` (other leaves unchanged)."""
  return jax.tree.map(lambda x: (x["int8"].astype(jnp.float32) * x["scale"]).astype(dtype)
                      if _is_quantized(x) else x, qparams, is_leaf=_is_quantized)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_logits", "return_hidden"))
def _forward_int8(cfg, qparams, tokens, positions=None, mask=None, *, return_logits=True,
                  return_hidden=False):
  return forward(cfg, dequantize(qparams, cfg.storage_dtype), tokens, positions, mask,
                 return_logits=return_logits, return_hidden=return_hidden)


def forward_int8(cfg: ModelConfig, qparams: PyTree, tokens, positions=None, mask=None, *,
                 return_logits: bool = True, return_hidden: bool = False):
  """``opd.models.decoder.forward`` of the dequantised weights, in one jit."""
  return _forward_int8(cfg, qparams, tokens, positions, mask, return_logits=return_logits,
                       return_hidden=return_hidden)


def param_bytes(tree: PyTree) -> int:
  """Bytes of every array of ``tree`` (int8 weights and their fp32 scales included)."""
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


__all__ = ["CONTRACTION_AXES", "dequantize", "forward_int8", "param_bytes", "quantize_int8"]
