"""opd.models.lora: the adapter transform, its gradient, a frozen-base train step, export."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from opd.models import ModelConfig, init_params
from opd.models.decoder import forward
from opd.models.hf import load_hf, save_hf
from opd.models.lora import (TARGETS, LoRAConfig, lora_apply, lora_init, lora_merge,
                             lora_param_count)
from opd.training.objectives import next_token_loss
from lora_checks import matrix, opd_loss_and_batch, projected_gradients  # tests/ (on sys.path via conftest.py)

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=48, qk_norm=True)
LORA = LoRAConfig(rank=3, alpha=6.0)


def _random_adapters(cfg, lora, seed):
  """Adapters with a non-zero b, so every delta has rank r."""
  adapters = lora_init(cfg, lora, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape)
                                      for x, k in zip(leaves, keys)])


_matrix = matrix


def test_apply_is_w_plus_scaled_product_of_rank_r():
  params = init_params(CFG, jax.random.key(0))
  adapters = _random_adapters(CFG, LORA, 1)
  out = lora_apply(params, adapters, LORA)
  assert out["embedding"] is params["embedding"]  # untouched weights pass through
  for layer in ("layers_0", "layers_1"):
    for name, (module, n_in, _) in TARGETS.items():
      a, b = adapters[layer][module][name]["a"], adapters[layer][module][name]["b"]
      w = params[layer][module][name]
      # numpy reference: flatten in/out axes into a matrix product.
      ref = _matrix(w, n_in) + LORA.scale * _matrix(a, n_in) @ _matrix(b, 1)
      got = _matrix(out[layer][module][name], n_in)
      np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
      assert np.linalg.matrix_rank(got - _matrix(w, n_in), tol=1e-5) == LORA.rank


def test_fresh_adapters_leave_the_model_unchanged():
  params = init_params(CFG, jax.random.key(0))
  out = lora_apply(params, lora_init(CFG, LORA, jax.random.key(1)), LORA)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), out, params)
  # r (in + out) per weight: q/k/v/gate/up are [32 | ...], o is [64 | 32], down is [48 | 32].
  per_layer = 3 * ((32 + 64) + 2 * (32 + 32) + (64 + 32) + 2 * (32 + 48) + (48 + 32))
  assert lora_param_count(CFG, LORA) == 2 * per_layer == sum(
      x.size for x in jax.tree.leaves(lora_init(CFG, LORA, jax.random.key(1))))


def _opd_loss_and_batch():
  """The fused full-vocabulary OPD loss with one teacher of width 24."""
  return opd_loss_and_batch(CFG)


def _lm_loss_and_batch():
  tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, CFG.vocab_size)
  return next_token_loss(CFG), {"tokens": tokens}


@pytest.mark.parametrize("make", [_lm_loss_and_batch, _opd_loss_and_batch],
                         ids=["next_token", "opd_full"])
def test_adapter_gradient_is_the_full_gradient_projected(make):
  params = init_params(CFG, jax.random.key(0))
  adapters = _random_adapters(CFG, LORA, 2)
  loss, batch = make()
  key = jax.random.key(4)
  g_ad = jax.grad(lambda ad: loss(lora_apply(params, ad, LORA), batch, key)[0])(adapters)
  g_full = jax.grad(lambda p: loss(p, batch, key)[0])(lora_apply(params, adapters, LORA))
  expected = projected_gradients(adapters, g_full, LORA.scale, ("layers_0", "layers_1"))
  for (layer, name), (da, db, g) in expected.items():
    module, n_in, _ = TARGETS[name]
    assert np.abs(g).max() > 1e-5  # a gradient that could disagree
    # Chain rule on W = W0 + s a b: dL/da = s g b^T, dL/db = s a^T g.
    np.testing.assert_allclose(_matrix(g_ad[layer][module][name]["a"], n_in), da, rtol=1e-4,
                               atol=1e-7)
    np.testing.assert_allclose(_matrix(g_ad[layer][module][name]["b"], 1), db, rtol=1e-4,
                               atol=1e-7)


def test_merged_export_equals_the_adapted_forward(tmp_path):
  params = init_params(CFG, jax.random.key(0))
  adapters = _random_adapters(CFG, LORA, 5)
  tokens = jax.random.randint(jax.random.key(6), (2, 7), 0, CFG.vocab_size)
  adapted = forward(CFG, lora_apply(params, adapters, LORA), tokens).logits
  save_hf(str(tmp_path / "hf"), CFG, lora_merge(params, adapters, LORA), arch="qwen3")
  cfg2, loaded = load_hf(str(tmp_path / "hf"))
  exported = forward(cfg2, loaded, tokens).logits
  np.testing.assert_array_equal(np.asarray(exported), np.asarray(adapted))


def test_adapters_orbax_round_trip(tmp_path):
  adapters = _random_adapters(CFG, LORA, 7)
  ckpt = ocp.PyTreeCheckpointer()
  ckpt.save(tmp_path / "lora", adapters)
  restored = ckpt.restore(tmp_path / "lora")
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               restored, adapters)


@pytest.mark.parametrize("kw, needle", [
    ({"rank": 0}, "LoRAConfig.rank"),
    ({"alpha": -1.0}, "LoRAConfig.alpha"),
    ({"targets": ("q", "wq")}, r"unknown \['wq'\]"),
    ({"targets": "q"}, "must be a sequence"),
])
def test_bad_config(kw, needle):
  with pytest.raises(ValueError, match=needle):
    LoRAConfig(**kw)


def test_mla_attention_targets_refused():
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=48,
                    mla={"kv_lora_rank": 8})
  with pytest.raises(ValueError, match="uses MLA"):
    lora_init(cfg, LORA, jax.random.key(0))
  assert lora_init(cfg, LoRAConfig(targets=("gate",)), jax.random.key(0))["layers_0"]["mlp"]
