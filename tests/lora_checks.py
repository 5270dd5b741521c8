"""The chain rule a LoRA adapter's gradient must obey (shared by the LoRA tests).

With ``W = W0 + s a b`` (``a [in..., r]``, ``b [r, out...]``) and ``g = dL/dW``
flattened to ``[in, out]``: ``dL/da = s g bᵀ`` and ``dL/db = s aᵀ g``.
"""
import math

import numpy as np

from opd.models.lora import TARGETS


def matrix(x, n_in):
  """``x`` as a float64 ``[prod(in axes), prod(out axes)]`` matrix."""
  x = np.asarray(x, np.float64)
  return x.reshape(math.prod(x.shape[:n_in]), -1)


def projected_gradients(adapters, g_full, scale, layers):
  """``{(layer, name): (s g bᵀ, s aᵀ g, g)}`` in float64 for every target in ``layers``."""
  out = {}
  for layer in layers:
    for name, (module, n_in, _) in TARGETS.items():
      a = matrix(adapters[layer][module][name]["a"], n_in)
      b = matrix(adapters[layer][module][name]["b"], 1)
      g = matrix(g_full[layer][module][name], n_in)
      out[(layer, name)] = (scale * g @ b.T, scale * a.T @ g, g)
  return out
