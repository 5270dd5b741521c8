"""Tests for opd/sampler.py: cached decoding against recomputation, logprobs,
seeds, top-k/top-p, EOS/stop handling, hidden states, sharding, validation,
and the prefill shared by repeated prompts.

Every compiled ``generate`` is keyed on (B, P, model config, the sampling
config's static fields), so all tests share one prompt batch shape [8, 6] and
N = 8; temperature, top-k, top-p and N <= the cap are traced.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.parallel import sharding as shd
from opd.models import ModelConfig, forward, init_params, param_logical_axes
from opd.rollout.prefill import distinct_rows
from opd.rollout.sampler import (SamplingConfig, compiled_programs, filter_logits, generate,
                                 left_align)

CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
N = 8
GREEDY = SamplingConfig(max_new_tokens=N, temperature=0.0, return_hidden=True)
TEMP1 = SamplingConfig(max_new_tokens=N, temperature=1.0)
TOPK = SamplingConfig(max_new_tokens=N, temperature=1.0, top_k=5)
TOPP = SamplingConfig(max_new_tokens=N, temperature=0.7, top_p=0.8)
# Real tokens per row of the [8, 6] prompt batch: left-, right- and
# hole-padded rows mixed in one batch.
MASK = np.array([
    [1, 1, 1, 1, 1, 1],
    [0, 0, 1, 1, 1, 1],  # left
    [1, 1, 1, 1, 0, 0],  # right
    [0, 0, 0, 0, 1, 1],  # left
    [1, 0, 0, 0, 0, 0],  # right, one token
    [1, 1, 0, 1, 1, 1],  # hole
    [0, 1, 1, 1, 1, 1],  # left
    [1, 1, 1, 0, 0, 0],  # right
], bool)


EPS32 = float(np.finfo(np.float32).eps)


def _f32_atol(ref):
  """Cached decoding vs one full forward: the same float32 math in another
  reduction order. Each of ~14 rounded steps per layer (+2 for norm and head)
  is off by ~sqrt(n)·eps relative (n <= max(D, F)); steps add in quadrature;
  the max over all entries is within ~4 standard deviations of ``ref``'s RMS."""
  steps, n = 14 * CFG.n_layers + 2, max(CFG.d_model, CFG.d_ff)
  return 4 * np.sqrt(steps) * np.sqrt(n) * EPS32 * np.sqrt(np.mean(np.square(ref, dtype=np.float64)))


def _logprob_atol(logits, lp):
  """Log-probs: the logits' error (``_f32_atol``), twice (a logit and the max
  in the log-sum-exp), plus a float32 log-sum-exp over V terms, ~sqrt(V)·eps
  relative to |log p|."""
  return 2 * _f32_atol(logits) + 4 * np.sqrt(CFG.vocab_size) * EPS32 * np.abs(lp).max()


# Every reference forward has shape [8, 6 + N]: one compile.
_forward = jax.jit(lambda params, tokens, mask: forward(CFG, params, tokens, mask=mask,
                                                        return_hidden=True))


@pytest.fixture(scope="module")
def model():
  params = init_params(CFG, jax.random.key(0))
  # A random init is nearly uniform over V; a larger head gives peaked,
  # well-separated logits, so top-k/top-p sets are non-trivial and argmax
  # has no near-ties between the cached and the recomputed path.
  params["lm_head"] = params["lm_head"] * 40.0
  return params


@pytest.fixture(scope="module")
def prompts():
  rs = np.random.RandomState(1)
  # Pad slots hold random ids too: they must be ignored, not read as pad_id.
  return rs.randint(0, CFG.vocab_size, MASK.shape).astype(np.int32), MASK


