"""DeepSeek-V4 under a (data, fsdp, expert, tensor) mesh of 8 fake CPU devices: the routed
experts (hash-routed and sqrtsoftplus top-k layers alike) run expert-parallel through
``opd.models.moe.experts_expert_parallel`` with V4's clipped SwiGLU, the rule table puts
them on the ``expert`` axis and leaves the mHC params replicated, and the forward and the
gradients equal the unsharded ones."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import forward, init_params, param_logical_axes
from opd.models import moe_balance
from opd.parallel import sharding
from v4_family import tiny_v4

# swiglu_limit 0.5 with weights 10x the 0.02 init: the clip binds on many expert units
# (checked below), so a dispatch that dropped it would change the outputs.
CFG = tiny_v4(v4=dataclasses.replace(tiny_v4().v4, swiglu_limit=0.5))
B, T = 8, 12  # T > W = 8; 3 CSA and 1 HCA windows
EPS = float(np.finfo(np.float32).eps)


def _loss(cfg):
  def f(params, tokens, mask):
    out = forward(cfg, params, tokens, None, mask)
    lp = jax.nn.log_softmax(out.logits[:, :-1])
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    return (jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:])
            + moe_balance.aux_loss(cfg.moe, out.moe)), out.logits
  return f


@pytest.fixture(scope="module")
def reference():
  params = init_params(CFG, jax.random.key(3))
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x if "tid2eid" in jax.tree_util.keystr(p) or x.ndim < 2 else x * 10.0, params)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
  mask = jnp.asarray(np.arange(T)[None, :] >= rng.integers(0, 3, (B, 1)))  # left padding
  (loss, logits), grads = jax.value_and_grad(_loss(CFG), has_aux=True)(params, tokens, mask)
  return params, tokens, mask, loss, logits, grads


def test_the_clip_binds(reference):
  # Without the clip the logits move far beyond the sharding tolerance below.
  params, tokens, mask, _, logits, _ = reference
  loose = CFG.replace(v4=dataclasses.replace(CFG.v4, swiglu_limit=1e6))
  other = forward(loose, params, tokens, None, mask).logits
  assert float(jnp.max(jnp.abs(other - logits))) > 1e-3 * float(jnp.max(jnp.abs(logits)))


@pytest.mark.parametrize("shape, batch_rule", [
    ((2, 1, 4, 1), ("data", "expert")),  # tokens sharded over expert: gather + reduce-scatter
    ((2, 1, 2, 2), ("data", "fsdp")),  # tokens replicated over expert (psum), tensor split
], ids=["data_expert", "data_expert_tensor_replicated_tokens"])
def test_expert_parallel_equals_unsharded(reference, shape, batch_rule):
  params, tokens, mask, loss, logits, grads = reference
  mesh = sharding.make_mesh(shape)
  rules = tuple((n, batch_rule if n == "batch" else t) for n, t in sharding.DEFAULT_RULES)
  shardings = sharding.tree_shardings(param_logical_axes(CFG), params, mesh, rules)
  for i in range(CFG.n_layers):  # hash and top-k layers: experts on the expert axis
    layer = shardings[f"layers_{i}"]
    for name in ("gate", "up", "down"):
      assert layer["mlp"][name].spec[0] == "expert"
    for site in ("attn_hc", "mlp_hc"):  # mHC replicated
      assert all(s.is_fully_replicated for s in jax.tree.leaves(layer[site]))
  assert all(s.is_fully_replicated for s in jax.tree.leaves(shardings["hc_head"]))
  sharded = jax.device_put(params, shardings)
  batch = sharding.batch_sharding(mesh, rules)
  fn = lambda p, t, m: jax.value_and_grad(_loss(CFG), has_aux=True)(p, t, m)
  args = (sharded, jax.device_put(tokens, batch), jax.device_put(mask, batch))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    # The routed experts of all three layers go through the expert-parallel shard_map.
    assert str(jax.make_jaxpr(fn)(*args)).count("shard_map") >= CFG.n_layers
    (loss_s, logits_s), grads_s = jax.jit(fn)(*args)
  # Sharding only reorders fp32 sums (the psum / reduce-scatter of per-shard expert
  # partials, the fsdp / tensor contractions of D = 32 or H·Dh = 64 terms): ~sqrt(64) eps
  # relative to Σ|terms| per stage; three layers of attention + MoE, two mHC sites each
  # and the head chain ~8 such stages (sqrt(8) in quadrature), with a 16x margin for the
  # max over entries and cancellation: 8 · 3 · 16 ≈ 400 eps of the largest |value|.
  tol = lambda ref: 400 * EPS * float(jnp.max(jnp.abs(ref)))
  np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits), atol=tol(logits), rtol=0)
  np.testing.assert_allclose(float(loss_s), float(loss), rtol=400 * EPS)
  worst = 0.0
  for (path, g), g_s in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(grads_s)):
    err = float(np.max(np.abs(np.asarray(g_s) - np.asarray(g))))
    worst = max(worst, err / max(float(np.max(np.abs(g))), 1e-30))
    np.testing.assert_allclose(np.asarray(g_s), np.asarray(g), atol=tol(g) + 1e-12, rtol=0,
                               err_msg=jax.tree_util.keystr(path))
  print(f"V4 sharded {shape} vs unsharded: logits",
        float(jnp.max(jnp.abs(logits_s - logits)) / jnp.max(jnp.abs(logits))),
        "grads (worst per-param, of its max)", worst)
