"""The DeepSeek-V4 stack (opd.models.v4.model) against transformers' DeepseekV4ForCausalLM
logits on a mixed stack: sliding/hash_moe, CSA/moe, HCA/moe."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from opd.models.v4.hyper import HyperConfig
from opd.models.v4.layer import V4LayerConfig
from opd.models.v4.model import V4Model, V4ModelConfig
from v4_torch import (RATES, attention_config, attention_params, compressed_attention_config,
                      moe_config, moe_params, np_, randomize, rel_err, tiny_config)

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
MLPS = ["hash_moe", "moe", "moe"]
B, T = 2, 20  # > sliding_window = 8, 5 CSA windows, 2 HCA windows


def _hc(mod):
  return {"proj": np_(mod.fn).T, "bias": np_(mod.base), "scale": np_(mod.scale)}


def test_mixed_stack_logits_match_transformers():
  # Tolerance: as test_layer_v4 (per layer: worst case ~3e-4, random-walk ~1e-6), three
  # layers, the head's collapse (~7e-5 worst case) and a D = 32 product for the logits;
  # the 1e-4 target stays far above the random-walk figure (measured ~1e-6).
  c = tiny_config(num_hidden_layers=3, layer_types=LAYERS, mlp_layer_types=MLPS,
                  compress_rates=RATES, index_n_heads=4, index_head_dim=12, index_topk=2)
  c._attn_implementation = "eager"
  model = hf.DeepseekV4ForCausalLM(c).eval()
  randomize(model, seed=21, std=0.3)
  rng = np.random.default_rng(4)
  with torch.no_grad():
    model.model.layers[0].mlp.gate.tid2eid.copy_(torch.from_numpy(np.stack(
        [rng.permutation(c.n_routed_experts)[:c.num_experts_per_tok]
         for _ in range(c.vocab_size)])))
  ids = rng.integers(0, c.vocab_size, size=(B, T))
  with torch.no_grad():
    logits_t = model(input_ids=torch.from_numpy(ids)).logits
  hyper = HyperConfig(d_model=c.hidden_size, n_streams=c.hc_mult,
                      sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps, norm_eps=c.rms_norm_eps)
  layers, params, tables = [], {}, {}
  for i, (lt, mt) in enumerate(zip(LAYERS, MLPS)):
    a = attention_config(c) if lt == "sliding_attention" else compressed_attention_config(c, lt)
    lc = V4LayerConfig(hyper=hyper, attention=a, moe=moe_config(c, mt), norm_eps=c.rms_norm_eps)
    layers.append(lc)
    tl = model.model.layers[i]
    mv = moe_params(tl.mlp, lc.moe)
    params[f"layers_{i}"] = {
        "attn_hc": _hc(tl.attn_hc), "mlp_hc": _hc(tl.ffn_hc),
        "attn_norm": {"scale": np_(tl.input_layernorm.weight)},
        "mlp_norm": {"scale": np_(tl.post_attention_layernorm.weight)},
        "attn": attention_params(tl.self_attn, a)["params"], "mlp": mv["params"]}
    if "tables" in mv:
      tables[f"layers_{i}"] = {"mlp": mv["tables"]}
  hh = model.model.hc_head
  params.update(embedding=np_(model.model.embed_tokens.weight),
                hc_head={"proj": np_(hh.hc_fn).T, "bias": np_(hh.hc_base),
                         "scale": np_(hh.hc_scale)},
                final_norm={"scale": np_(model.model.norm.weight)},
                lm_head=np_(model.lm_head.weight).T)
  cfg = V4ModelConfig(vocab_size=c.vocab_size, layers=tuple(layers), norm_eps=c.rms_norm_eps)
  variables = {"params": jax.tree.map(jnp.asarray, params), "tables": tables}
  logits, x = jax.jit(V4Model(cfg).apply)(variables, jnp.asarray(ids))
  err = rel_err(logits, np_(logits_t))
  print("V4 mixed 3-layer stack logits parity (max rel err):", err)
  assert err <= 1e-4
  np.testing.assert_allclose(np.asarray(x @ variables["params"]["lm_head"]), np.asarray(logits),
                             rtol=0, atol=1e-6 * float(np.abs(logits).max()))


def test_model_config_errors():
  c = tiny_config()
  hyper = HyperConfig(d_model=c.hidden_size)
  layer = V4LayerConfig(hyper=hyper, attention=attention_config(c), moe=moe_config(c, "hash_moe"))
  with pytest.raises(ValueError, match="vocab_size=64 must equal vocab_size=65"):
    V4ModelConfig(vocab_size=65, layers=(layer,))
  with pytest.raises(ValueError, match="at least one layer"):
    V4ModelConfig(vocab_size=64, layers=())
