"""Pallas vocabulary statistics for the fused reverse KL: block sizes and wrapper.

Two kernel layouts share the per-tile math of :mod:`pallas_kernels.tile_math`:

* ``"tiled"`` (:mod:`pallas_kernels.pallas_kl_tiled`): a ``(T tiles, V tiles)``
  grid with VMEM scratch accumulators, for TPU (Mosaic);
* ``"looped"`` (:mod:`pallas_kernels.pallas_kl_looped`): parallel grid, in-kernel
  loops over vocabulary / token tiles and hidden-width chunks, for GPU
  (Triton).

Both run on CPU with ``interpret=True`` (that is how the tests exercise
them). The forward pass produces :class:`~pallas_kernels.tile_math.Stats`; the
backward pass runs two kernels (``dh_s`` over T tiles, ``dW_s`` over V tiles)
that recompute the logits from the saved per-token coefficients. Inputs may
be bfloat16; every matmul accumulates in float32.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import pallas_kl_looped, pallas_kl_tiled, tile_math
from pallas_kernels.reference import vocab_stats_reference  # noqa: F401  (the pure-jnp reference)
from pallas_kernels.tile_math import Stats

LAYOUTS = ("tiled", "looped")


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Block sizes of the Pallas kernels.

  Attributes:
    block_t: tokens per tile.
    block_v: vocabulary columns per tile.
    layout: ``"tiled"`` (TPU grid pipeline) or ``"looped"`` (GPU in-kernel loops).
    block_d: looped only: hidden-width chunk per ``dot``.
    v_splits: looped only: vocabulary splits of the forward pass run as
      parallel programs and merged afterwards.
    num_warps, num_stages: looped only: Triton compiler parameters.
    vmem_limit_bytes: tiled only: upper bound for the scoped VMEM limit
      requested from Mosaic (the kernels ask for about twice their estimate).
  """
  block_t: int
  block_v: int
  layout: str = "tiled"
  block_d: int = 64
  v_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2
  vmem_limit_bytes: int = 96 * 2**20

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"BlockSizes.layout={self.layout!r}: expected one of {LAYOUTS}")
    for name in ("block_t", "block_v", "block_d", "v_splits", "num_warps", "num_stages"):
      val = getattr(self, name)
      if not (isinstance(val, int) and val > 0):
        raise ValueError(f"BlockSizes.{name}={val!r} must be a positive int")
    if self.layout == "tiled":
      if self.block_t % 8 or self.block_v % 128:
        raise ValueError(f"BlockSizes(block_t={self.block_t}, block_v={self.block_v}): the tiled "
                         "(TPU) layout needs block_t % 8 == 0 and block_v % 128 == 0")
    else:
      for name in ("block_t", "block_v", "block_d"):
        val = getattr(self, name)
        if not (_pow2(val) and val >= 16):
          raise ValueError(f"BlockSizes.{name}={val}: the looped (Triton) layout needs a power "
                           "of two >= 16")

  @classmethod
  def get_default(cls, backend: str | None = None) -> "BlockSizes":
    """Defaults for ``backend`` (``jax.default_backend()`` if None).

    TPU: 256 x 512 tiles with the whole hidden width per block. At D=4096
    in bf16 the kernels estimate 29-45 MiB of VMEM for K=1 and 57-72 MiB
    for K=3 (:func:`pallas_kl_tiled.vmem_estimate`): fine on 128 MiB chips
    (v5e, v6e); use smaller blocks on chips with less. Untuned: no TPU was
    available when these were chosen.
    GPU: 64 x 128 register tiles, 64-wide hidden chunks, 4 vocabulary splits
    (untuned: no GPU was available either).
    CPU (interpret mode, for tests): small tiled blocks.
    """
    backend = backend or jax.default_backend()
    if backend == "tpu":
      return cls(block_t=256, block_v=512, layout="tiled")
    if backend in ("gpu", "cuda", "rocm"):
      return cls(block_t=64, block_v=128, layout="looped", block_d=64, v_splits=4,
                 num_warps=4, num_stages=3)
    return cls(block_t=64, block_v=256, layout="tiled")



