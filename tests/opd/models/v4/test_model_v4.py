"""The DeepSeek-V4 member of the model family (``ModelConfig.v4``, opd.models.v4.model)
against transformers' DeepseekV4ForCausalLM logits on a mixed stack: sliding/hash_moe,
CSA/moe, HCA/moe, through the family's ``forward``."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from opd.models import ModelConfig, forward, head_matrix, init_params
from opd.models.moe import MoEConfig
from opd.models.v4.config import V4Config
from opd.models.v4.model import layer_configs
from v4_torch import (LAYERS, RATES, attention_params, mixed_model, moe_params, np_, rel_err)

MLPS = ["hash_moe", "moe", "moe"]
B, T = 2, 20  # > sliding_window = 8, 5 CSA windows, 2 HCA windows


def _hc(mod):
  return {"proj": np_(mod.fn).T, "bias": np_(mod.base), "scale": np_(mod.scale)}


def family_config(c) -> ModelConfig:
  """Our ``ModelConfig`` for transformers' tiny config ``c``."""
  moe = MoEConfig(n_routed_experts=c.n_routed_experts, experts_per_token=c.num_experts_per_tok,
                  moe_d_ff=c.moe_intermediate_size, n_shared_experts=1, router=c.scoring_func,
                  routed_scaling_factor=c.routed_scaling_factor)
  v4 = V4Config(layer_types=tuple(c.layer_types), mlp_layer_types=tuple(c.mlp_layer_types),
                q_lora_rank=c.q_lora_rank, rope_dim=c.qk_rope_head_dim,
                sliding_window=c.sliding_window, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank,
                csa_compress_rate=RATES["compressed_sparse_attention"],
                hca_compress_rate=RATES["heavily_compressed_attention"],
                compress_rope_theta=c.rope_parameters["compress"]["rope_theta"],
                index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim,
                index_topk=c.index_topk, n_streams=c.hc_mult,
                sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, swiglu_limit=c.swiglu_limit)
  return ModelConfig(vocab_size=c.vocab_size, d_model=c.hidden_size,
                     n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads, n_kv_heads=1,
                     head_dim=c.head_dim, d_ff=c.moe_intermediate_size, rope_theta=c.rope_parameters["main"]["rope_theta"],
                     norm_eps=c.rms_norm_eps, moe=moe, v4=v4)


def family_params(model, cfg: ModelConfig):
  """transformers' DeepseekV4ForCausalLM -> our params (as the HF import must map them)."""
  params = {}
  for i, lc in enumerate(layer_configs(cfg)):
    tl = model.model.layers[i]
    params[f"layers_{i}"] = {
        "attn_hc": _hc(tl.attn_hc), "mlp_hc": _hc(tl.ffn_hc),
        "attn_norm": {"scale": np_(tl.input_layernorm.weight)},
        "mlp_norm": {"scale": np_(tl.post_attention_layernorm.weight)},
        "attn": attention_params(tl.self_attn, lc.attention)["params"],
        "mlp": moe_params(tl.mlp, lc.moe)["params"]}
  hh = model.model.hc_head
  params.update(embedding=np_(model.model.embed_tokens.weight),
                hc_head={"proj": np_(hh.hc_fn).T, "bias": np_(hh.hc_base),
                         "scale": np_(hh.hc_scale)},
                final_norm={"scale": np_(model.model.norm.weight)},
                lm_head=np_(model.lm_head.weight).T)
  return jax.tree.map(jnp.asarray, params)


def test_mixed_stack_logits_match_transformers():
  # Tolerance: as test_layer_v4 (per layer: worst case ~3e-4, random-walk ~1e-6), three
  # layers, the head's collapse (~7e-5 worst case) and a D = 32 product for the logits;
  # the 1e-4 target stays far above the random-walk figure (measured ~1e-6).
  c, model = mixed_model()
  ids = np.random.default_rng(5).integers(0, c.vocab_size, size=(B, T))
  with torch.no_grad():
    logits_t = model(input_ids=torch.from_numpy(ids)).logits
  cfg = family_config(c)
  params = family_params(model, cfg)
  # The family's init builds the same tree (names, shapes) the mapping fills.
  want = jax.tree.map(lambda x: x.shape, init_params(cfg, jax.random.key(0)))
  assert jax.tree.map(lambda x: x.shape, params) == want
  out = forward(cfg, params, jnp.asarray(ids), return_hidden=True)
  err = rel_err(out.logits, np_(logits_t))
  print("V4 mixed 3-layer stack logits parity (max rel err):", err)
  assert err <= 1e-4
  np.testing.assert_allclose(np.asarray(out.hidden @ head_matrix(cfg, params)),
                             np.asarray(out.logits), rtol=0,
                             atol=1e-6 * float(np.abs(out.logits).max()))
  assert out.moe.counts.shape == (3, c.n_routed_experts)


def test_model_config_errors():
  c, _ = mixed_model()
  cfg = family_config(c)
  bad = {"n_kv_heads": (2, "n_kv_heads=2 must be 1"),
         "n_layers": (2, "layer_types has 3 entries, n_layers=2"),
         "moe": (None, "moe must be set with v4"),
         "qk_norm": (True, "qk_norm=True is not supported with v4")}
  for field, (value, match) in bad.items():
    with pytest.raises(ValueError, match=match):
      cfg.replace(**{field: value})
  with pytest.raises(ValueError, match="n_shared_experts=0 must be 1"):
    cfg.replace(moe=dataclasses.replace(cfg.moe, n_shared_experts=0))
  with pytest.raises(ValueError, match="layer_types has 3 entries, mlp_layer_types 2"):
    V4Config(layer_types=LAYERS, mlp_layer_types=MLPS[:2])
  with pytest.raises(ValueError, match="'dense_attention'"):
    V4Config(layer_types=["dense_attention"], mlp_layer_types=["moe"])
  with pytest.raises(ValueError, match="segment_ids"):
    forward(cfg, init_params(cfg, jax.random.key(0)), jnp.zeros((1, 4), jnp.int32),
            segment_ids=jnp.zeros((1, 4), jnp.int32))
  # The config round-trips through a mapping (config groups, checkpoints' metadata).
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(
      init_params(cfg, jax.random.key(0))))
