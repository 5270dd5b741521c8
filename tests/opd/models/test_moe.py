"""opd.models.moe / moe_balance: routing, dispatch, expert parallelism, balancing."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import ModelConfig, forward, init_params, param_logical_axes
from opd.models import moe as moe_lib
from opd.models import moe_balance
from opd.models.moe import MoEConfig
from opd.parallel import sharding

EPS = np.finfo(np.float32).eps


def np_route(logits, moe: MoEConfig, bias=None):
  """DeepSeek-V3 / Qwen3-MoE routing in float64 numpy, one token at a time."""
  logits = np.asarray(logits, np.float64)
  if moe.router == "softmax":
    e = np.exp(logits - logits.max(-1, keepdims=True))
    s = e / e.sum(-1, keepdims=True)
  else:
    s = 1 / (1 + np.exp(-logits))
  c = s + (0 if bias is None else np.asarray(bias, np.float64))
  E, k, G = moe.n_routed_experts, moe.experts_per_token, moe.n_group
  experts, weights = [], []
  for row_s, row_c in zip(s, c):
    row_c = row_c.copy()
    if G > 1:
      groups = row_c.reshape(G, E // G)
      top2 = -np.sort(-groups, axis=1)[:, :2].sum(1)
      kept = np.argsort(-top2, kind="stable")[:moe.topk_group]  # ties: lower group first
      for g in set(range(G)) - set(kept):
        row_c[g * (E // G):(g + 1) * (E // G)] = -np.inf
    idx = np.argsort(-row_c, kind="stable")[:k]  # ties: lower expert first
    w = row_s[idx]
    if moe.norm_topk_prob:
      w = w / w.sum()
    experts.append(idx)
    weights.append(w * moe.routed_scaling_factor)
  return np.array(experts), np.array(weights)


SOFTMAX = MoEConfig(n_routed_experts=8, experts_per_token=3, router="softmax")
SIGMOID = MoEConfig(n_routed_experts=16, experts_per_token=4, router="sigmoid", n_group=4,
                    topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1)


@pytest.mark.parametrize("moe", [SOFTMAX, dataclasses.replace(SOFTMAX, norm_topk_prob=False),
                                 SIGMOID, dataclasses.replace(SIGMOID, norm_topk_prob=False)],
                         ids=["softmax_norm", "softmax_raw", "sigmoid_groups_norm",
                              "sigmoid_groups_raw"])
def test_route_matches_numpy(moe):
  rng = np.random.default_rng(0)
  E = moe.n_routed_experts
  logits = rng.normal(size=(64, E)).astype(np.float32)
  # Ties: a row of equal logits, and a row whose best two experts tie.
  logits[0] = 0.5
  logits[1, [2, 5]] = 4.0
  bias = rng.normal(scale=0.3, size=E).astype(np.float32) if moe.router == "sigmoid" else None
  r = moe_lib.route(jnp.asarray(logits), moe, None if bias is None else jnp.asarray(bias))
  experts, weights = np_route(logits, moe, bias)
  np.testing.assert_array_equal(np.asarray(r.experts), experts)
  # Weights: a k-term fp32 normalisation of fp32 scores -> a few eps relative.
  np.testing.assert_allclose(np.asarray(r.weights), weights, rtol=8 * EPS, atol=0)
  if bias is None:  # (the bias breaks the ties of the sigmoid cases)
    assert list(np.asarray(r.experts[1, :2])) == [2, 5]  # the tie goes to the lower index
    assert list(np.asarray(r.experts[0])) == [0, 1, 2]


def test_group_limited_choice_can_skip_the_best_expert():
  # Groups of 2 experts; expert 0 has the highest score, but its partner is
  # the worst, so group 0's top-2 sum loses to groups 1 and 2 (both experts
  # high): with topk_group=2 expert 0 must not be chosen.
  moe = MoEConfig(n_routed_experts=8, experts_per_token=2, router="sigmoid", n_group=4,
                  topk_group=2)
  logits = np.array([[6.0, -6.0, 2.0, 2.0, 1.5, 1.5, -1.0, -1.0]], np.float32)
  r = moe_lib.route(jnp.asarray(logits), moe)
  assert sorted(np.asarray(r.experts[0]).tolist()) == [2, 3]
  # Without groups, expert 0 wins.
  flat = moe_lib.route(jnp.asarray(logits), dataclasses.replace(moe, n_group=1, topk_group=1))
  assert np.asarray(flat.experts[0, 0]) == 0


def test_bias_selects_but_does_not_weight():
  moe = MoEConfig(n_routed_experts=4, experts_per_token=1, router="sigmoid", norm_topk_prob=False)
  logits = jnp.array([[2.0, 0.0, -1.0, 1.0]])
  bias = jnp.array([0.0, 0.0, 5.0, 0.0])  # pushes expert 2 (the lowest score) to the top
  r = moe_lib.route(logits, moe, bias)
  assert int(r.experts[0, 0]) == 2
  np.testing.assert_allclose(float(r.weights[0, 0]), 1 / (1 + np.exp(1.0)), rtol=4 * EPS)
  # No gradient reaches the bias through the selection.
  g = jax.grad(lambda b: jnp.sum(moe_lib.route(logits, moe, b).weights))(bias)
  assert np.all(np.asarray(g) == 0)


def _dispatch_inputs(seed=0, N=24, D=16, F=8, E=6, k=2):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(size=(N, k)), jnp.float32)
  w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
       for s in ((E, D, F), (E, D, F), (E, F, D))]
  return x, experts, weights, w


def test_ragged_dispatch_equals_onehot_forward_and_grads():
  x, experts, weights, (wg, wu, wd) = _dispatch_inputs()
  ragged = lambda x, w, a, b, c: moe_lib.experts_ragged(x, experts, w, a, b, c)[0]
  onehot = lambda x, w, a, b, c: moe_lib.experts_onehot(x, experts, w, a, b, c)
  y_r, y_o = ragged(x, weights, wg, wu, wd), onehot(x, weights, wg, wu, wd)
  # Same products; the one-hot path adds E - k exact zeros and sums in another
  # order: D=16 / F=8-term dot products reordered move by <= 16 eps x Σ|terms|.
  scale = float(jnp.max(jnp.abs(y_o)))
  np.testing.assert_allclose(np.asarray(y_r), np.asarray(y_o), atol=16 * EPS * scale * 4, rtol=0)
  _, pairs = moe_lib.experts_ragged(x, experts, weights, wg, wu, wd)
  assert int(pairs) == experts.size  # dropless
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  g_r = jax.grad(loss(ragged), argnums=(0, 1, 2, 3, 4))(x, weights, wg, wu, wd)
  g_o = jax.grad(loss(onehot), argnums=(0, 1, 2, 3, 4))(x, weights, wg, wu, wd)
  for a, b in zip(g_r, g_o):
    tol = 16 * EPS * 4 * float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=0)


def test_local_experts_only():
  # An expert shard [2, 4) computes exactly the pairs routed to experts 2, 3.
  x, experts, weights, (wg, wu, wd) = _dispatch_inputs(seed=1)
  y, pairs = moe_lib.experts_ragged(x, experts, weights, wg[2:4], wu[2:4], wd[2:4], 2)
  local = (experts >= 2) & (experts < 4)
  ref = moe_lib.experts_onehot(x, experts, weights * local, wg, wu, wd)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref),
                             atol=64 * EPS * float(jnp.max(jnp.abs(ref))), rtol=0)
  assert int(pairs) == int(jnp.sum(local))


def test_bad_configs_name_the_field():
  with pytest.raises(ValueError, match="experts_per_token=9 exceeds n_routed_experts=8"):
    MoEConfig(n_routed_experts=8, experts_per_token=9)
  with pytest.raises(ValueError, match="n_routed_experts=10 is not divisible by n_group=4"):
    MoEConfig(n_routed_experts=10, n_group=4, topk_group=1)
  with pytest.raises(ValueError, match="topk_group=3 exceeds n_group=2"):
    MoEConfig(n_routed_experts=8, n_group=2, topk_group=3)
  with pytest.raises(ValueError, match="router"):
    MoEConfig(router="relu")
  with pytest.raises(ValueError, match="bias_update_rate"):
    MoEConfig(bias_update_rate=0.01)  # softmax router has no selection bias
  with pytest.raises(ValueError, match="ModelConfig.moe.*experts_per_token"):
    ModelConfig(moe={"n_routed_experts": 2, "experts_per_token": 3})
  with pytest.raises(ValueError, match="first_k_dense=3 exceeds n_layers=2"):
    ModelConfig(n_layers=2, moe=MoEConfig(first_k_dense=3))


def _cfg(moe: MoEConfig, **kw) -> ModelConfig:
  return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                     moe=moe, **kw)


def test_config_dict_round_trip_and_counts():
  cfg = _cfg(dataclasses.replace(SIGMOID, first_k_dense=1))
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  params = init_params(cfg, jax.random.key(0))
  assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(params))
  assert ModelConfig(moe=None) == ModelConfig()  # dense by default, unchanged


def test_expert_axis_not_dividing_experts_is_rejected():
  cfg = _cfg(MoEConfig(n_routed_experts=6, experts_per_token=2))
  params = init_params(cfg, jax.random.key(0))
  mesh = sharding.make_mesh((2, 1, 4, 1))
  tokens = jnp.zeros((2, 4), jnp.int32)
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
    with pytest.raises(ValueError, match="n_routed_experts=6 is not divisible by the mesh's "
                                         "'expert' axis of size 4"):
      forward(cfg, params, tokens)


def _loss(cfg):
  def f(params, tokens, mask):
    out = forward(cfg, params, tokens, None, mask)
    lp = jax.nn.log_softmax(out.logits[:, :-1])
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:]) + moe_balance.aux_loss(cfg.moe,
                                                                                    out.moe)
  return f


@pytest.mark.parametrize("shape, batch_rule", [
    ((2, 2, 2, 1), ("data", "fsdp")),  # (data, fsdp, expert): tokens replicated over expert
    ((2, 1, 2, 2), ("data", "expert")),  # (data, expert, tensor): tokens sharded over expert
    ((4, 2, 1), ("data", "fsdp")),  # the dense 3-axis mesh: experts whole on every device
], ids=["data_fsdp_expert", "data_expert_tensor", "data_fsdp_no_expert_axis"])
def test_expert_parallel_equals_unsharded(shape, batch_rule):
  moe = dataclasses.replace(SIGMOID, n_routed_experts=8, n_group=2, topk_group=1,
                            experts_per_token=2, moe_d_ff=16, aux_loss_coef=0.01,
                            seq_aux_loss_coef=0.01, first_k_dense=1)
  cfg = _cfg(moe)
  params = init_params(cfg, jax.random.key(1))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (8, 6)), jnp.int32)
  mask = jnp.asarray(np.arange(6)[None, :] >= rng.integers(0, 3, (8, 1)))  # left padding
  loss, grads = jax.value_and_grad(_loss(cfg))(params, tokens, mask)
  logits = forward(cfg, params, tokens, None, mask).logits

  mesh = sharding.make_mesh(shape)
  rules = tuple((n, batch_rule if n == "batch" else t) for n, t in sharding.DEFAULT_RULES)
  shardings = sharding.tree_shardings(param_logical_axes(cfg), params, mesh, rules)
  assert shardings["layers_1"]["mlp"]["gate"].spec[0] == ("expert" if len(shape) == 4 else None)
  sharded = jax.device_put(params, shardings)
  batch = sharding.batch_sharding(mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    fn = jax.jit(lambda p, t, m: (jax.value_and_grad(_loss(cfg))(p, t, m),
                                  forward(cfg, p, t, None, m).logits))
    (loss_s, grads_s), logits_s = fn(sharded, jax.device_put(tokens, batch),
                                     jax.device_put(mask, batch))
  # Sharding reorders fp32 sums (the psum of per-shard expert partials, the
  # fsdp / tensor matmul reductions): D=32-term sums, ~sqrt(32) eps relative
  # to Σ|terms| per stage, 2 layers + head in quadrature; 16x margin for the
  # max over entries -> 64 eps of the largest |value|.
  tol = lambda ref: 64 * EPS * float(jnp.max(jnp.abs(ref)))
  np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits), atol=tol(logits), rtol=0)
  np.testing.assert_allclose(float(loss_s), float(loss), rtol=64 * EPS)
  for (path, g), g_s in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(grads_s)):
    np.testing.assert_allclose(np.asarray(g_s), np.asarray(g), atol=tol(g) + 1e-12, rtol=0,
                               err_msg=jax.tree_util.keystr(path))


def test_stats_and_balance_losses_match_numpy():
  moe = dataclasses.replace(SOFTMAX, aux_loss_coef=0.5, seq_aux_loss_coef=0.25)
  rng = np.random.default_rng(3)
  B, T, E, k = 3, 5, moe.n_routed_experts, moe.experts_per_token
  logits = rng.normal(size=(B, T, E)).astype(np.float32)
  mask = np.ones((B, T), bool)
  mask[0, :2] = False  # left padding is left out of every statistic
  mask[2, :] = False  # an all-pad row counts in no sequence average
  r = moe_lib.route(jnp.asarray(logits), moe)
  stats = moe_balance.stack_stats([moe_balance.router_stats(moe, r, jnp.asarray(mask), 0)])
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  chosen = np.zeros((B, T, E))
  np.put_along_axis(chosen, np.asarray(r.experts), 1, axis=-1)
  m = mask[..., None]
  n = mask.sum()
  f, P = (chosen * m).sum((0, 1)) / n, (p * m).sum((0, 1)) / n
  switch = E * np.sum(f * P)
  seq = np.mean([np.sum(E / (k * mask[b].sum()) * chosen[b][mask[b]].sum(0)
                        * p[b][mask[b]].mean(0)) for b in range(2)])
  want = 0.5 * switch + 0.25 * seq
  np.testing.assert_allclose(float(moe_balance.aux_loss(moe, stats)), want, rtol=64 * EPS)
  entropy = -(p * np.log(p)).sum(-1)[mask].mean()
  metrics = moe_balance.router_metrics(stats)
  np.testing.assert_allclose(float(metrics["moe/entropy"]), entropy, rtol=64 * EPS)
  load = (chosen * m).sum((0, 1)) * E / (n * k)
  np.testing.assert_allclose([float(metrics[f"moe/load/e{e}"]) for e in range(E)], load,
                             rtol=8 * EPS)
  assert int(metrics["moe/dropped"]) == 0


def test_bias_update_direction():
  # Constructed imbalance: expert 0 overloaded, expert 1 idle, 2 and 3 at the mean.
  new = moe_balance.bias_update(jnp.zeros(4), jnp.array([10.0, 0.0, 5.0, 5.0]), 0.1)
  np.testing.assert_array_equal(np.asarray(new), np.float32([-0.1, 0.1, 0.0, 0.0]))
  # End to end: a model whose router is biased towards expert 0 routes most
  # tokens there; one update lowers that bias and raises the idle experts',
  # and touches nothing else.
  moe = MoEConfig(n_routed_experts=4, experts_per_token=1, router="sigmoid",
                  bias_update_rate=0.05)
  cfg = _cfg(moe)
  params = init_params(cfg, jax.random.key(0))
  for i in range(2):
    params["layers_" + str(i)]["mlp"]["selection_bias"] = jnp.array([1.0, 0.0, 0.0, 0.0])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 8)), jnp.int32)
  stats = forward(cfg, params, tokens).moe
  assert np.all(np.asarray(stats.counts)[:, 0] == 32)  # every token went to expert 0
  new = moe_balance.update_selection_bias(cfg, params, stats.counts)
  for i in range(2):
    b = np.asarray(new[f"layers_{i}"]["mlp"]["selection_bias"])
    np.testing.assert_allclose(b, [0.95, 0.05, 0.05, 0.05], rtol=4 * EPS)
  same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), params, new)
  same["layers_0"]["mlp"].pop("selection_bias")
  same["layers_1"]["mlp"].pop("selection_bias")
  assert all(jax.tree.leaves(same))
  np.testing.assert_array_equal(np.asarray(params["layers_0"]["mlp"]["selection_bias"]),
                                [1.0, 0.0, 0.0, 0.0])  # the input tree is untouched