def _full_forward(params, prompt_tokens, prompt_mask, out):
  """One forward over [prompt | response] in the caller's layout.

  Returns logits [B, N, V] and hidden [B, N, D] at the position each
  response token was sampled from (the preceding real token).
  """
  seq = np.concatenate([prompt_tokens, np.asarray(out.tokens)], axis=1)
  mask = np.concatenate([prompt_mask, np.asarray(out.mask)], axis=1)
  full = _forward(params, jnp.asarray(seq), jnp.asarray(mask))
  P = prompt_tokens.shape[1]
  last_prompt = P - 1 - np.argmax(prompt_mask[:, ::-1], axis=1)  # [B]
  prev = np.concatenate([last_prompt[:, None], np.tile(np.arange(P, P + N - 1), (len(seq), 1))],
                        axis=1)  # [B, N]
  take = lambda x: np.take_along_axis(np.asarray(x), prev[..., None], axis=1)
  return take(full.logits), take(full.hidden)


def _log_softmax(x):
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def greedy_reference(model, prompts):
  """Greedy decoding without a cache: each step runs ``forward`` over the
  whole sequence so far (kept in a fixed [B, P + N] buffer whose unwritten
  tail is masked out, so one compiled forward serves every step) and takes
  the argmax at each row's last real token."""
  tokens, mask = prompts
  B, P = tokens.shape
  seq = np.concatenate([tokens, np.zeros((B, N), np.int32)], axis=1)
  m = np.concatenate([mask, np.zeros((B, N), bool)], axis=1)
  for t in range(N):
    logits = np.asarray(_forward(model, jnp.asarray(seq), jnp.asarray(m)).logits)
    last = m.shape[1] - 1 - np.argmax(m[:, ::-1], axis=1)
    seq[:, P + t] = np.argmax(logits[np.arange(B), last], axis=-1)
    m[:, P + t] = True
  return seq[:, P:]


@pytest.fixture(scope="module")
def greedy_out(model, prompts):
  return generate(CFG, model, *prompts, jax.random.key(0), GREEDY)


def test_cached_greedy_equals_recomputation(greedy_out, greedy_reference):
  np.testing.assert_array_equal(np.asarray(greedy_out.tokens), greedy_reference)
  assert np.asarray(greedy_out.mask).all()
  np.testing.assert_array_equal(np.asarray(greedy_out.lengths), N)
  assert not np.asarray(greedy_out.finished).any()
  assert int(greedy_out.steps) == N


def test_left_align_keeps_order():
  tokens = np.array([[5, 6, 7, 9], [1, 2, 3, 4]])
  mask = np.array([[1, 0, 1, 1], [0, 0, 1, 0]], bool)
  aligned, amask = left_align(jnp.asarray(tokens), jnp.asarray(mask), pad_id=0)
  np.testing.assert_array_equal(np.asarray(aligned), [[0, 5, 7, 9], [0, 0, 0, 3]])
  np.testing.assert_array_equal(np.asarray(amask), [[0, 1, 1, 1], [0, 0, 0, 1]])


def test_greedy_hidden_and_logprobs_match_full_forward(model, prompts, greedy_out):
  logits, hidden = _full_forward(model, *prompts, greedy_out)
  np.testing.assert_allclose(np.asarray(greedy_out.hidden), hidden, atol=_f32_atol(hidden), rtol=0)
  lp = np.take_along_axis(_log_softmax(logits), np.asarray(greedy_out.tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(greedy_out.logprobs), lp, atol=_logprob_atol(logits, lp))


@pytest.mark.parametrize("sampling", [TEMP1, TOPP], ids=["T=1", "T=0.7_top_p=0.8"])
def test_logprobs_match_full_forward(model, prompts, sampling):
  temperature = sampling.temperature
  out = generate(CFG, model, *prompts, jax.random.key(3), sampling)
  logits, _ = _full_forward(model, *prompts, out)
  lp = np.take_along_axis(_log_softmax(logits / temperature),
                          np.asarray(out.tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logprobs), lp,
                             atol=_logprob_atol(logits / temperature, lp))
  assert out.hidden is None


def test_seed_reproducibility(model, prompts):
  a = generate(CFG, model, *prompts, jax.random.key(7), TEMP1)
  b = generate(CFG, model, *prompts, jax.random.key(7), TEMP1)
  c = generate(CFG, model, *prompts, jax.random.key(8), TEMP1)
  d = generate(CFG, model, *prompts, 7, TEMP1)  # an int seed means jax.random.key(seed)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(d.tokens))
  assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


def test_top_k_one_is_greedy(model, prompts, greedy_reference, greedy_out):
  out = generate(CFG, model, *prompts, jax.random.key(5), TEMP1.replace(top_k=1))
  np.testing.assert_array_equal(np.asarray(out.tokens), greedy_reference)
  # Both report log_softmax(logits / 1) of the same tokens, from two compiled
  # programs (the filters differ), so up to float32 reduction order.
  lp = np.asarray(greedy_out.logprobs)
  logits, _ = _full_forward(model, *prompts, greedy_out)
  np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=_logprob_atol(logits, lp))


