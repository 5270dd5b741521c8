"""One-token decode steps against the KV cache equal the uncached forward.

The cache stores keys/values as ``[B, K, S, Dh]`` (docs/DESIGN.md §2) and a
decode step writes only its new slot; these tests pin that layout's
bookkeeping at every position: the slot written, the grouping of the H query
heads onto the K cached heads, and the masking of pad and not-yet-written
slots. Parameters are drawn with std 1/sqrt(fan_in) (not the 0.02 init) so
attention is far from uniform and a wrong slot or head shows in the logits.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import ModelConfig, default_positions, forward, init_cache, init_params

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  qk_norm=True, qkv_bias=True)
EPS32 = float(np.finfo(np.float32).eps)
T, S = 12, 16  # sequence length, cache slots (the last S - T stay empty)


@pytest.fixture(scope="module")
def params():
  """Random params with unit-scale activations: N(0, 1/fan_in) weights."""
  rng = np.random.default_rng(0)

  def draw(x):
    if x.ndim < 2:  # norm scales (ones) and biases: perturb around their init
      return jnp.asarray(np.asarray(x) + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[0]), x.dtype)

  return jax.tree.map(draw, init_params(CFG, jax.random.key(0)))


@pytest.fixture(scope="module")
def batch():
  """Three rows left-padded by 0, 2 and 5 tokens. [B, T] ids and mask."""
  rng = np.random.default_rng(1)
  toks = rng.integers(0, CFG.vocab_size, size=(3, T)).astype(np.int32)
  mask = np.ones((3, T), bool)
  for row, pad in enumerate((0, 2, 5)):
    mask[row, :pad] = False
  return jnp.asarray(toks), jnp.asarray(mask)


def _atol(ref):
  """Float32 bound for the cached-vs-uncached difference at ``ref``'s scale.

  The two paths differ only in the order of rounded reductions (attention
  over S vs T slots, one row vs T rows at a time): per layer ~14 rounded
  steps (norms, projections, QK-norm, RoPE, scores, softmax, mixing, MLP,
  residuals), +2 for the final norm and head, each a relative ~eps*sqrt(n)
  with n <= max(D, F, S) terms; independent steps add in quadrature and the
  max over all entries stays within ~4 standard deviations; x2 since both
  paths round.
  """
  steps = 14 * CFG.n_layers + 2
  n = max(CFG.d_model, CFG.d_ff, S)
  rms = float(np.sqrt(np.mean(np.square(np.asarray(ref, np.float64)))))
  return 2 * 4 * np.sqrt(steps) * np.sqrt(n) * EPS32 * rms


@pytest.mark.parametrize("prefill", [1, 4])
def test_every_decode_step_equals_full_forward(params, batch, prefill):
  toks, mask = batch
  full = np.asarray(forward(CFG, params, toks, mask=mask).logits)  # [B, T, V]
  pos = default_positions(mask)
  out = forward(CFG, params, toks[:, :prefill], pos[:, :prefill], mask[:, :prefill],
                init_cache(CFG, 3, S))
  cache, steps = out.cache, [np.asarray(out.logits)]
  for t in range(prefill, T):
    out = forward(CFG, params, toks[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache)
    cache = out.cache
    steps.append(np.asarray(out.logits))
  got = np.concatenate(steps, axis=1)
  real = np.asarray(mask)
  tol = _atol(full[real])
  for t in range(T):  # position by position, so a failure names the step
    rows = real[:, t]
    np.testing.assert_allclose(got[rows, t], full[rows, t], atol=tol, err_msg=f"position {t}")
  assert int(cache.index) == T
  np.testing.assert_array_equal(np.asarray(cache.mask), np.pad(real, ((0, 0), (0, S - T))))


def test_stepwise_cache_equals_one_prefill(params, batch):
  """Keys/values written step by step equal those of one prefill at every
  real slot; the slots past the last write stay zero. (Pad slots hold
  meaningless values that depend on how many empty slots a pad query saw.)"""
  toks, mask = batch
  pos = default_positions(mask)
  whole = forward(CFG, params, toks, pos, mask, init_cache(CFG, 3, S)).cache
  cache = init_cache(CFG, 3, S)
  for t in range(T):
    cache = forward(CFG, params, toks[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache).cache
  for name in ("k", "v"):
    for layer, (a, b) in enumerate(zip(getattr(whole, name), getattr(cache, name))):
      a, b = np.asarray(a), np.asarray(b)
      assert a.shape == (3, CFG.n_kv_heads, S, CFG.resolved_head_dim)
      real = np.asarray(mask)
      a_real, b_real = (x.transpose(0, 2, 1, 3)[:, :T][real] for x in (a, b))  # [n, K, Dh]
      np.testing.assert_allclose(b_real, a_real, atol=_atol(a_real), err_msg=f"{name} layer {layer}")
      assert not np.any(b[:, :, T:]), f"{name} layer {layer}: slots >= {T} were written"
