"""Decoding DeepSeek-V4 with its cache (opd.models.v4.cache): the sliding-window ring, the
compressors' rings and entries and the indexer's keys give, token by token, the logits of
the full forward over the whole sequence, on left-padded rows of different lengths whose
prompts and continuations cross the window and several CSA / HCA windows; the sampler's
greedy decode equals the full-recompute argmax. The full forward is causal (a query reads
no later key or window), so one forward over the whole sequence gives the full-recompute
logits of every prefix at once."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import forward, init_cache, init_params
from opd.rollout.sampler import SamplingConfig, generate
from v4_family import tiny_v4

CFG = tiny_v4(v4=dataclasses.replace(tiny_v4().v4, index_topk=3))  # 3 of up to 7 CSA entries
LENS = (11, 6, 9)  # real prompt tokens per row; P = 11 columns, left-padded
P, N = 11, 21      # N new tokens: positions up to 31 (> W = 8; CSA m = 4, HCA m = 8)
# Tolerance: the cached step computes the same sums as the full forward over other key
# sets (ring + chunk vs all keys; masked keys add exact zeros) and other array shapes, so
# only the reduction order differs: ~sqrt(n) eps of the summed magnitudes per stage over
# three layers and the head; 1e-5 of max|logit| is far above that (~1e-6) and far below
# any wrong key or entry (a changed softmax term moves logits by >~1e-2 relative here).
RTOL = 1e-5


@pytest.fixture(scope="module")
def setup():
  params = init_params(CFG, jax.random.key(0))
  # Larger weights than the 0.02 init so that attention and routing are far from uniform.
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x if "tid2eid" in jax.tree_util.keystr(p) or x.ndim < 2 else x * 15.0, params)
  rng = np.random.default_rng(0)
  seq = rng.integers(0, CFG.vocab_size, (len(LENS), P + N)).astype(np.int32)
  mask = np.zeros((len(LENS), P + N), bool)
  for b, n in enumerate(LENS):
    mask[b, P - n:] = True
    seq[b, :P - n] = 0
  return params, seq, mask


def _full_logits(params, seq, mask):
  """``[B, T, V]`` logits of one full forward (column t: the prefix [0, t] recomputed)."""
  return np.asarray(forward(CFG, params, jnp.asarray(seq), mask=jnp.asarray(mask)).logits)


def _positions(mask):
  return np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)


@pytest.mark.parametrize("chunks", [(P,), (5, P - 5)], ids=["prefill", "two_chunks"])
def test_cached_steps_equal_full_forward(setup, chunks):
  params, seq, mask = setup
  pos = _positions(mask)
  step = jax.jit(lambda p, t, q, m, c: forward(CFG, p, t, q, m, c))
  full = _full_logits(params, seq, mask)
  cache, start, worst = init_cache(CFG, len(LENS), P + N), 0, 0.0
  widths = list(chunks) + [1] * N
  for w in widths:
    sl = slice(start, start + w)
    out = step(params, seq[:, sl], pos[:, sl], mask[:, sl], cache)
    cache, start = out.cache, start + w
    real = mask[:, start - 1]  # a pad column's output is meaningless (a row may be all pad)
    want = full[real, start - 1]
    got = np.asarray(out.logits[:, -1])[real]
    worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * np.abs(want).max())
  print(f"V4 cached decode vs full forward ({chunks}): worst rel err {worst:.2e}")


def test_cache_matters(setup):
  # The test can fail: decoding with the cache emptied before the last step (no ring, no
  # entries) gives other logits than the full forward.
  params, seq, mask = setup
  pos = _positions(mask)
  fresh = init_cache(CFG, len(LENS), P + N)
  last = forward(CFG, params, seq[:, -1:], pos[:, -1:], mask[:, -1:], fresh)
  want = _full_logits(params, seq, mask)[:, -1]
  assert np.max(np.abs(np.asarray(last.logits[:, -1]) - want)) > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("rows", [(0, 1, 2), (0, 1) * 4], ids=["distinct", "shared_prefill"])
def test_greedy_sampler_equals_full_recompute_argmax(setup, rows):
  # "shared_prefill": 8 rows of 2 prompts, so the sampler prefills 2 rows and copies their
  # caches (opd.rollout.prefill); "distinct" prefills every row.
  params, seq, mask = setup
  prompts, pmask = seq[list(rows), :P], mask[list(rows), :P]
  out = generate(CFG, params, jnp.asarray(prompts), jnp.asarray(pmask), jax.random.key(0),
                 SamplingConfig(max_new_tokens=N, temperature=0.0))
  tokens = np.asarray(out.tokens)
  assert np.asarray(out.mask).all()  # no EOS configured: every row decodes N tokens
  ctx = np.concatenate([prompts, tokens], 1)
  cmask = np.concatenate([pmask, np.ones(tokens.shape, bool)], 1)
  assert tokens.shape == (len(rows), N)
  logits = _full_logits(params, ctx, cmask)[:, P - 1:-1]  # the logits each token followed
  top2 = np.sort(logits, -1)[..., -2:]
  assert np.min(top2[..., 1] - top2[..., 0]) > 1e-4 * np.abs(logits).max()  # no near-ties
  np.testing.assert_array_equal(tokens, logits.argmax(-1))
  assert len(set(tokens[0].tolist())) > 3  # not one repeated token


def test_sampled_logprobs_equal_the_training_forward(setup):
  # GRPO and OPD score the sampler's tokens with a full forward over prompt + completion
  # (left-padded) and take ratios against the sampler's log-probs: at the sampled tokens
  # the two must agree (the ratio is 1 before any update). Tolerance as RTOL, in nats:
  # log-softmax of logits within 1e-5·max|logit| (~6e-5 here) moves by at most twice that.
  from opd.models import token_logprobs
  params, seq, mask = setup
  prompts, pmask = seq[:, :P], mask[:, :P]
  out = generate(CFG, params, jnp.asarray(prompts), jnp.asarray(pmask), jax.random.key(3),
                 SamplingConfig(max_new_tokens=N, temperature=1.0))
  tokens = np.asarray(out.tokens)
  ctx = np.concatenate([prompts, tokens], 1)
  cmask = np.concatenate([pmask, np.ones(tokens.shape, bool)], 1)
  logits = forward(CFG, params, jnp.asarray(ctx), mask=jnp.asarray(cmask)).logits
  logp = np.asarray(token_logprobs(logits[:, P - 1:-1], jnp.asarray(tokens)))
  bound = 2 * RTOL * float(np.abs(np.asarray(logits)).max())
  np.testing.assert_allclose(np.asarray(out.logprobs), logp, rtol=0, atol=bound)
  assert np.std(logp) > 0.1  # sampled, not all argmax


def test_cache_bytes_per_token_at_deepseek_v4_shape():
  """The cache's growth per token at transformers' default DeepseekV4Config shape (43
  layers, Dh 512, CSA m = 4 with c^I = 128, HCA m = 128; bf16, shapes only) against the
  entries it must hold, and against a plain GQA cache of the same layers and head width."""
  from opd.models import ModelConfig
  from opd.models.moe import MoEConfig
  from opd.models.v4.config import V4Config
  hca, csa = "heavily_compressed_attention", "compressed_sparse_attention"
  layer_types = (hca, hca) + (csa, hca) * 20 + (csa,)  # transformers' default schedule
  v4 = V4Config(layer_types=layer_types, mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 40,
                q_lora_rank=1024, rope_dim=64, sliding_window=128, o_groups=8,
                o_lora_rank=1024, csa_compress_rate=4, hca_compress_rate=128,
                index_n_heads=64, index_head_dim=128, index_topk=512)
  cfg = ModelConfig(vocab_size=129280, d_model=4096, n_layers=43, n_heads=64, n_kv_heads=1,
                    head_dim=512, moe=MoEConfig(n_routed_experts=256, experts_per_token=6,
                                                moe_d_ff=2048, n_shared_experts=1,
                                                router="sqrtsoftplus"), v4=v4)
  nbytes = lambda c, S: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      jax.eval_shape(lambda: init_cache(c, 1, S, jnp.bfloat16))))
  S = 1 << 16
  slope = (nbytes(cfg, 2 * S) - nbytes(cfg, S)) / S
  n_csa, n_hca = layer_types.count(csa), layer_types.count(hca)
  # One bf16 entry of Dh per m tokens per compressed layer, plus CSA's indexer keys.
  assert slope == 2 * (n_csa * (512 + 128) / 4 + n_hca * 512 / 128)
  gqa = cfg.replace(v4=None, moe=None)  # K = 1 head of 512: keys and values, 43 layers
  gqa_slope = (nbytes(gqa, 2 * S) - nbytes(gqa, S)) / S
  assert gqa_slope == 43 * 2 * 512 * 2 + 1  # + the mask's byte
  fixed = nbytes(cfg, S) - S * slope  # the rings: window keys and compressor slots
  print(f"V4 cache: {slope:.0f} B/token + {fixed / 2**20:.1f} MiB fixed; GQA (K=1, Dh=512): "
        f"{gqa_slope:.0f} B/token ({gqa_slope / slope:.1f}x); at 1M tokens "
        f"{(fixed + slope * 2**20) / 2**30:.2f} GiB vs {gqa_slope * 2**20 / 2**30:.2f} GiB")