def test_top_k_restricts_samples_and_reports_untruncated_logprobs(model, prompts):
  out = generate(CFG, model, *prompts, jax.random.key(11), TOPK)
  tokens = np.asarray(out.tokens)
  logits, _ = _full_forward(model, *prompts, out)
  # Rank of each sampled token under the full-forward logits (0 = argmax).
  rank = (logits > np.take_along_axis(logits, tokens[..., None], -1)).sum(-1)
  assert rank.max() < TOPK.top_k
  assert (rank > 0).mean() > 0.2, "sampling never left the argmax: the test would be vacuous"
  logp = _log_softmax(logits)
  untruncated = np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logprobs), untruncated,
                             atol=_logprob_atol(logits, untruncated))
  # The renormalised top-k log-prob differs by -log(top-k mass); the
  # reported values must not be those.
  topk_mass = np.sort(np.exp(logp), axis=-1)[..., -TOPK.top_k:].sum(-1)
  assert (-np.log(topk_mass) > 1e-3).any()


def _numpy_nucleus(logits, top_p, top_k=0):
  """Indices kept by top-k then top-p, computed with a plain sort."""
  order = np.argsort(-logits)
  if top_k:
    order = order[:top_k]
  probs = np.exp(logits[order] - logits[order].max())
  probs /= probs.sum()
  n = int(np.searchsorted(np.cumsum(probs), top_p) + 1)  # smallest prefix with mass >= top_p
  return set(order[:min(n, len(order))].tolist())


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 0.9, 1.0), (0, 0.5, 0.7), (20, 0.8, 1.0),
                                                     (7, 1.0, 1.3)])
def test_filter_logits_matches_numpy_nucleus(top_k, top_p, temperature):
  logits = np.random.RandomState(top_k + int(100 * top_p)).randn(6, 256).astype(np.float32) * 1.5
  filtered = np.asarray(filter_logits(jnp.asarray(logits), temperature, top_k, top_p))
  for row, frow in zip(logits, filtered):
    kept = set(np.flatnonzero(np.isfinite(frow)).tolist())
    expected = _numpy_nucleus(row.astype(np.float64) / temperature, top_p, top_k)
    assert kept == expected
    assert 1 < len(kept) < 256
    # One float32 division (or a product with a rounded 1/τ): <= 1.5 eps apart.
    np.testing.assert_allclose(frow[list(kept)], row[list(kept)] / temperature, rtol=2 * EPS32)


def test_top_p_samples_stay_in_numpy_nucleus(model, prompts):
  sampling = TOPP
  out = generate(CFG, model, *prompts, jax.random.key(13), sampling)
  tokens = np.asarray(out.tokens)
  logits, _ = _full_forward(model, *prompts, out)
  sizes = []
  for b in range(tokens.shape[0]):
    for t in range(N):
      nucleus = _numpy_nucleus(logits[b, t].astype(np.float64) / sampling.temperature,
                               sampling.top_p)
      sizes.append(len(nucleus))
      assert tokens[b, t] in nucleus, (b, t)
  assert max(sizes) > 1, "every nucleus was a single token: the test would be vacuous"


def _first_new(row, start):
  """First step >= start whose token did not occur earlier in the row."""
  return next(t for t in range(start, len(row)) if row[t] not in row[:t])


