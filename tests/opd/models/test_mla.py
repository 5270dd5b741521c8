"""Multi-head latent attention: the absorbed latent cache equals the plain form.

The plain form (no cache) expands the latent to per-head keys and values; the
cached form stores only the latent and the shared RoPE key and absorbs the
up-projections into the query and the output (opd.models.mla). Parameters
are drawn with std 1/sqrt(fan_in) (not the 0.02 init) so attention is far
from uniform and a wrong slot, head or absorption shows in the logits.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import (ModelConfig, default_positions, forward, init_cache, init_params,
                        param_logical_axes)
from opd.models.config import MLAConfig
from opd.models.mla import cache_bytes_per_token, cache_values_per_token
from opd.parallel import sharding as shd
from opd.rollout.sampler import SamplingConfig, generate

EPS32 = float(np.finfo(np.float32).eps)
T, S = 10, 13  # sequence length, cache slots (the last S - T stay empty)
CFGS = {
    "q_lora_interleave": ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=48,
        mla=MLAConfig(kv_lora_rank=12, q_lora_rank=20, qk_nope_head_dim=8,
                      qk_rope_head_dim=6, v_head_dim=10, rope_interleave=True)),
    "direct_q": ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=48,
        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8)),
}


def _params(cfg, seed=0):
  """Random params with unit-scale activations: N(0, 1/fan_in) weights."""
  rng = np.random.default_rng(seed)

  def draw(x):
    if x.ndim < 2:  # norm scales: perturb around their init
      return jnp.asarray(np.asarray(x) + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[0]), x.dtype)

  return jax.tree.map(draw, init_params(cfg, jax.random.key(0)))


def _batch(cfg, rows=3, length=T, seed=1):
  """Rows left-padded by 0, 2, 5, ... tokens. [B, T] ids and mask."""
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, cfg.vocab_size, size=(rows, length)).astype(np.int32)
  mask = np.ones((rows, length), bool)
  for row in range(rows):
    mask[row, :(0, 2, 5)[row % 3]] = False
  return jnp.asarray(toks), jnp.asarray(mask)


def _atol(cfg, ref):
  """Float32 bound for cached (absorbed) vs plain at ``ref``'s scale.

  The two forms differ only in the order of rounded reductions (the
  absorbed scores contract q_nope with W_UK over Dn, then with the latent
  over C, where the plain ones contract W_UK with the latent over C, then
  with q_nope over Dn; likewise for W_UV; attention over S vs T slots): per
  layer ~16 rounded steps (two latent norms, five projections, RoPE, scores,
  softmax, mixing, MLP, residuals), +2 for the final norm and head, each a
  relative ~eps*sqrt(n) with n <= max(D, F, S, C); independent steps add in
  quadrature and the max over all entries stays within ~4 standard
  deviations; x2 since both forms round.
  """
  steps = 16 * cfg.n_layers + 2
  n = max(cfg.d_model, cfg.d_ff, S, cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank or 0)
  rms = float(np.sqrt(np.mean(np.square(np.asarray(ref, np.float64)))))
  return 2 * 4 * np.sqrt(steps) * np.sqrt(n) * EPS32 * rms


@pytest.mark.parametrize("name,prefill", [("q_lora_interleave", 4), ("direct_q", 1)])
def test_absorbed_latent_cache_equals_plain_forward_token_by_token(name, prefill):
  cfg = CFGS[name]
  params = _params(cfg)
  toks, mask = _batch(cfg)
  full = np.asarray(forward(cfg, params, toks, mask=mask).logits)  # plain form, [B, T, V]
  pos = default_positions(mask)
  out = forward(cfg, params, toks[:, :prefill], pos[:, :prefill], mask[:, :prefill],
                init_cache(cfg, 3, S))
  cache, steps = out.cache, [np.asarray(out.logits)]
  for t in range(prefill, T):
    out = forward(cfg, params, toks[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache)
    cache = out.cache
    steps.append(np.asarray(out.logits))
  got = np.concatenate(steps, axis=1)
  real = np.asarray(mask)
  tol = _atol(cfg, full[real])
  for t in range(T):  # position by position, so a failure names the step
    rows = real[:, t]
    np.testing.assert_allclose(got[rows, t], full[rows, t], atol=tol, err_msg=f"position {t}")
  # Only the latent and the shared RoPE key are cached, one "head" each.
  m = cfg.mla
  assert [x.shape for x in cache.k] == [(3, 1, S, m.kv_lora_rank)] * cfg.n_layers
  assert [x.shape for x in cache.v] == [(3, 1, S, m.qk_rope_head_dim)] * cfg.n_layers
  assert not any(np.any(np.asarray(x)[:, :, T:]) for x in cache.k + cache.v)


def test_sharded_equals_unsharded_forward_and_generation():
  """(data, fsdp, tensor) = (2, 2, 2): heads and the MLP split over tensor,
  the embed dimension over fsdp; the latent width stays replicated."""
  cfg = CFGS["q_lora_interleave"]
  params = _params(cfg, seed=2)
  mesh = shd.make_mesh((2, 2, 2))
  specs = param_logical_axes(cfg)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  used = {a for spec in jax.tree.leaves(specs, is_leaf=is_spec)
          for a in spec if a is not None}
  assert used <= set(shd.LOGICAL_AXES), used - set(shd.LOGICAL_AXES)
  sharded = jax.device_put(params, shd.tree_shardings(specs, params, mesh, shd.DEFAULT_RULES))
  attn = sharded["layers_0"]["attn"]
  assert not attn["kv_b"].sharding.is_fully_replicated  # split over heads
  assert not attn["kv_a"].sharding.is_fully_replicated  # split over embed

  toks, mask = _batch(cfg, rows=8, length=6, seed=3)
  ref = np.asarray(forward(cfg, params, toks, mask=mask).logits)
  with jax.set_mesh(mesh), nn.logical_axis_rules(shd.DEFAULT_RULES):
    got = np.asarray(forward(cfg, sharded, toks, mask=mask).logits)
  real = np.asarray(mask)
  # Same math, sharded reductions reordered: the bound of _atol (S -> T).
  np.testing.assert_allclose(got[real], ref[real], atol=_atol(cfg, ref[real]))

  greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
  single = generate(cfg, params, toks, mask, jax.random.key(0), greedy)
  multi = generate(cfg, sharded, toks, mask, jax.random.key(0), greedy, mesh=mesh,
                   rules=shd.DEFAULT_RULES)
  np.testing.assert_array_equal(np.asarray(multi.tokens), np.asarray(single.tokens))
  # Log-probs are differences of logits within the same bound.
  np.testing.assert_allclose(np.asarray(multi.logprobs), np.asarray(single.logprobs),
                             atol=2 * _atol(cfg, ref[real]))
  # The sampler decodes against the latent cache (absorbed form); its
  # log-probs equal the plain form's over prompt + sample, token by token.
  P, gen = toks.shape[1], np.asarray(single.mask)
  full = np.asarray(forward(cfg, params, jnp.concatenate([toks, single.tokens], axis=1),
                            mask=jnp.concatenate([mask, single.mask], axis=1)).logits)
  logp = jax.nn.log_softmax(full[:, P - 1:-1], axis=-1)  # position P-1+j predicts token j
  plain = np.take_along_axis(np.asarray(logp), np.asarray(single.tokens)[..., None], -1)[..., 0]
  assert gen.all()  # no eos_ids: every row runs all 4 steps, each compared
  np.testing.assert_allclose(np.asarray(single.logprobs)[gen], plain[gen],
                             atol=2 * _atol(cfg, full[:, P - 1:-1]))


def test_cache_size_per_token_against_gqa():
  """DeepSeek-V3's dims: 61 layers, 128 heads, C = 512, Dr = 64, Dn = 128,
  Dv = 128. Its latent cache holds C + Dr = 576 values per layer; the same
  attention without the latent caches its expanded keys and values,
  H (Dn + Dr + Dv) = 40960 per layer (71x), and a GQA model with 8 kv heads
  of 128 dims 2 * 8 * 128 = 2048 (3.6x)."""
  v3 = ModelConfig(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                   d_ff=18432, mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128))
  assert cache_values_per_token(v3) == 61 * (512 + 64)
  assert cache_bytes_per_token(v3, jnp.bfloat16) == 2 * 61 * 576
  gqa = ModelConfig(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=8,
                    head_dim=128, d_ff=18432)
  assert cache_values_per_token(gqa) == 61 * 2 * 8 * 128
  # The function agrees with the cache the decoder really allocates.
  for cfg in (CFGS["q_lora_interleave"], ModelConfig(vocab_size=64, d_model=16, n_heads=4,
                                                     n_kv_heads=2, d_ff=32)):
    cache = jax.eval_shape(lambda cfg=cfg: init_cache(cfg, 2, 5))
    per_slot = sum(x.size for x in cache.k + cache.v) // (2 * 5)
    assert cache_values_per_token(cfg) == per_slot
    assert cache_bytes_per_token(cfg) == per_slot * 4  # float32


def test_config_round_trips_and_counts_its_params():
  for cfg in CFGS.values():
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    abstract = jax.eval_shape(lambda cfg=cfg: init_params(cfg, jax.random.key(0)))
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(abstract))


@pytest.mark.parametrize("kw,field", [
    (dict(n_kv_heads=2), "n_kv_heads"),
    (dict(head_dim=16), "head_dim"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(qkv_bias=True), "qkv_bias"),
    (dict(mla=MLAConfig), "mla"),
    (dict(mla=dict(kv_lora_rank=8, qk_rope_head_dim=5)), "qk_rope_head_dim"),
    (dict(mla=dict(kv_lora_rank=0)), "kv_lora_rank"),
    (dict(mla=dict(q_lora_rank=0)), "q_lora_rank"),
    (dict(mla=dict(v_head_dim=4, lora=3)), "lora"),
    (dict(mla=dict(yarn=dict(factor=0.0))), "YaRNConfig.factor"),
    (dict(mla=dict(yarn=3)), "yarn"),
])
def test_bad_mla_config_names_the_field(kw, field):
  base = dict(vocab_size=61, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=48,
              mla=MLAConfig())
  with pytest.raises(ValueError, match=field):
    ModelConfig(**{**base, **kw})
