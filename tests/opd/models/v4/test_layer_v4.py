"""A whole DeepSeek-V4 decoder layer (opd.models.v4.layer) against transformers'
DeepseekV4DecoderLayer: mHC + attention + MoE, for each attention type and both MLP types."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from opd.models.v4.hyper import HyperConfig
from opd.models.v4.layer import V4DecoderLayer, V4LayerConfig
from v4_torch import (RATES, attention_config, attention_params, compressed_attention_config,
                      moe_config, moe_params, np_, randomize, rel_err, tiny_config)

B, T = 2, 20


def _hc(mod):
  return {"proj": np_(mod.fn).T, "bias": np_(mod.base), "scale": np_(mod.scale)}


@pytest.mark.parametrize("layer_type,mlp_type", [("sliding_attention", "hash_moe"),
                                                 ("compressed_sparse_attention", "moe"),
                                                 ("heavily_compressed_attention", "moe")])
def test_decoder_layer_matches_transformers(layer_type, mlp_type):
  # Tolerance: the layer chains two mHC sites (each <= ~7e-5 worst case, test_hyper), the
  # attention (~7e-5: ~140 ε times |logit| <= 4) and the MoE (~6e-5); the blocks' outputs
  # reach the streams through post < 2 and the doubly stochastic comb, so the worst case
  # (every rounding aligned) sums to ~3e-4. Roundings of random sign add as a random walk,
  # ~sqrt(terms) ε ≈ 1e-6 here (measured ~2e-7); the 1e-4 parity target sits between the
  # two and is what the task asks of every V4 piece.
  c = tiny_config(layer_types=[layer_type] * 2, mlp_layer_types=[mlp_type] * 2,
                  compress_rates=RATES, index_n_heads=4, index_head_dim=12, index_topk=2)
  c._attn_implementation = "eager"
  layer = hf.DeepseekV4DecoderLayer(c, layer_idx=0).eval()
  randomize(layer, seed=11, std=0.3)
  rng = np.random.default_rng(3)
  if mlp_type == "hash_moe":
    with torch.no_grad():
      layer.mlp.gate.tid2eid.copy_(torch.from_numpy(np.stack(
          [rng.permutation(c.n_routed_experts)[:c.num_experts_per_tok]
           for _ in range(c.vocab_size)])))
  h = rng.normal(size=(B, T, c.hc_mult, c.hidden_size)).astype(np.float32)
  ids = rng.integers(0, c.vocab_size, size=(B, T))
  ht = torch.from_numpy(h)
  pos = torch.arange(T)[None].expand(B, -1)
  mask = create_sliding_window_causal_mask(config=c, inputs_embeds=ht[:, :, 0], attention_mask=None,
                                           cache=None, position_ids=pos)
  rot = hf.DeepseekV4RotaryEmbedding(c)
  pe = {k: rot(ht, pos, layer_type=k) for k in ("main", "compress")}
  with torch.no_grad():
    out_t = layer(ht, input_ids=torch.from_numpy(ids), position_embeddings=pe,
                  position_ids=pos, attention_mask=mask)
  attn_cfg = (attention_config(c) if layer_type == "sliding_attention"
              else compressed_attention_config(c, layer_type))
  cfg = V4LayerConfig(hyper=HyperConfig(d_model=c.hidden_size, n_streams=c.hc_mult,
                                        sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                                        norm_eps=c.rms_norm_eps),
                      attention=attn_cfg, moe=moe_config(c, mlp_type), norm_eps=c.rms_norm_eps)
  mv = moe_params(layer.mlp, cfg.moe)
  params = {"attn_hc": _hc(layer.attn_hc), "mlp_hc": _hc(layer.ffn_hc),
            "attn_norm": {"scale": np_(layer.input_layernorm.weight)},
            "mlp_norm": {"scale": np_(layer.post_attention_layernorm.weight)},
            "attn": attention_params(layer.self_attn, attn_cfg)["params"], "mlp": mv["params"]}
  variables = {"params": jax.tree.map(jnp.asarray, params)}
  out, _, _ = jax.jit(V4DecoderLayer(cfg).apply)(variables, jnp.asarray(h), jnp.asarray(pos.numpy()),
                                               jnp.asarray(ids))
  err = rel_err(out, np_(out_t))
  print(f"V4 decoder layer {layer_type}/{mlp_type} parity (max rel err):", err)
  assert err <= 1e-4
  # The layer changed the streams (the check is not comparing two copies of the input).
  assert rel_err(out, h) > 1e-2


def test_layer_config_rejects_mismatched_widths():
  c = tiny_config()
  with pytest.raises(ValueError, match="d_model differ"):
    V4LayerConfig(hyper=HyperConfig(d_model=16), attention=attention_config(c),
                  moe=moe_config(c, "moe"))