def test_eos_and_stop_end_rows(model, prompts, greedy_reference):
  ref = greedy_reference
  eos = int(ref[0, _first_new(ref[0], 2)])
  stop = int(ref[1, _first_new(ref[1], 3)])
  sampling = SamplingConfig(max_new_tokens=N, temperature=0.0, eos_ids=(eos,), stop_ids=(stop,),
                            pad_id=3)
  # Expected from the cache-free greedy tokens: cut after the first end id.
  hits = np.isin(ref, [eos, stop])
  exp_finished = hits.any(axis=1)
  exp_len = np.where(exp_finished, hits.argmax(axis=1) + 1, N)
  assert exp_finished.any() and not exp_finished.all(), "need ended and truncated rows"
  exp_mask = np.arange(N)[None] < exp_len[:, None]
  exp_tokens = np.where(exp_mask, ref, 3)

  out = generate(CFG, model, *prompts, jax.random.key(0), sampling)
  np.testing.assert_array_equal(np.asarray(out.tokens), exp_tokens)
  np.testing.assert_array_equal(np.asarray(out.mask), exp_mask)
  np.testing.assert_array_equal(np.asarray(out.lengths), exp_len)
  np.testing.assert_array_equal(np.asarray(out.finished), exp_finished)
  assert (np.asarray(out.logprobs)[~exp_mask] == 0).all()
  assert (np.asarray(out.logprobs)[exp_mask] < 0).all()

  # Same shapes and config, a batch whose rows all end early: the loop must
  # stop after the longest row instead of running N steps.
  tokens, mask = prompts
  rows = np.array([0, 1] * 4)
  out2 = generate(CFG, model, tokens[rows], mask[rows], jax.random.key(0), sampling)
  np.testing.assert_array_equal(np.asarray(out2.lengths), exp_len[rows])
  assert np.asarray(out2.finished).all()
  assert int(out2.steps) == exp_len[rows].max() < N


def test_sharded_generation_matches_single_device(model, prompts):
  mesh = shd.make_mesh((2, 2, 2))
  rules = shd.DEFAULT_RULES
  shardings = shd.tree_shardings(param_logical_axes(CFG), model, mesh, rules)
  sharded_params = jax.device_put(model, shardings)
  assert not sharded_params["lm_head"].sharding.is_fully_replicated
  single = generate(CFG, model, *prompts, jax.random.key(21), TOPK)
  sharded = generate(CFG, sharded_params, *prompts, jax.random.key(21), TOPK, mesh=mesh,
                     rules=rules)
  assert len(sharded.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
  lp = np.asarray(single.logprobs)
  logits, _ = _full_forward(model, *prompts, single)
  np.testing.assert_allclose(np.asarray(sharded.logprobs), lp, atol=_logprob_atol(logits, lp))


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", 0), ("max_new_tokens", 2.5), ("temperature", -0.1),
    ("temperature", float("inf")), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5),
    ("eos_ids", 2), ("eos_ids", (1, -2)), ("stop_ids", ("a",)), ("pad_id", -1),
    ("return_hidden", 1), ("share_prefill", "yes"),
])
def test_invalid_sampling_config(field, value):
  with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
    SamplingConfig(**{field: value})


def test_invalid_inputs(model, prompts):
  tokens, mask = prompts
  key = jax.random.key(0)
  cases = [
      ((tokens[0], mask[0], TEMP1), "prompt_tokens"),
      ((tokens, mask[:, :5], TEMP1), "prompt_mask shape"),
      ((tokens, mask.astype(np.float32), TEMP1), "prompt_mask"),
      ((tokens, np.where(np.arange(8)[:, None] == 2, False, mask), TEMP1), r"rows \[2\]"),
      ((np.where(mask, 256, tokens), mask, TEMP1), "prompt_tokens ids"),
      ((tokens, mask, TEMP1.replace(eos_ids=(256,))), "SamplingConfig.eos_ids"),
      ((tokens, mask, TEMP1.replace(pad_id=300)), "SamplingConfig.pad_id"),
  ]
  for (t, m, s), match in cases:
    with pytest.raises(ValueError, match=match):
      generate(CFG, model, t, m, key, s)
  with pytest.raises(ValueError, match="not divisible"):
    generate(CFG, model, tokens[:6], mask[:6], key, TEMP1, mesh=shd.make_mesh((8, 1, 1)))


