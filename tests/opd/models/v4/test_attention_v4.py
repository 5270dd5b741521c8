"""DeepSeek-V4 sliding-window attention (opd.models.v4.attention) against transformers'
DeepseekV4Attention on a sliding_attention layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from opd.models.v4.attention import V4AttentionConfig, V4SlidingAttention
from v4_torch import np_, randomize, rel_err, tiny_config

B, T = 2, 20  # T > sliding_window = 8: the window drops keys


def _ours(c, **overrides):
  kw = dict(d_model=c.hidden_size, n_heads=c.num_attention_heads, head_dim=c.head_dim,
            q_lora_rank=c.q_lora_rank, rope_dim=c.qk_rope_head_dim,
            rope_theta=c.rope_parameters["main"]["rope_theta"], sliding_window=c.sliding_window,
            o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, norm_eps=c.rms_norm_eps)
  return V4AttentionConfig(**{**kw, **overrides})


def _import(attn, cfg):
  H, Dh, G, R = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
  I = H // G * Dh
  p = {"q_a": np_(attn.q_a_proj.weight).T, "q_a_norm": {"scale": np_(attn.q_a_norm.weight)},
       "q_b": np_(attn.q_b_proj.weight).T.reshape(-1, H, Dh),
       "kv": np_(attn.kv_proj.weight).T, "kv_norm": {"scale": np_(attn.kv_norm.weight)},
       "sink_bias": np_(attn.sinks),
       "o_a": np_(attn.o_a_proj.weight).reshape(G, R, I).transpose(0, 2, 1),
       "o_b": np_(attn.o_b_proj.weight).T.reshape(G, R, -1)}
  return {"params": jax.tree.map(jnp.asarray, p)}


def _fwd(cfg):
  return jax.jit(V4SlidingAttention(cfg).apply)


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
  cfg = _ours(c)
  y = _fwd(cfg)(_import(attn, cfg), jnp.asarray(x), jnp.asarray(pos.numpy()))
  err = rel_err(y, np_(y_t))
  print("V4 sliding attention parity (max rel err):", err)
  assert err <= 1e-4
  # The case exercises the window and the sinks: either changed makes the output differ.
  wide = _fwd(_ours(c, sliding_window=T))(
      _import(attn, cfg), jnp.asarray(x), jnp.asarray(pos.numpy()))
  assert rel_err(wide, y) > 1e-2
  nosink = _import(attn, cfg)
  nosink["params"]["sink_bias"] = jnp.full_like(nosink["params"]["sink_bias"], -1e9)
  y_ns = _fwd(cfg)(nosink, jnp.asarray(x), jnp.asarray(pos.numpy()))
  assert rel_err(y_ns, y) > 1e-2


def test_left_padding_leaves_real_tokens_unchanged(case):
  # A row left-padded by P tokens, positions cumsum(mask) - 1, gives the same outputs at its
  # real tokens as the unpadded row (fp32 rounding only: different zeros in the sums).
  c, attn, x = case
  cfg = _ours(c)
  params = _import(attn, cfg)
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
  with pytest.raises(ValueError, match="rope_dim=3"):
    V4AttentionConfig(d_model=8, n_heads=2, head_dim=8, q_lora_rank=4, rope_dim=3)
  with pytest.raises(ValueError, match="o_groups=4"):
    V4AttentionConfig(d_model=8, n_heads=2, head_dim=8, q_lora_rank=4, rope_dim=4, o_groups=4)
