"""The OPD ``full`` estimator's gradient-in-forward path equals its per-token path.

``make_opd_loss`` trains the ``full`` estimator through
``pallas_kernels.fused_reverse_kl_train`` with token- or sequence-mean
coefficients; ``gradient_in_forward=False`` runs ``fused_reverse_kl`` under
autodiff. Both must give the same loss, metrics and parameter gradients, and
K references to one head array must take the shared-head path.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from opd.distill import loss as loss_lib
from opd.models import ModelConfig, forward, head_matrix, init_params
from pallas_kernels import train_loss

EPS32 = float(np.finfo(np.float32).eps)
V, B, T = 96, 3, 10
CFG = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(0)
  params = init_params(CFG, jax.random.key(0))
  params = {**params, "lm_head": params["lm_head"] * 40.0}  # O(1) logits
  teacher = init_params(CFG, jax.random.key(1))
  head = head_matrix(CFG, {**teacher, "lm_head": teacher["lm_head"] * 40.0})
  tokens = rng.integers(0, V, size=(B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[1, 7:] = False
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, 3:] = 1.0
  loss_mask[2] = 0.0  # a row without response tokens: out of the sequence mean
  hidden = forward(CFG, teacher, jnp.asarray(tokens[:, :-1]), None, jnp.asarray(mask),
                   return_logits=False, return_hidden=True).hidden
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
           "loss_mask": loss_mask * mask, "teacher_hidden": (hidden, hidden * 0.5),
           "teacher_weights": rng.uniform(0.1, 1.0, size=(B, T, 2)).astype(np.float32)}
  return params, batch, head


def _value_and_grad(params, batch, heads, cfg):
  fn = loss_lib.make_opd_loss(CFG, heads, cfg)
  return jax.jit(jax.value_and_grad(lambda p: fn(p, batch, None), has_aux=True))(params)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_gradient_in_forward_equals_per_token_path(setup, aggregation, monkeypatch):
  params, batch, head = setup
  seen = []
  real = train_loss._train_fn
  monkeypatch.setattr(train_loss, "_train_fn", lambda *a: (seen.append(a), real(*a))[1])
  kw = dict(aggregation=aggregation, temperature=1.3, impl="chunked")
  shared = _value_and_grad(params, batch, (head, head), loss_lib.OPDLossConfig(**kw))
  assert seen and seen[-1][3] is True  # K references to one array: the shared-head path
  separate = _value_and_grad(params, batch, (head, head + 0.0), loss_lib.OPDLossConfig(**kw))
  assert seen[-1][3] is False
  per_token = _value_and_grad(params, batch, (head, head),
                              loss_lib.OPDLossConfig(gradient_in_forward=False, **kw))
  # float32 KL of logits up to z_max: a few eps of z_max per token; the means
  # over tokens do not grow it. Gradients: the same backward through the model
  # from dL/dh_s, dL/dW_s that differ by ~sqrt(D)·eps·z_max relative (global
  # norm), with a factor 16 of margin.
  h = np.asarray(batch["teacher_hidden"][0]).reshape(B * T, -1)
  z_max = float(np.abs(h @ np.asarray(head)).max()) / 1.3
  atol = 64 * EPS32 * (z_max + np.log(V))
  g_rtol = 16 * np.sqrt(CFG.d_model) * EPS32 * z_max
  (loss_p, met_p), grads_p = per_token
  for (loss, met), grads in (shared, separate):
    assert abs(float(loss) - float(loss_p)) <= atol
    for key in ("kl/t0", "kl/t1", "student_entropy", "opd_tokens", "opd_rows"):
      assert abs(float(met[key]) - float(met_p[key])) <= atol, key
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in
              zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p)))
    den = sum(float(jnp.sum(b ** 2)) for b in jax.tree.leaves(grads_p))
    assert den > 0 and np.sqrt(num / den) < g_rtol, (np.sqrt(num / den), g_rtol)


def test_gradient_in_forward_flag_is_validated():
  with pytest.raises(ValueError, match="gradient_in_forward"):
    loss_lib.OPDLossConfig(gradient_in_forward="yes")
