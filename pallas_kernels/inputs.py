"""Validation and normalisation of the fused-loss inputs.

Every public loss in this package goes through :func:`check_inputs`: shapes
are checked statically (a mismatch is a ``ValueError`` naming the shapes,
never a broadcast), values are checked when the arrays are concrete (outside
``jit``). Under ``jit`` values cannot raise, so :func:`normalized_weights`
turns a token with negative or non-finite weights into a NaN loss instead of
silently clamping it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Inputs(NamedTuple):
  """Checked inputs. Teachers are always tuples of per-teacher arrays.

  Attributes:
    h_s: [T, Ds] student hidden states.
    w_s: [Ds, V] student head.
    h_k: K arrays [T, Dt_k] teacher hidden states.
    w_k: K arrays [Dt_k, V] teacher heads.
    weights: [T, K] raw (unnormalised) teacher weights, or None.
    mask: [T] bool, or None.
    temperature: Python float > 0.
  """
  h_s: jax.Array
  w_s: jax.Array
  h_k: tuple
  w_k: tuple
  weights: jax.Array | None
  mask: jax.Array | None
  temperature: float


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _as_list(x, name: str, ndim: int) -> list:
  """A stacked array [K, ...] or a sequence of K arrays -> list of K arrays."""
  if isinstance(x, (list, tuple)):
    out = [jnp.asarray(a) for a in x]
    for i, a in enumerate(out):
      if a.ndim != ndim - 1:
        raise ValueError(f"{name}[{i}].shape={a.shape}: expected {ndim - 1} dims")
    return out
  x = jnp.asarray(x)
  if x.ndim != ndim:
    raise ValueError(f"{name}.shape={x.shape}: expected {ndim} dims (stacked over teachers) "
                     f"or a sequence of {ndim - 1}-dim arrays")
  return [x[i] for i in range(x.shape[0])]


def check_temperature(temperature) -> float:
  try:
    tau = float(temperature)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"temperature={temperature!r} must be a Python number (it is static)") from e
  if not (math.isfinite(tau) and tau > 0):
    raise ValueError(f"temperature={tau} must be finite and > 0")
  return tau


def check_inputs(student_hidden, student_head, teacher_hidden=(), teacher_heads=(),
                 teacher_weights=None, mask=None, temperature=1.0, *,
                 need_weights: bool = True) -> Inputs:
  """Checks shapes (always) and values (when concrete); see module docstring.

  Args:
    student_hidden: [T, Ds].
    student_head: [Ds, V].
    teacher_hidden: [K, T, Dt] or a sequence of K arrays [T, Dt_k].
    teacher_heads: [K, Dt, V] or a sequence of K arrays [Dt_k, V].
    teacher_weights: [T, K], >= 0 and finite; required if ``need_weights``.
    mask: [T] (bool or 0/1), or None.
    temperature: > 0.
    need_weights: whether ``teacher_weights`` must be given.

  Returns:
    :class:`Inputs`.

  Raises:
    ValueError: on any shape mismatch or bad value, naming the offending
      argument and its shape or value.
  """
  h_s = jnp.asarray(student_hidden)
  w_s = jnp.asarray(student_head)
  if h_s.ndim != 2:
    raise ValueError(f"student_hidden.shape={h_s.shape}: expected [T, Ds]")
  if w_s.ndim != 2:
    raise ValueError(f"student_head.shape={w_s.shape}: expected [Ds, V]")
  if h_s.shape[1] != w_s.shape[0]:
    raise ValueError(f"student_hidden.shape={h_s.shape} and student_head.shape={w_s.shape}: "
                     "hidden width Ds differs")
  t, v = h_s.shape[0], w_s.shape[1]
  h_k = _as_list(teacher_hidden, "teacher_hidden", 3)
  w_k = _as_list(teacher_heads, "teacher_heads", 3)
  if len(h_k) != len(w_k):
    raise ValueError(f"teacher_hidden has K={len(h_k)} teachers but teacher_heads has K={len(w_k)}")
  for i, (h, w) in enumerate(zip(h_k, w_k)):
    if h.shape[0] != t:
      raise ValueError(f"teacher_hidden[{i}].shape={h.shape} but student_hidden.shape={h_s.shape}: "
                       "T differs")
    if h.shape[1] != w.shape[0]:
      raise ValueError(f"teacher_hidden[{i}].shape={h.shape} and teacher_heads[{i}].shape={w.shape}: "
                       "hidden width Dt differs")
    if w.shape[1] != v:
      raise ValueError(f"teacher_heads[{i}].shape={w.shape} but student_head.shape={w_s.shape}: "
                       "vocabulary V differs")
  for name, a in [("student_hidden", h_s), ("student_head", w_s)] + [
      (f"teacher_hidden[{i}]", h) for i, h in enumerate(h_k)] + [
      (f"teacher_heads[{i}]", w) for i, w in enumerate(w_k)]:
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name}.dtype={a.dtype}: expected a floating dtype")
  k = len(h_k)
  weights = None
  if teacher_weights is not None:
    weights = jnp.asarray(teacher_weights)
    if weights.shape != (t, k):
      raise ValueError(f"teacher_weights.shape={weights.shape}: expected [T, K]=({t}, {k}) "
                       f"from student_hidden.shape={h_s.shape} and {k} teachers")
  elif need_weights:
    raise ValueError("teacher_weights is required: [T, K] non-negative weights")
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != (t,):
      raise ValueError(f"mask.shape={mask.shape}: expected [T]=({t},) from "
                       f"student_hidden.shape={h_s.shape}")
    mask = mask.astype(bool)
  tau = check_temperature(temperature)

  if weights is not None and _is_concrete(weights):
    wn = np.asarray(weights, dtype=np.float64)
    bad = ~np.isfinite(wn) | (wn < 0)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"teacher_weights must be finite and >= 0; teacher_weights[{idx}]="
                       f"{wn[idx]} ({int(bad.sum())} bad entries)")
  for name, a in [("student_hidden", h_s)] + [(f"teacher_hidden[{i}]", h) for i, h in enumerate(h_k)]:
    if _is_concrete(a):
      finite = np.isfinite(np.asarray(a, dtype=np.float32))
      if not finite.all():
        idx = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"{name} (shape {a.shape}) has {int((~finite).sum())} non-finite values, "
                         f"e.g. at {idx}")
  return Inputs(h_s, w_s, tuple(h_k), tuple(w_k), weights, mask, tau)


def check_ids(ids, name: str, t: int, v: int) -> jax.Array:
  """``ids`` [T] integer token ids in ``[0, V)`` (checked when concrete) as int32."""
  ids = jnp.asarray(ids)
  if ids.shape != (t,):
    raise ValueError(f"{name}.shape={ids.shape}: expected [T]=({t},)")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name}.dtype={ids.dtype}: expected integer token ids")
  if not isinstance(ids, jax.core.Tracer):
    arr = np.asarray(ids)
    if arr.size and (arr.min() < 0 or arr.max() >= v):
      raise ValueError(f"{name} must lie in [0, V={v}); got min={arr.min()} max={arr.max()}")
  return ids.astype(jnp.int32)


def normalized_weights(weights: jax.Array, mask: jax.Array | None) -> jax.Array:
  """ŵ: weights renormalised to sum to 1 over the teachers present.

  Args:
    weights: [T, K] raw weights.
    mask: [T] bool or None.

  Returns:
    [T, K] float32. A token whose weights are all 0, or that is outside the
    mask, gets all-zero ŵ (so its loss and gradient are exactly 0). A token
    with a negative or non-finite weight (only reachable under ``jit``, where
    :func:`check_inputs` cannot look at values) gets NaN, so the fault shows.
  """
  w = weights.astype(jnp.float32)
  bad = jnp.any(~jnp.isfinite(w) | (w < 0), axis=1, keepdims=True)
  total = jnp.sum(jnp.where(bad, 0.0, w), axis=1, keepdims=True)
  present = total > 0
  if mask is not None:
    present = present & mask[:, None]
  w_hat = jnp.where(present, w / jnp.where(present, total, 1.0), 0.0)
  return jnp.where(bad, jnp.nan, w_hat)
