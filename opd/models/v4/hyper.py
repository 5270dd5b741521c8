"""Manifold-constrained hyper-connections, mHC (docs/DESIGN.md §2, "DeepSeek-V4").

DeepSeek-V4 keeps N = ``n_streams`` residual streams per token, ``h [B, T, N, D]``.
Around each block (attention or MLP) one ``HyperConnection`` reads the streams
and computes, from ``x = UnitRMSNorm(flatten(h)) [N·D]`` and the learnt
``proj [N·D, (2 + N)·N]``, ``bias [(2 + N)·N]``, ``scale [3]``:

  (a_pre, a_post, a_comb) = x proj            (N, N and N·N entries)
  pre  = σ(scale_0 a_pre + b_pre) + eps                          [N]
  post = 2 σ(scale_1 a_post + b_post)                            [N]
  comb = Sinkhorn(softmax_rows(scale_2 a_comb + b_comb) + eps)   [N, N]

The block reads the collapsed stream ``Σ_n pre_n h_n`` and its output ``y``
is expanded back: ``h'_k = post_k y + Σ_j comb_jk h_j`` (``expand``). The
Sinkhorn–Knopp projection alternately divides columns and rows by their sums
(+ eps), starting and ending with the columns, ``iters`` column steps in all,
so ``comb`` is (nearly) doubly stochastic and the residual mixing cannot grow
the streams' norm. ``HyperHead`` collapses the streams once more before the
final norm, with its own ``pre`` weights only.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.config.fields import check_fields
from opd.models.layers import param

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class HyperConfig:
  """The mHC sub-config (transformers' ``DeepseekV4Config`` field in brackets).

  Attributes:
    d_model: D, the width of one stream (``hidden_size``).
    n_streams: N, residual streams per token (``hc_mult``).
    sinkhorn_iters: column normalisations of the Sinkhorn projection
      (``hc_sinkhorn_iters``); iters - 1 row normalisations sit between them.
    eps: floor added to pre, to comb and to every Sinkhorn divisor (``hc_eps``).
    norm_eps: epsilon of the unit RMSNorm on the flattened streams (``rms_norm_eps``).
  """
  d_model: int
  n_streams: int = 4
  sinkhorn_iters: int = 20
  eps: float = 1e-6
  norm_eps: float = 1e-6

  def __post_init__(self):
    check_fields(self, "HyperConfig", ints={"d_model": 1, "n_streams": 1, "sinkhorn_iters": 1},
                 positive=("eps", "norm_eps"))


def unit_rms_norm(x: Array, eps: float) -> Array:
  """``x / sqrt(mean(x²) + eps)`` over the last axis, in fp32, with no learnt scale."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def sinkhorn(m: Array, iters: int, eps: float) -> Array:
  """Sinkhorn–Knopp projection of positive ``m [..., N, N]`` towards a doubly stochastic matrix.

  Divides the columns by their sums (+ eps), then ``iters - 1`` times the rows
  and the columns, so the last step leaves every column summing to
  ``s / (s + eps)``, within eps of 1; the rows' error shrinks geometrically
  (docs/DESIGN.md §2 gives the rate).
  """
  if iters < 1:
    raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
  col = lambda a: a / (jnp.sum(a, axis=-2, keepdims=True) + eps)
  row = lambda a: a / (jnp.sum(a, axis=-1, keepdims=True) + eps)
  m = col(m)
  return jax.lax.fori_loop(0, iters - 1, lambda _, a: col(row(a)), m)


def _check_streams(h: Array, cfg: HyperConfig, who: str) -> None:
  if h.ndim != 4 or h.shape[-2:] != (cfg.n_streams, cfg.d_model):
    raise ValueError(f"{who}: streams must be [B, T, n_streams={cfg.n_streams}, "
                     f"d_model={cfg.d_model}], got {h.shape=}")


class HyperConnection(nn.Module):
  """One mHC site: ``h [B, T, N, D] -> (post [B, T, N], comb [B, T, N, N], collapsed [B, T, D])``.

  ``post`` and ``comb`` are fp32; ``collapsed`` has ``h``'s dtype. Params:
  ``proj [N·D, (2+N)·N]`` ("embed", None), ``bias [(2+N)·N]``, ``scale [3]``.
  """
  cfg: HyperConfig

  @nn.compact
  def __call__(self, h: Array):
    cfg = self.cfg
    _check_streams(h, cfg, "HyperConnection")
    N, D = cfg.n_streams, cfg.d_model
    W = (2 + N) * N
    proj = param(self, "proj", (N * D, W), (None, None), jnp.float32)  # replicated
    bias = param(self, "bias", (W,), (None,), jnp.float32)
    scale = param(self, "scale", (3,), (None,), jnp.float32)
    x = unit_rms_norm(h.reshape(*h.shape[:-2], N * D), cfg.norm_eps)
    a = jnp.einsum("BTX,XW->BTW", x, proj.astype(jnp.float32))
    a_pre, a_post, a_comb = a[..., :N], a[..., N:2 * N], a[..., 2 * N:]
    pre = jax.nn.sigmoid(a_pre * scale[0] + bias[:N]) + cfg.eps
    post = 2.0 * jax.nn.sigmoid(a_post * scale[1] + bias[N:2 * N])
    comb_logits = (a_comb * scale[2] + bias[2 * N:]).reshape(*a.shape[:-1], N, N)
    comb = sinkhorn(jax.nn.softmax(comb_logits, axis=-1) + cfg.eps, cfg.sinkhorn_iters, cfg.eps)
    collapsed = jnp.einsum("BTN,BTND->BTD", pre, h.astype(jnp.float32)).astype(h.dtype)
    return post, comb, collapsed


def expand(post: Array, comb: Array, y: Array, h: Array) -> Array:
  """The streams after a block: ``h'_k = post_k y + Σ_j comb_jk h_j``.

  Args:
    post: ``[B, T, N]``; comb: ``[B, T, N, N]`` (from ``HyperConnection``).
    y: ``[B, T, D]`` the block's output; h: ``[B, T, N, D]`` its input streams.

  Returns:
    ``[B, T, N, D]`` in ``h``'s dtype (post and comb are cast to it first).
  """
  dt = h.dtype
  return (post.astype(dt)[..., None] * y.astype(dt)[..., None, :]
          + jnp.einsum("BTjk,BTjD->BTkD", comb.astype(dt), h))


class HyperHead(nn.Module):
  """The final collapse ``h [B, T, N, D] -> Σ_n pre_n h_n [B, T, D]`` (pre as ``HyperConnection``).

  Params: ``proj [N·D, N]``, ``bias [N]``, ``scale [1]``.
  """
  cfg: HyperConfig

  @nn.compact
  def __call__(self, h: Array) -> Array:
    cfg = self.cfg
    _check_streams(h, cfg, "HyperHead")
    N, D = cfg.n_streams, cfg.d_model
    proj = param(self, "proj", (N * D, N), (None, None), jnp.float32)  # replicated
    bias = param(self, "bias", (N,), (None,), jnp.float32)
    scale = param(self, "scale", (1,), (None,), jnp.float32)
    x = unit_rms_norm(h.reshape(*h.shape[:-2], N * D), cfg.norm_eps)
    pre = jax.nn.sigmoid(jnp.einsum("BTX,XN->BTN", x, proj) * scale[0] + bias) + cfg.eps
    return jnp.einsum("BTN,BTND->BTD", pre, h.astype(jnp.float32)).astype(h.dtype)
