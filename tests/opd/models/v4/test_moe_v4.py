"""DeepSeek-V4 MoE layers (opd.models.v4.moe) against transformers' DeepseekV4SparseMoeBlock."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from opd.models.moe import MoEConfig
from opd.models.v4.moe import V4MoE, V4MoEConfig, default_tid2eid
from v4_torch import moe_config, moe_params, np_, randomize, rel_err, tiny_config

B, T = 2, 6


@pytest.fixture(scope="module")
def case():
  cfg_hf = tiny_config()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, T, cfg_hf.hidden_size)).astype(np.float32)
  ids = rng.integers(0, cfg_hf.vocab_size, size=(B, T))
  blocks = {}
  for layer, mlp_type in enumerate(cfg_hf.mlp_layer_types):
    block = hf.DeepseekV4SparseMoeBlock(cfg_hf, layer)
    randomize(block, seed=layer, std=0.5)
    with torch.no_grad():
      if mlp_type == "hash_moe":  # k distinct random experts per token id
        table = np.stack([rng.permutation(cfg_hf.n_routed_experts)[:cfg_hf.num_experts_per_tok]
                          for _ in range(cfg_hf.vocab_size)])
        block.gate.tid2eid.copy_(torch.from_numpy(table))
      else:  # a selection bias large enough to change some top-k choices
        block.gate.e_score_correction_bias.copy_(torch.from_numpy(
            rng.normal(size=cfg_hf.n_routed_experts).astype(np.float32)))
    blocks[mlp_type] = block
  return cfg_hf, x, ids, blocks


@pytest.mark.parametrize("mlp_type", ["hash_moe", "moe"])
def test_v4_moe_matches_transformers(case, mlp_type):
  # Tolerance: each output sums D = 32 products into the gate/up pre-activations,
  # Fe = 16 into the expert output and k + 1 = 3 experts: <= (32 + 16 + 3) ε relative per
  # term, amplified by the cancellation max|terms| / max|y| (< 10 here): ~6e-5 < 1e-4.
  cfg_hf, x, ids, blocks = case
  block = blocks[mlp_type]
  cfg = moe_config(cfg_hf, mlp_type)
  with torch.no_grad():
    hashed = mlp_type == "hash_moe"
    gate_args = (torch.from_numpy(x),) + ((torch.from_numpy(ids),) if hashed else ())
    _, w_t, idx_t = block.gate(*gate_args)
    y_t = block(torch.from_numpy(x), input_ids=torch.from_numpy(ids))
  y, r = jax.jit(V4MoE(cfg).apply)(moe_params(block, cfg), jnp.asarray(x), jnp.asarray(ids))
  experts = np.asarray(r.experts).reshape(B * T, -1)
  weights = np.asarray(r.weights).reshape(B * T, -1)
  idx_t, w_t = idx_t.numpy(), np_(w_t)
  if mlp_type == "hash_moe":  # the assignment is the table's row, in the table's order
    np.testing.assert_array_equal(experts, idx_t)
    np.testing.assert_array_equal(experts, block.gate.tid2eid.numpy()[ids.reshape(-1)])
  else:  # torch.topk(sorted=False): compare as sets, weights in expert order
    o, ot = np.argsort(experts, -1), np.argsort(idx_t, -1)
    experts, weights = np.take_along_axis(experts, o, -1), np.take_along_axis(weights, o, -1)
    idx_t, w_t = np.take_along_axis(idx_t, ot, -1), np.take_along_axis(w_t, ot, -1)
    np.testing.assert_array_equal(experts, idx_t)
  errs = {"weights": rel_err(weights, w_t), "y": rel_err(y, np_(y_t))}
  print(f"V4 {mlp_type} parity (max rel err):", errs)
  assert max(errs.values()) <= 1e-4, errs


def test_v4_moe_clip_and_bias_matter(case):
  # The case must exercise what it claims: the clip is active and the bias changes choices.
  cfg_hf, x, ids, blocks = case
  cfg = moe_config(cfg_hf, "moe")
  variables = moe_params(blocks["moe"], cfg)
  y, r = V4MoE(cfg).apply(variables, jnp.asarray(x))
  unclipped = V4MoEConfig(d_model=cfg.d_model, moe=cfg.moe, swiglu_limit=1e9)
  y_free, _ = V4MoE(unclipped).apply(variables, jnp.asarray(x))
  assert rel_err(y_free, y) > 0.1
  no_bias = jax.tree.map(lambda a: a, variables)
  no_bias["params"]["selection_bias"] = jnp.zeros_like(variables["params"]["selection_bias"])
  _, r0 = V4MoE(cfg).apply(no_bias, jnp.asarray(x))
  assert np.any(np.sort(r0.experts, -1) != np.sort(r.experts, -1))


def test_v4_moe_onehot_equals_ragged_and_every_param_gets_a_gradient(case):
  cfg_hf, x, ids, _ = case
  for mlp_type in ("hash_moe", "moe"):
    cfg_r, cfg_o = moe_config(cfg_hf, mlp_type), moe_config(cfg_hf, mlp_type, "onehot")
    variables = nn.unbox(V4MoE(cfg_r).init(jax.random.key(0), jnp.asarray(x), jnp.asarray(ids)))
    loss = lambda p, c: jnp.sum(V4MoE(c).apply({**variables, "params": p}, jnp.asarray(x),
                                               jnp.asarray(ids))[0] ** 2)
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (l_r, g_r), (l_o, g_o) = (grad(variables["params"], c) for c in (cfg_r, cfg_o))
    # Same sums in another order: rounding of a few ε·(D + Fe) relative.
    assert abs(float(l_r - l_o)) <= 1e-5 * abs(float(l_o))
    for name, g in g_r.items():
      if name in ("selection_bias", "tid2eid"):  # steer selection only: no gradient by design
        assert float(jnp.max(jnp.abs(g))) == 0.0
        continue
      assert float(jnp.max(jnp.abs(g))) > 0, (mlp_type, name)
      assert rel_err(g, g_o[name]) <= 1e-4, (mlp_type, name)


def test_default_hash_table_and_errors():
  moe = MoEConfig(n_routed_experts=5, experts_per_token=3, n_shared_experts=1,
                  router="sqrtsoftplus")
  t = np.asarray(default_tid2eid(7, moe))
  assert t.shape == (7, 3) and all(len(set(row)) == 3 for row in t) and t.max() < 5
  cfg = V4MoEConfig(d_model=8, moe=moe, mlp_type="hash_moe", vocab_size=7)
  with pytest.raises(ValueError, match="token_ids"):
    V4MoE(cfg).init(jax.random.key(0), jnp.zeros((1, 2, 8)))
  with pytest.raises(ValueError, match="norm_topk_prob"):
    V4MoEConfig(d_model=8, moe=MoEConfig(n_shared_experts=1, norm_topk_prob=False))
  with pytest.raises(ValueError, match="n_shared_experts"):
    V4MoEConfig(d_model=8, moe=MoEConfig(n_shared_experts=2))
  with pytest.raises(ValueError, match="mlp_type"):
    V4MoEConfig(d_model=8, moe=MoEConfig(n_shared_experts=1), mlp_type="dense")
