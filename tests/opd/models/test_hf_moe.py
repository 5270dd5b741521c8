"""Qwen3-MoE HF interop: logits (and balance loss) parity with ``transformers`` both ways.

The reference is ``transformers``' ``Qwen3MoeForCausalLM`` on a random tiny
config built here, fp32 on CPU with eager attention, on a batch with a full,
a left-padded and a right-padded row.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from opd.models import ModelConfig, forward, init_params
from opd.models import hf as hfio
from opd.models import moe_balance
from opd.models.moe import MoEConfig
from hf_batches import hf_forward, padded_batch

B, T = 3, 11
HF_KW = dict(vocab_size=200, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
             decoder_sparse_step=1, router_aux_loss_coef=0.01, rope_theta=5000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False)
OURS = ModelConfig(vocab_size=200, d_model=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                   d_ff=64, rope_theta=5000.0, norm_eps=1e-5, qk_norm=True,
                   moe=MoEConfig(n_routed_experts=8, experts_per_token=2, moe_d_ff=24,
                                 norm_topk_prob=True, first_k_dense=1, aux_loss_coef=0.01))

# Both sides compute in float32, each off by ~sqrt(n)·eps relative per
# rounded step (n <= 64, the widest contraction); ~16 steps per layer (the
# dense ones' 14 plus the router and the expert combine), final norm and
# head; max over the logits within ~4 standard deviations; the two errors
# add. Relative to the logits' RMS: about 6e-5. (Routing is discrete: a
# token whose 2nd and 3rd expert scores differ by less than this would flip;
# with random weights the margins are ~1e-2.)
REL_TOL = 2 * 4 * np.sqrt(16 * 3 + 2) * np.sqrt(64) * np.finfo(np.float32).eps


def _padded_batch(vocab, seed=0):
  return padded_batch(vocab, B, T, seed)


def _hf_out(model, tokens, mask, positions):
  return hf_forward(model, tokens, mask, positions, output_router_logits=True)


def _ours(cfg, params, tokens, mask, positions):
  return forward(cfg, params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))


def _assert_close(ours, ref, mask):
  assert ref[mask].std() > 0.3, ref[mask].std()  # the comparison has power
  diff = np.abs(ours[mask] - ref[mask]).max()
  tol = REL_TOL * np.sqrt(np.mean(np.square(ref[mask], dtype=np.float64)))
  assert diff <= tol, f"max |ours - transformers| = {diff} > {tol}"


def _random_hf_model(seed=0):
  config = transformers.Qwen3MoeConfig(**HF_KW)
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = transformers.Qwen3MoeForCausalLM(config).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():  # non-trivial norms, and router weights that spread the experts
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
  return model


@pytest.mark.parametrize("shard", [None, "30KB"], ids=["single", "sharded"])
def test_load_qwen3_moe_matches_transformers(shard, tmp_path):
  model = _random_hf_model()
  model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
  assert os.path.exists(tmp_path / "model.safetensors.index.json") == (shard is not None)
  cfg, params = hfio.load_hf(str(tmp_path))
  assert cfg == OURS
  assert "gate" in params["layers_0"]["mlp"] and params["layers_0"]["mlp"]["gate"].ndim == 2
  assert params["layers_1"]["mlp"]["gate"].shape == (8, 48, 24)  # [E, D, Fe]

  tokens, mask, positions = _padded_batch(cfg.vocab_size)
  ref = _hf_out(model, tokens, mask, positions)
  out = _ours(cfg, params, tokens, mask, positions)
  _assert_close(np.asarray(out.logits), ref.logits.float().numpy(), mask)
  # The Switch balance loss over the real tokens, as transformers' own
  # (unscaled) aux_loss: a few hundred fp32 terms, ~1e-6 relative.
  ours_aux = float(moe_balance.aux_loss(cfg.moe, out.moe)) / cfg.moe.aux_loss_coef
  np.testing.assert_allclose(ours_aux, float(ref.aux_loss), rtol=1e-5)


def _random_ours(cfg, seed):
  abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  rng = np.random.default_rng(seed)
  out = []
  for path, x in leaves:
    noise = rng.standard_normal(x.shape).astype(np.float32)
    is_norm = any("norm" in str(getattr(p, "key", "")) for p in path)
    out.append(jnp.asarray(1.0 + 0.2 * noise if is_norm else 0.15 * noise, x.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def test_save_qwen3_moe_loads_in_transformers(tmp_path):
  cfg = OURS.replace(moe=MoEConfig(n_routed_experts=8, experts_per_token=3, moe_d_ff=24,
                                   norm_topk_prob=False, first_k_dense=0))
  params = _random_ours(cfg, seed=2)
  files = hfio.save_hf(str(tmp_path), cfg, params, max_shard_size="40KB")
  assert len(files) > 1
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
  assert type(model).__name__ == "Qwen3MoeForCausalLM"
  for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
    assert not info.get(key), (key, info[key])
  tokens, mask, positions = _padded_batch(cfg.vocab_size, seed=3)
  _assert_close(np.asarray(_ours(cfg, params, tokens, mask, positions).logits),
                _hf_out(model.eval(), tokens, mask, positions).logits.float().numpy(), mask)
  # Our own round trip is exact; the balance coefficients are not architecture.
  cfg2, params2 = hfio.load_hf(str(tmp_path), config=cfg.replace(
      moe=MoEConfig(**{**cfg.moe.__dict__, "aux_loss_coef": 0.5})))
  assert cfg2.moe.aux_loss_coef == 0.5
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_unsupported_moe_configs_name_the_field(tmp_path):
  with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\]"):
    hfio.config_from_hf({**HF_KW, "model_type": "qwen3_moe", "mlp_only_layers": [1]})
  with pytest.raises(ValueError, match="n_shared_experts"):
    hfio.config_to_hf(OURS.replace(moe=MoEConfig(n_shared_experts=1)))
  with pytest.raises(ValueError, match="'num_experts'"):
    hfio.config_from_hf({k: v for k, v in HF_KW.items() if k != "num_experts"}
                        | {"model_type": "qwen3_moe"})
  with pytest.raises(ValueError, match="cfg.moe"):
    hfio.config_to_hf(OURS, arch="qwen3")
