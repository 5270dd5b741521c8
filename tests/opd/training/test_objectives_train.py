"""``lm_loss(fused=True)`` trains through the gradient-in-forward cross-entropy.

Its parameter gradients must equal those of the unfused objective (logits
materialised by the model, ``jax.grad`` through ``log_softmax``) and of the
per-token fused path (``gradient_in_forward=False``).
"""
import numpy as np

import jax
import jax.numpy as jnp

from opd.models import ModelConfig, forward, init_params
from opd.training.objectives import lm_loss

EPS32 = float(np.finfo(np.float32).eps)
CFG = ModelConfig(vocab_size=96, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                  dtype="float32", param_dtype="float32")
B, T = 3, 12


def test_fused_gradient_in_forward_equals_unfused_and_per_token_gradients():
  rng = np.random.default_rng(0)
  params = init_params(CFG, jax.random.key(0))
  params = {**params, "lm_head": params["lm_head"] * 30.0}  # O(1) logits
  tokens = rng.integers(0, CFG.vocab_size, size=(B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[2, 8:] = False
  loss_mask = (rng.uniform(size=(B, T)) < 0.6).astype(np.float32)
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
           "loss_mask": loss_mask}

  def run(**kw):
    fn = lm_loss(CFG, **kw)
    return jax.jit(jax.value_and_grad(lambda p: fn(p, batch, None), has_aux=True))(params)
  (loss_u, met_u), g_u = run(fused=False)
  z_max = float(jnp.abs(forward(CFG, params, batch["tokens"], None, mask,
                                return_logits=True).logits).max())
  # Float32 logits of width D: ~sqrt(D)·eps·z_max each, a handful of them per
  # nll (factor 8); a mean over tokens does not grow it. Gradients: the same
  # backward through the model from dL/dh and dL/dW_head that differ by
  # ~sqrt(D)·eps·z_max relative (global norm), ×16 margin.
  atol = 8 * np.sqrt(CFG.d_model) * EPS32 * z_max
  g_rtol = 16 * np.sqrt(CFG.d_model) * EPS32 * z_max
  for kw in (dict(fused=True), dict(fused=True, gradient_in_forward=False)):
    (loss, met), grads = run(**kw)
    assert float(met["tokens"]) == float(met_u["tokens"]) == float((loss_mask * mask).sum())
    assert abs(float(loss) - float(loss_u)) <= atol
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in
              zip(jax.tree.leaves(grads), jax.tree.leaves(g_u)))
    den = sum(float(jnp.sum(b ** 2)) for b in jax.tree.leaves(g_u))
    assert den > 0 and np.sqrt(num / den) < g_rtol, (np.sqrt(num / den), g_rtol)
