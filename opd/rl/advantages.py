"""Group-relative advantages (docs/DESIGN.md §5), on the host in numpy.

For a prompt ``q`` the policy samples a group of G responses ``o_1..o_G``
with rewards ``r_i``. Each response's advantage is its reward relative to
its own group, never to another prompt's responses::

    A_i = (r_i - mean(r)) / (std(r) + eps)      scale_advantages_by_std=True (GRPO)
    A_i =  r_i - mean(r)                        scale_advantages_by_std=False (Dr. GRPO)

with the population std (ddof=0); a group whose rewards are all equal gets
exactly zero advantages.
"""
from __future__ import annotations

import numpy as np

from opd.config.fields import check_float


def group_advantages(rewards, *, scale_by_std: bool = True, eps: float = 1e-6) -> np.ndarray:
  """Group-normalised advantages. ``[P, G] -> [P, G]`` float32 (host numpy).

  Row p holds the G rewards of prompt p's samples. Population std (ddof=0).
  A group whose rewards are all equal has advantage exactly 0 (no NaN, even
  with ``eps=0``).

  Raises:
    ValueError: ``rewards`` is not a finite ``[P, G]`` array, or ``eps < 0``.
  """
  r = np.asarray(rewards, np.float64)
  if r.ndim != 2 or 0 in r.shape:
    raise ValueError(f"rewards must be a non-empty [P, G] array, got shape {r.shape}")
  if not np.all(np.isfinite(r)):
    raise ValueError(f"rewards must be finite, got {int((~np.isfinite(r)).sum())} NaN/inf")
  check_float("group_advantages", "eps", eps, min_value=0.0)
  flat = r.max(axis=1) == r.min(axis=1)  # [P]
  adv = r - r.mean(axis=1, keepdims=True)
  if scale_by_std:
    std = np.where(flat, 1.0, r.std(axis=1))[:, None]
    adv = adv / (std + eps)
  adv[flat] = 0.0
  return adv.astype(np.float32)
