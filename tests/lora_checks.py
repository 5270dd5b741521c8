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


def opd_loss_and_batch(cfg):
  """The fused full-vocabulary OPD loss of ``cfg`` with one teacher of width 24,
  and a random batch of 2 rows x 8 tokens for it (seeded)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from opd.distill.loss import OPDLossConfig, make_opd_loss  # noqa: PLC0415
  head = 0.3 * jax.random.normal(jax.random.key(10), (24, cfg.vocab_size))
  tokens = jax.random.randint(jax.random.key(11), (2, 8), 0, cfg.vocab_size)
  batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1),
           "mask": jnp.ones((2, 8), bool), "loss_mask": jnp.ones((2, 8), jnp.float32),
           "teacher_hidden": (jax.random.normal(jax.random.key(12), (2, 8, 24)),),
           "teacher_weights": jnp.ones((2, 8, 1), jnp.float32)}
  return make_opd_loss(cfg, [head], OPDLossConfig(estimator="full")), batch