def _fit(bs: BlockSizes, t: int, v: int, d_max: int, dtype) -> BlockSizes:
  """Shrinks blocks that are larger than the (rounded-up) arrays."""
  if bs.layout == "tiled":
    sub = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)  # 8 rows f32, 16 bf16 per sublane tile
    return dataclasses.replace(bs, block_t=min(bs.block_t, tile_math.round_up(t, sub)),
                               block_v=min(bs.block_v, tile_math.round_up(v, 128)))
  p2 = lambda n: max(16, 1 << (n - 1).bit_length())
  return dataclasses.replace(bs, block_t=min(bs.block_t, p2(t)), block_v=min(bs.block_v, p2(v)),
                             block_d=min(bs.block_d, p2(d_max)),
                             v_splits=max(1, min(bs.v_splits, -(-v // min(bs.block_v, p2(v))))))


def _forward(h_s, w_s, h_k, w_k, *, inv_tau, bs, interpret) -> Stats:
  k = len(h_k)
  if bs.layout == "tiled":
    cols = pallas_kl_tiled.forward(h_s, w_s, h_k, w_k, inv_tau=inv_tau, bt=bs.block_t,
                                   bv=bs.block_v, vmem_cap=bs.vmem_limit_bytes,
                                   interpret=interpret)
    return tile_math.stats_from_columns(cols[0], cols[1], cols[2:2 + k], cols[2 + k:], k)
  parts = pallas_kl_looped.forward(
      h_s, w_s, h_k, w_k, inv_tau=inv_tau, bt=bs.block_t, bv=bs.block_v, bd=bs.block_d,
      splits=bs.v_splits, num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret)
  cat = lambda cs: (jnp.concatenate(cs, axis=2) if cs
                    else jnp.zeros(parts[0].shape[:2] + (0,), jnp.float32))
  split_stats = Stats(parts[0][..., 0], parts[1][..., 0], cat(parts[2:2 + k]), cat(parts[2 + k:]))
  return tile_math.merge_stats(split_stats, axis=0)


def _backward(h_s, w_s, h_k, w_k, coef: tile_math.Coef, *, inv_tau, bs, interpret):
  cols = [coef.lse, coef.c, coef.ez, coef.r, *coef.u_k, *coef.e_k]
  if bs.layout == "tiled":
    return pallas_kl_tiled.backward(h_s, w_s, h_k, w_k, cols, inv_tau=inv_tau, bt=bs.block_t,
                                    bv=bs.block_v, vmem_cap=bs.vmem_limit_bytes,
                                    interpret=interpret)
  return pallas_kl_looped.backward(
      h_s, w_s, h_k, w_k, cols, inv_tau=inv_tau, bt=bs.block_t, bv=bs.block_v, bd=bs.block_d,
      splits=bs.v_splits, num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret)


@functools.lru_cache(maxsize=None)
def _stats_fn(temperature: float, bs: BlockSizes, interpret: bool):
  """custom_vjp statistics function for one static configuration."""
  static = dict(inv_tau=1.0 / temperature, bs=bs, interpret=interpret)

  return tile_math.stats_with_vjp(functools.partial(_forward, **static),
                                  functools.partial(_backward, **static))


def vocab_stats_pallas(h_s: jax.Array, w_s: jax.Array, h_k: Sequence[jax.Array],
                       w_k: Sequence[jax.Array], temperature: float,
                       block_sizes: BlockSizes | None = None,
                       interpret: bool | None = None) -> Stats:
  """Per-token :class:`~pallas_kernels.tile_math.Stats` with the Pallas kernels.

  Args:
    h_s, w_s, h_k, w_k, temperature: as
      :func:`pallas_kernels.chunked.vocab_stats_chunked` (``[T, Ds]``,
      ``[Ds, V]``, K arrays ``[T, Dt_k]`` and ``[Dt_k, V]``, static τ > 0).
    block_sizes: :class:`BlockSizes` (default: ``BlockSizes.get_default()``).
    interpret: run in Pallas interpret mode (default: on CPU).

  Returns:
    Stats ([T] / [T, K] float32), differentiable w.r.t. ``h_s`` and ``w_s``.

  Raises:
    ValueError: if the shapes do not line up.
  """
  if h_s.ndim != 2 or w_s.ndim != 2 or h_s.shape[1] != w_s.shape[0]:
    raise ValueError(f"{h_s.shape=} and {w_s.shape=}: expected [T, Ds] and [Ds, V]")
  if len(h_k) != len(w_k):
    raise ValueError(f"{len(h_k)=} teacher hiddens but {len(w_k)=} teacher heads")
  for i, (h, w) in enumerate(zip(h_k, w_k)):
    if h.shape[0] != h_s.shape[0] or h.shape[1] != w.shape[0] or w.shape[1] != w_s.shape[1]:
      raise ValueError(f"teacher {i}: {h.shape=} {w.shape=} do not match {h_s.shape=} {w_s.shape=}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  bs = block_sizes or BlockSizes.get_default()
  d_max = max([h_s.shape[1]] + [h.shape[1] for h in h_k])
  bs = _fit(bs, h_s.shape[0], w_s.shape[1], d_max, h_s.dtype)
  return _stats_fn(float(temperature), bs, bool(interpret))(h_s, w_s, tuple(h_k), tuple(w_k))