def test_sweep_over_traced_fields_compiles_once(model, prompts, greedy_reference):
  # pad_id=1 is a static key no other test uses, so its first call compiles.
  base = SamplingConfig(max_new_tokens=N, pad_id=1)
  before = compiled_programs()
  sampled = {}
  for top_p in (1.0, 0.8):
    for temperature in (0.0, 0.5, 0.7, 1.0, 1.3):
      out = generate(CFG, model, *prompts, jax.random.key(17), base.replace(
          temperature=temperature, top_p=top_p))
      tokens = np.asarray(out.tokens)
      logits, _ = _full_forward(model, *prompts, out)
      if temperature == 0.0:
        np.testing.assert_array_equal(tokens, greedy_reference)
      # The traced temperature reaches the reported log-probs (T = 1 when greedy).
      t = temperature or 1.0
      lp = np.take_along_axis(_log_softmax(logits / t), tokens[..., None], -1)[..., 0]
      np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=_logprob_atol(logits / t, lp))
      if top_p < 1.0:
        for b, row in enumerate(tokens):
          for s in range(N):
            assert row[s] in _numpy_nucleus(logits[b, s].astype(np.float64) / t, top_p), (b, s)
      sampled[temperature, top_p] = tokens
  assert compiled_programs() - before == 1
  # The sweep is not vacuous: the sampled tokens change with the temperature.
  assert len({v.tobytes() for v in sampled.values()}) > 5


def test_max_new_tokens_below_cap_reuses_program(model, prompts, greedy_reference):
  capped = SamplingConfig(max_new_tokens=N, max_new_tokens_cap=N, temperature=0.0, pad_id=2)
  full = generate(CFG, model, *prompts, jax.random.key(0), capped)
  before = compiled_programs()
  for n in (3, 5):
    out = generate(CFG, model, *prompts, jax.random.key(0), capped.replace(max_new_tokens=n))
    assert out.tokens.shape == out.mask.shape == out.logprobs.shape == (8, n)
    np.testing.assert_array_equal(np.asarray(out.tokens), greedy_reference[:, :n])
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(full.logprobs)[:, :n])
    np.testing.assert_array_equal(np.asarray(out.lengths), n)
    assert int(out.steps) == n and not np.asarray(out.finished).any()
  assert compiled_programs() == before


def test_filter_logits_traced_matches_numpy_nucleus():
  jitted = jax.jit(filter_logits)
  for top_k, top_p, temperature in [(0, 0.9, 1.0), (0, 0.5, 0.7), (20, 0.8, 1.0), (7, 1.0, 1.3),
                                    (0, 1.0, 0.9), (300, 0.6, 1.1)]:
    logits = np.random.RandomState(top_k + int(100 * top_p)).randn(6, 256).astype(np.float32)
    filtered = np.asarray(jitted(jnp.asarray(logits), jnp.float32(temperature),
                                 jnp.int32(top_k), jnp.float32(top_p)))
    for row, frow in zip(logits, filtered):
      kept = set(np.flatnonzero(np.isfinite(frow)).tolist())
      assert kept == _numpy_nucleus(row.astype(np.float64) / temperature, top_p, top_k)
  # top_p = 1 is off even where float32 cumulative mass reaches 1 early: a
  # peaked row (the tail's mass ~255·e^-30 is below eps) keeps every token.
  peaked = np.zeros((6, 256), np.float32)  # the shape above: the same program
  peaked[:, 0] = 30.0
  kept = np.isfinite(np.asarray(jitted(jnp.asarray(peaked), jnp.float32(1.0), jnp.int32(0),
                                       jnp.float32(1.0))))
  assert kept.all()
  assert jitted._cache_size() == 1


