"""DeepSeek-V4 attention (opd.models.v4.attention) against transformers' DeepseekV4Attention
on each layer type: sliding_attention, heavily_compressed_attention, compressed_sparse_attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from opd.models.v4.attention import V4Attention, V4AttentionConfig
from v4_torch import (RATES, attention_config, attention_params, compressed_attention_config,
                      np_, randomize, rel_err, tiny_config)

B, T = 2, 20  # T > sliding_window = 8: the window drops keys; 5 CSA and 2 HCA windows


def _fwd(cfg):
  """The attention's output alone (no cache)."""
  return jax.jit(lambda v, *args: V4Attention(cfg).apply(v, *args)[0])


@pytest.fixture(scope="module")
def case():
  c = tiny_config()
  c._attn_implementation = "eager"
  attn = hf.DeepseekV4Attention(c, layer_idx=0).eval()
  randomize(attn, seed=3, std=0.4)
  x = np.random.default_rng(1).normal(size=(B, T, c.hidden_size)).astype(np.float32)
  return c, attn, x


def test_sliding_attention_matches_transformers(case):
  # Tolerance: the chain sums D = 32 (q_a, kv), Cq = 24 (q_b), Dh = 16 (scores), <= 8 keys,
  # H/G·Dh = 32 (o_a) and G·R = 24 (o_b) products: <= ~140 ε ≈ 1.7e-5 relative per step's
  # terms; the softmax passes an absolute logit error on scaled by |logit| <= ~4 and the
  # cancellations of the output sums cost at most a few x: < 1e-4.
  c, attn, x = case
  xt = torch.from_numpy(x)
  pos = torch.arange(T)[None].expand(B, -1)
  mask = create_sliding_window_causal_mask(config=c, inputs_embeds=xt, attention_mask=None,
                                           cache=None, position_ids=pos)
  rot = hf.DeepseekV4RotaryEmbedding(c)
  pe = {"main": rot(xt, pos, layer_type="main"), "compress": rot(xt, pos, layer_type="compress")}
  with torch.no_grad():
    y_t, _ = attn(xt, position_embeddings=pe, position_ids=pos, attention_mask=mask)
  cfg = attention_config(c)
  y = _fwd(cfg)(attention_params(attn, cfg), jnp.asarray(x), jnp.asarray(pos.numpy()))
  err = rel_err(y, np_(y_t))
  print("V4 sliding attention parity (max rel err):", err)
  assert err <= 1e-4
  # The case exercises the window and the sinks: either changed makes the output differ.
  wide = _fwd(attention_config(c, sliding_window=T))(
      attention_params(attn, cfg), jnp.asarray(x), jnp.asarray(pos.numpy()))
  assert rel_err(wide, y) > 1e-2
  nosink = attention_params(attn, cfg)
  nosink["params"]["sink_bias"] = jnp.full_like(nosink["params"]["sink_bias"], -1e9)
  y_ns = _fwd(cfg)(nosink, jnp.asarray(x), jnp.asarray(pos.numpy()))
  assert rel_err(y_ns, y) > 1e-2


def test_left_padding_leaves_real_tokens_unchanged(case):
  # A row left-padded by P tokens, positions cumsum(mask) - 1, gives the same outputs at its
  # real tokens as the unpadded row (fp32 rounding only: different zeros in the sums).
  c, attn, x = case
  cfg = attention_config(c)
  params = attention_params(attn, cfg)
  P = 3
  x_pad = np.concatenate([np.zeros((B, P, c.hidden_size), np.float32), x], axis=1)
  m = np.concatenate([np.zeros((B, P), bool), np.ones((B, T), bool)], axis=1)
  pos = np.maximum(np.cumsum(m, 1) - 1, 0)
  y = _fwd(cfg)(params, jnp.asarray(x), jnp.asarray(pos[:, P:]))
  y_pad = _fwd(cfg)(params, jnp.asarray(x_pad), jnp.asarray(pos),
                                        jnp.asarray(m))
  assert rel_err(y_pad[:, P:], y) <= 1e-5
  assert np.all(np.isfinite(np.asarray(y_pad)))


def test_config_errors():
  c = tiny_config(compress_rates=RATES)
  csa = compressed_attention_config(c, "compressed_sparse_attention")
  with pytest.raises(ValueError, match="needs an indexer"):
    V4AttentionConfig(**{**csa.__dict__, "indexer": None})
  hca = compressed_attention_config(c, "heavily_compressed_attention")
  with pytest.raises(ValueError, match="overlapping"):
    V4AttentionConfig(**{**hca.__dict__, "indexer": csa.indexer})
  with pytest.raises(ValueError, match="rope_dim=3"):
    V4AttentionConfig(d_model=8, n_heads=2, head_dim=8, q_lora_rank=4, rope_dim=3)
  with pytest.raises(ValueError, match="o_groups=4"):
    V4AttentionConfig(d_model=8, n_heads=2, head_dim=8, q_lora_rank=4, rope_dim=4, o_groups=4)


@pytest.mark.parametrize("layer_type", ["heavily_compressed_attention",
                                        "compressed_sparse_attention"])
def test_compressed_attention_matches_transformers(layer_type):
  # Tolerance: the sliding case's chain plus the compressor (D = 32 products, 2m <= 16
  # softmax slots, an RMSNorm over 16) and up to T/m more keys: still < ~300 ε ≈ 4e-5 per
  # step's terms, < 1e-4 with the sliding case's margins. The CSA selection is compared
  # exactly through the output: a different pick changes y by far more than 1e-4.
  c = tiny_config(layer_types=[layer_type] * 2, compress_rates=RATES, index_n_heads=4,
                  index_head_dim=12, index_topk=2)
  c._attn_implementation = "eager"
  attn = hf.DeepseekV4Attention(c, layer_idx=0).eval()
  randomize(attn, seed=7, std=0.4)
  x = np.random.default_rng(2).normal(size=(B, T, c.hidden_size)).astype(np.float32)
  xt = torch.from_numpy(x)
  pos = torch.arange(T)[None].expand(B, -1)
  mask = create_sliding_window_causal_mask(config=c, inputs_embeds=xt, attention_mask=None,
                                           cache=None, position_ids=pos)
  rot = hf.DeepseekV4RotaryEmbedding(c)
  pe = {"main": rot(xt, pos, layer_type="main"), "compress": rot(xt, pos, layer_type="compress")}
  with torch.no_grad():
    y_t, _ = attn(xt, position_embeddings=pe, position_ids=pos, attention_mask=mask)
  cfg = compressed_attention_config(c, layer_type)
  assert cfg.layer_type == layer_type
  params = attention_params(attn, cfg)
  y = _fwd(cfg)(params, jnp.asarray(x), jnp.asarray(pos.numpy()))
  err = rel_err(y, np_(y_t))
  print(f"V4 {layer_type} parity (max rel err):", err)
  assert err <= 1e-4
  # The compressed entries matter: dropping the compressor changes the output.
  plain = {"params": {k: v for k, v in params["params"].items()
                      if k not in ("compressor", "indexer")}}
  y_plain = _fwd(attention_config(c, rope_theta=cfg.rope_theta))(plain, jnp.asarray(x),
                                                      jnp.asarray(pos.numpy()))
  assert rel_err(y_plain, y) > 1e-3
