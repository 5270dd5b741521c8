"""DeepSeek-V4's auxiliary-loss-free balancing: the sqrtsoftplus top-k layers' selection
bias moves by ``γ sign(mean load − load)`` after the step, outside the gradient
(``opd.models.moe_balance``), on a constructed imbalance; hash-routed layers have no bias."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import forward, init_params
from opd.models import moe_balance
from v4_family import tiny_v4

GAMMA = 0.05
BASE = tiny_v4()
CFG = tiny_v4(moe=dataclasses.replace(BASE.moe, bias_update_rate=GAMMA))
MOE_LAYERS = [i for i, t in enumerate(CFG.v4.mlp_layer_types) if t == "moe"]  # [1, 2]
B, T = 4, 12


@pytest.fixture(scope="module")
def setup():
  params = init_params(CFG, jax.random.key(0))
  # The imbalance: a selection bias of 5 on experts 0 and 1. Scores sqrt(softplus(z)) of
  # the 0.02-init router logits lie near sqrt(ln 2) ≈ 0.83 (|z| << 1), so every token's
  # top-2 of s + b is {0, 1}: experts 0, 1 get every real token, the others none.
  for i in MOE_LAYERS:
    params[f"layers_{i}"]["mlp"]["selection_bias"] = jnp.zeros(8).at[:2].set(5.0)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
  mask = jnp.asarray(np.arange(T)[None, :] >= np.array([[0], [3], [0], [5]]))  # left padding
  return params, tokens, mask


def test_bias_moves_against_the_load(setup):
  params, tokens, mask = setup
  out = forward(CFG, params, tokens, None, mask)
  n = int(np.sum(np.asarray(mask)))
  for i in MOE_LAYERS:  # the construction: experts 0, 1 take every real token
    np.testing.assert_array_equal(np.asarray(out.moe.counts[i]), [n, n] + [0] * 6)
  _, metrics = moe_balance.balance_terms(CFG.moe, out.moe)
  hook = moe_balance.bias_update_hook(CFG)
  new, metrics = hook(params, metrics)
  assert moe_balance.COUNTS_KEY not in metrics
  for i in MOE_LAYERS:
    # mean load 2n/8 = n/4: experts 0, 1 are above it and lose γ, the rest gain γ.
    want = np.array([5.0 - GAMMA] * 2 + [GAMMA] * 6, np.float32)
    np.testing.assert_array_equal(np.asarray(new[f"layers_{i}"]["mlp"]["selection_bias"]), want)
  assert "selection_bias" not in new["layers_0"]["mlp"]  # the hash layer has none
  np.testing.assert_array_equal(np.asarray(new["layers_0"]["mlp"]["tid2eid"]),
                                np.asarray(params["layers_0"]["mlp"]["tid2eid"]))
  # Nothing else moves.
  flat = lambda p: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(p)[0]}
  for k, v in flat(new).items():
    if "selection_bias" not in k:
      np.testing.assert_array_equal(np.asarray(v), np.asarray(flat(params)[k]), err_msg=k)


def test_repeated_updates_balance_the_load():
  # A milder imbalance on routers whose scores differ per token (weights 50x the init,
  # logits O(1)): a bias of 1 on experts 0, 1 makes them take most tokens, max load ~1.9x
  # the mean. Each update moves every bias by γ towards the mean load; after 60 steps
  # the spread stays near 1 (measured 1.09 on this batch), as DeepSeek-V3's balancing.
  params = init_params(CFG, jax.random.key(0))
  for i in MOE_LAYERS:
    mlp = params[f"layers_{i}"]["mlp"]
    mlp["selection_bias"] = jnp.zeros(8).at[:2].set(1.0)
    mlp["router"] = mlp["router"] * 50.0
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (8, 16)), jnp.int32)
  mask = jnp.ones((8, 16), bool)
  step = jax.jit(lambda p, t, m: forward(CFG, p, t, None, m).moe.counts)
  spread = []
  for _ in range(60):
    counts = step(params, tokens, mask)
    load = np.asarray(counts)[MOE_LAYERS]
    spread.append(float(np.max(load) / np.mean(load)))
    params = moe_balance.update_selection_bias(CFG, params, counts)
  assert spread[0] > 1.8
  assert max(spread[-10:]) < 1.25


def test_bias_is_outside_the_gradient(setup):
  params, tokens, mask = setup

  def loss(p):
    out = forward(CFG, p, tokens, None, mask)
    lp = jax.nn.log_softmax(out.logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1)) + (
        moe_balance.aux_loss(CFG.moe, out.moe))

  grads = jax.grad(loss)(params)
  for i in MOE_LAYERS:
    assert not np.any(np.asarray(grads[f"layers_{i}"]["mlp"]["selection_bias"]))
    assert np.any(np.asarray(grads[f"layers_{i}"]["mlp"]["router"]))


def test_rate_zero_and_bad_configs():
  params = init_params(BASE, jax.random.key(0))
  assert moe_balance.update_selection_bias(BASE, params, jnp.zeros((3, 8))) is params
  assert moe_balance.bias_update_hook(BASE) is None
  with pytest.raises(ValueError, match="counts hold 2 MoE layers, the config has 3"):
    moe_balance.update_selection_bias(CFG, params, jnp.zeros((2, 8)))
  from opd.models.moe import MoEConfig
  with pytest.raises(ValueError, match="bias_update_rate=0.1 needs router='sigmoid' or "
                                       "'sqrtsoftplus'"):
    MoEConfig(router="softmax", bias_update_rate=0.1)
