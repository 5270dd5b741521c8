"""DeepSeek-V4 compressors and lightning indexer (opd.models.v4.compressor) against
transformers' DeepseekV4HCACompressor / DeepseekV4CSACompressor / DeepseekV4Indexer, and
the indexer's top-k selection against numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from opd.models.v4.compressor import (Compressor, CompressorConfig, IndexerConfig,
                                      LightningIndexer, indexer_topk)
from v4_torch import np_, randomize, rel_err, tiny_config

B, T = 2, 19  # 4 CSA windows of m = 4 (3 tokens left over), 2 HCA windows of m' = 8
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


def np_topk(scores, positions, m, k):
  """Per query: the visible entries (w < (p + 1) // m) by score descending, ties to the
  lower index, first min(k, n); slots beyond the visible ones hold -1."""
  Bn, Tn, n = scores.shape
  out = np.full((Bn, Tn, min(k, n)), -1, np.int64)
  for b in range(Bn):
    for t in range(Tn):
      vis = [w for w in range(n) if w < (positions[b, t] + 1) // m]
      best = sorted(vis, key=lambda w: (-scores[b, t, w], w))[:min(k, n)]
      out[b, t, :len(best)] = best
  return out


def test_indexer_topk_matches_numpy():
  rng = np.random.default_rng(0)
  n, m, k = 6, 4, 4
  scores = rng.integers(-3, 4, size=(2, 30, n)).astype(np.float32)  # many ties
  positions = np.stack([np.arange(30), np.maximum(np.arange(30) - 5, 0)])
  visible = np.arange(n) < ((positions + 1) // m)[..., None]
  got = np.asarray(indexer_topk(jnp.asarray(scores), jnp.asarray(visible), k))
  want = np_topk(scores, positions, m, k)
  np.testing.assert_array_equal(got, want)
  assert (want == -1).any() and (want >= 0).all(-1).any()  # both regimes present


def _ccfg(c, width, rate, overlap):
  return CompressorConfig(d_model=c.hidden_size, width=width, compress_rate=rate,
                          overlap=overlap, rope_dim=c.qk_rope_head_dim,
                          rope_theta=c.rope_parameters["compress"]["rope_theta"],
                          norm_eps=c.rms_norm_eps)


def _comp_params(mod):
  return {"kv": np_(mod.kv_proj.weight).T, "gate": np_(mod.gate_proj.weight).T,
          "position_bias": np_(mod.position_bias), "kv_norm": {"scale": np_(mod.kv_norm.weight)}}


@pytest.fixture(scope="module")
def case():
  c = tiny_config(compress_rates=RATES, index_n_heads=4, index_head_dim=12, index_topk=2)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(B, T, c.hidden_size)).astype(np.float32)
  q_res = rng.normal(size=(B, T, c.q_lora_rank)).astype(np.float32)
  return c, x, q_res


def test_hca_compressor_matches_transformers(case):
  # Tolerance: D = 32 products per projection, an 8-slot softmax-weighted sum and an RMSNorm
  # over 16: ~(32 + 8 + 16) ε scaled by the gate logits' size (< 10): < 1e-4.
  c, x, _ = case
  mod = hf.DeepseekV4HCACompressor(c)
  randomize(mod, seed=5, std=0.4)
  pos = torch.arange(T)[None].expand(B, -1)
  with torch.no_grad():
    kv_t, bias_t = mod(torch.from_numpy(x), None, pos, None, 0)
  cfg = _ccfg(c, c.head_dim, RATES["heavily_compressed_attention"], overlap=False)
  keys, _ = jax.jit(Compressor(cfg).apply)(
      {"params": jax.tree.map(jnp.asarray, _comp_params(mod))}, jnp.asarray(x),
      jnp.asarray(pos.numpy()))
  # Rows: the T // 8 complete windows, then the incomplete one (not valid).
  np.testing.assert_array_equal(keys.valid, np.broadcast_to(np.arange(T // 8 + 1) < T // 8, (B, 3)))
  e = keys.keys[:, :T // 8]
  err = rel_err(e, np_(kv_t)[:, 0])
  print("V4 HCA compressor parity (max rel err):", err)
  assert e.shape == (B, T // 8, c.head_dim) and err <= 1e-4
  # Visibility: transformers' block bias is 0 exactly where w < (t + 1) // m.
  vis = np.arange(T // 8)[None, :] < ((np.arange(T) + 1) // 8)[:, None]
  np.testing.assert_array_equal(np_(bias_t)[:, 0] == 0, np.broadcast_to(vis, (B, *vis.shape)))


def test_csa_compressor_and_indexer_match_transformers(case):
  # Tolerances as the HCA case (2m = 8 slots); indexer scores add c^I = 12 and n_h^I = 4
  # terms. The selections are compared exactly, on a case checked to have no score tie at
  # the k-th place (a tie there would make either choice right).
  c, x, q_res = case
  mod = hf.DeepseekV4CSACompressor(c)
  randomize(mod, seed=6, std=0.4)
  pos = torch.arange(T)[None].expand(B, -1)
  with torch.no_grad():
    kv_t, bias_t = mod(torch.from_numpy(x), torch.from_numpy(q_res), pos, None, 0)
    idx_t = mod.indexer(torch.from_numpy(x), torch.from_numpy(q_res), pos, None, 0)
  m = RATES["compressed_sparse_attention"]
  cfg = _ccfg(c, c.head_dim, m, overlap=True)
  keys, _ = jax.jit(Compressor(cfg).apply)(
      {"params": jax.tree.map(jnp.asarray, _comp_params(mod))}, jnp.asarray(x),
      jnp.asarray(pos.numpy()))
  e = keys.keys[:, :T // m]
  ind = mod.indexer
  icfg = IndexerConfig(compressor=_ccfg(c, c.index_head_dim, m, overlap=True),
                       q_lora_rank=c.q_lora_rank, n_heads=c.index_n_heads, topk=c.index_topk)
  ip = {"compressor": _comp_params(ind),
        "q": np_(ind.q_b_proj.weight).T.reshape(c.q_lora_rank, c.index_n_heads, -1),
        "weights": np_(ind.scorer.weights_proj.weight).T}
  positions = jnp.asarray(pos.numpy())
  idx, scores, _ = jax.jit(LightningIndexer(icfg).apply)(
      {"params": jax.tree.map(jnp.asarray, ip)}, jnp.asarray(x), jnp.asarray(q_res), positions)
  err = rel_err(e, np_(kv_t)[:, 0])
  print("V4 CSA compressor parity (max rel err):", err)
  assert e.shape == (B, T // m, c.head_dim) and err <= 1e-4
  scores, idx = np.asarray(scores), np.asarray(idx)  # scores: T // m + 1 rows (last incomplete)
  np.testing.assert_array_equal(idx, np_topk(scores, pos.numpy(), m, c.index_topk))
  for b in range(B):  # no tie at the k-th place among visible entries
    for t in range(T):
      vis = np.sort(scores[b, t, :(t + 1) // m])[::-1]
      if len(vis) > c.index_topk:
        assert vis[c.index_topk - 1] - vis[c.index_topk] > 1e-4 * np.abs(vis).max()
  np.testing.assert_array_equal(np.sort(idx, -1), np.sort(idx_t.numpy(), -1))
  # The CSA block bias: 0 exactly at the selected entries.
  sel = np.zeros((B, T, T // m), bool)
  for b, t, j in zip(*np.nonzero(idx >= 0)):
    sel[b, t, idx[b, t, j]] = True
  np.testing.assert_array_equal(np_(bias_t)[:, 0] == 0, sel)
  assert (idx == -1).any() and (idx >= 0).all(-1).any() and (T // m) > c.index_topk


def test_config_errors():
  with pytest.raises(ValueError, match="rope_dim=10"):
    CompressorConfig(d_model=8, width=8, compress_rate=4, overlap=True, rope_dim=10)
  hca = CompressorConfig(d_model=8, width=8, compress_rate=4, overlap=False, rope_dim=4)
  with pytest.raises(ValueError, match="overlap"):
    IndexerConfig(compressor=hca, q_lora_rank=4, n_heads=2, topk=2)
