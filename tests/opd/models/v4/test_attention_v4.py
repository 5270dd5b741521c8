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
from opd.models.v4.compressor import CompressorConfig, IndexerConfig
from v4_torch import np_, randomize, rel_err, tiny_config

B, T = 2, 20  # T > sliding_window = 8: the window drops keys; 5 CSA and 2 HCA windows
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


def _ours(c, **overrides):
  kw = dict(d_model=c.hidden_size, n_heads=c.num_attention_heads, head_dim=c.head_dim,
            q_lora_rank=c.q_lora_rank, rope_dim=c.qk_rope_head_dim,
            rope_theta=c.rope_parameters["main"]["rope_theta"], sliding_window=c.sliding_window,
            o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, norm_eps=c.rms_norm_eps)
  return V4AttentionConfig(**{**kw, **overrides})


def _compressed(c, layer_type):
  """Our config for a CSA / HCA layer of transformers' config ``c``."""
  m, theta = RATES[layer_type], c.rope_parameters["compress"]["rope_theta"]
  cc = lambda width, overlap: CompressorConfig(
      d_model=c.hidden_size, width=width, compress_rate=m, overlap=overlap,
      rope_dim=c.qk_rope_head_dim, rope_theta=theta, norm_eps=c.rms_norm_eps)
  csa = layer_type == "compressed_sparse_attention"
  indexer = IndexerConfig(compressor=cc(c.index_head_dim, True), q_lora_rank=c.q_lora_rank,
                          n_heads=c.index_n_heads, topk=c.index_topk) if csa else None
  return _ours(c, rope_theta=theta, compressor=cc(c.head_dim, csa), indexer=indexer)


def _comp_params(mod):
  return {"kv": np_(mod.kv_proj.weight).T, "gate": np_(mod.gate_proj.weight).T,
          "position_bias": np_(mod.position_bias), "kv_norm": {"scale": np_(mod.kv_norm.weight)}}


def _import(attn, cfg):
  H, Dh, G, R = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
  I = H // G * Dh
  p = {"q_a": np_(attn.q_a_proj.weight).T, "q_a_norm": {"scale": np_(attn.q_a_norm.weight)},
       "q_b": np_(attn.q_b_proj.weight).T.reshape(-1, H, Dh),
       "kv": np_(attn.kv_proj.weight).T, "kv_norm": {"scale": np_(attn.kv_norm.weight)},
       "sink_bias": np_(attn.sinks),
       "o_a": np_(attn.o_a_proj.weight).reshape(G, R, I).transpose(0, 2, 1),
       "o_b": np_(attn.o_b_proj.weight).T.reshape(G, R, -1)}
  if cfg.compressor is not None:
    p["compressor"] = _comp_params(attn.compressor)
  if cfg.indexer is not None:
    ind = attn.compressor.indexer
    p["indexer"] = {"compressor": _comp_params(ind),
                    "q": np_(ind.q_b_proj.weight).T.reshape(cfg.q_lora_rank, cfg.indexer.n_heads, -1),
                    "weights": np_(ind.scorer.weights_proj.weight).T}
  return {"params": jax.tree.map(jnp.asarray, p)}


def _fwd(cfg):
  return jax.jit(V4Attention(cfg).apply)


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
  c = tiny_config(compress_rates=RATES)
  csa = _compressed(c, "compressed_sparse_attention")
  with pytest.raises(ValueError, match="needs an indexer"):
    V4AttentionConfig(**{**csa.__dict__, "indexer": None})
  hca = _compressed(c, "heavily_compressed_attention")
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
  cfg = _compressed(c, layer_type)
  assert cfg.layer_type == layer_type
  params = _import(attn, cfg)
  y = _fwd(cfg)(params, jnp.asarray(x), jnp.asarray(pos.numpy()))
  err = rel_err(y, np_(y_t))
  print(f"V4 {layer_type} parity (max rel err):", err)
  assert err <= 1e-4
  # The compressed entries matter: dropping the compressor changes the output.
  plain = {"params": {k: v for k, v in params["params"].items()
                      if k not in ("compressor", "indexer")}}
  y_plain = _fwd(_ours(c, rope_theta=cfg.rope_theta))(plain, jnp.asarray(x),
                                                      jnp.asarray(pos.numpy()))
  assert rel_err(y_plain, y) > 1e-3