@pytest.mark.parametrize("cap,match", [(0, "max_new_tokens_cap"), (4, "max_new_tokens_cap=4 <")])
def test_invalid_max_new_tokens_cap(cap, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(max_new_tokens=5, max_new_tokens_cap=cap)


# pad_id=3 is a static key only the shared-prefill tests use: both paths
# compile in the first of them.
SHARED = SamplingConfig(max_new_tokens=N, pad_id=3, return_hidden=True)


@pytest.fixture(scope="module")
def repeated_prompts():
  """[8, 6] rows holding 4 prompts: a at rows 0, 2, 5 (left-, right-,
  hole-padded), b at 1 and 6, c (one token) at 3, d at 4 and 7 (right- and
  left-padded); junk ids in every pad slot."""
  rs = np.random.RandomState(3)
  a, b, c, d = (rs.randint(0, CFG.vocab_size, n) for n in (5, 6, 1, 3))
  layout = [(a, "0....."), (b, "......"), (a, ".....0"), (c, "00000."),
            (d, "...000"), (a, ".0...."), (b, "......"), (d, "000...")]
  tokens = rs.randint(0, CFG.vocab_size, (8, 6)).astype(np.int32)
  mask = np.array([[ch == "." for ch in m] for _, m in layout])
  for row, (ids, _) in enumerate(layout):
    tokens[row, mask[row]] = ids
  return tokens, mask


def test_shared_prefill_equals_prefill_of_every_row(model, repeated_prompts):
  tokens, mask = repeated_prompts
  rows = distinct_rows(tokens, mask)
  assert rows is not None and len(rows.rows) == 4  # the shared path runs (U = 4 of 8)
  base = SHARED
  before = compiled_programs()
  sampled = set()
  for top_k, top_p in ((0, 1.0), (5, 0.8)):
    for temperature in (0.0, 0.5, 0.7, 1.0, 1.3):
      s = base.replace(temperature=temperature, top_k=top_k, top_p=top_p)
      shared = generate(CFG, model, tokens, mask, jax.random.key(5), s)
      every = generate(CFG, model, tokens, mask, jax.random.key(5), s.replace(share_prefill=False))
      # Independent reference for the log-probs and the tolerance: one full
      # forward over [prompt | response].
      logits, hidden = _full_forward(model, tokens, mask, every)
      lp = np.asarray(every.logprobs)
      t = temperature or 1.0
      ref = np.take_along_axis(_log_softmax(logits / t), np.asarray(every.tokens)[..., None],
                               -1)[..., 0]
      np.testing.assert_allclose(lp, ref, atol=_logprob_atol(logits / t, ref))
      # The shared prefill changes nothing: same tokens, log-probs, hidden states.
      np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(every.tokens))
      np.testing.assert_array_equal(np.asarray(shared.mask), np.asarray(every.mask))
      np.testing.assert_allclose(np.asarray(shared.logprobs), lp,
                                 atol=_logprob_atol(logits / t, lp))
      np.testing.assert_allclose(np.asarray(shared.hidden), np.asarray(every.hidden),
                                 atol=_f32_atol(hidden))
      sampled.add(np.asarray(shared.tokens).tobytes())
  # One program per path for the whole sweep over traced fields (the shared
  # path is a program of its own: it did run).
  assert compiled_programs() - before == 2
  assert len(sampled) > 5  # the sweep is not vacuous


def test_shared_prefill_sharded_matches_single_device(model, repeated_prompts):
  mesh = shd.make_mesh((2, 2, 2))  # 'batch' over data x fsdp: U rounds to 4 devices
  assert distinct_rows(*repeated_prompts, multiple_of=4) is not None
  shardings = shd.tree_shardings(param_logical_axes(CFG), model, mesh, shd.DEFAULT_RULES)
  topk = SHARED.replace(top_k=5)
  single = generate(CFG, model, *repeated_prompts, jax.random.key(21), topk)
  sharded = generate(CFG, jax.device_put(model, shardings), *repeated_prompts,
                     jax.random.key(21), topk, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
  lp = np.asarray(single.logprobs)
  logits, _ = _full_forward(model, *repeated_prompts, single)
  np.testing.assert_allclose(np.asarray(sharded.logprobs), lp, atol=_logprob_atol(logits, lp))
