"""Decoder properties. Parity with `transformers` lives in test_hf.py.

Here: an independent float64 numpy forward on random non-trivial params
(float32 and bf16 compute), padding invariance (the same sequence left-, right- or un-padded gives
the same logits at its real tokens), cached prefill + decode equals the
uncached pass, hidden @ head == logits, the scalar head, bf16 compute with
fp32 params, logical axes on every parameter, and config validation.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import (ModelConfig, default_positions, forward, head_matrix, init_cache,
                        init_params, last_token_values, param_logical_axes, token_logprobs)

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  qk_norm=True, qkv_bias=True)


EPS32 = float(np.finfo(np.float32).eps)
# Rounded steps per layer in the forward (norms and their scale, q/k/v/o
# projections and biases, QK-norm, RoPE, scores, softmax, attention output,
# residual adds, gate/up/silu/product/down); +2 for the final norm and head.
ROUNDED_STEPS = 14 * CFG.n_layers + 2


def _rms(x):
  return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def f32_atol(ref):
  """Float32 forward error bound for outputs of ``ref``'s scale.

  Each rounded step adds a relative error ~eps*sqrt(n) (a reduction of n <=
  max(D, F) terms, random-walk rounding), independent steps add in
  quadrature, and the max over all entries is within ~4 standard deviations.
  """
  n = max(CFG.d_model, CFG.d_ff)
  return 4 * np.sqrt(ROUNDED_STEPS) * np.sqrt(n) * EPS32 * _rms(ref)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


def _seq(n, seed):
  return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=n)


def test_padding_invariance_left_and_right(params):
  a, b = _seq(5, 1), _seq(8, 2)
  alone_a = forward(CFG, params, jnp.asarray(a)[None]).logits[0]
  alone_b = forward(CFG, params, jnp.asarray(b)[None]).logits[0]
  # Row 0: `a` left-padded to 8; row 1: `a` right-padded; row 2: `b` unpadded.
  pad = 3
  toks = np.zeros((3, 8), np.int32)
  mask = np.zeros((3, 8), bool)
  toks[0, pad:], mask[0, pad:] = a, True
  toks[1, :5], mask[1, :5] = a, True
  toks[2], mask[2] = b, True
  out = forward(CFG, params, jnp.asarray(toks), mask=jnp.asarray(mask)).logits
  # Padding only changes the order and length of the masked reductions.
  np.testing.assert_allclose(out[0, pad:], alone_a, atol=f32_atol(alone_a))
  np.testing.assert_allclose(out[1, :5], alone_a, atol=f32_atol(alone_a))
  np.testing.assert_allclose(out[2], alone_b, atol=f32_atol(alone_b))
  assert np.isfinite(np.asarray(out)).all()  # pad rows stay finite


def test_cached_chunks_equal_uncached(params):
  toks = jnp.asarray(np.stack([_seq(10, 3), _seq(10, 4)]))
  mask = jnp.asarray(np.array([[0, 0] + [1] * 8, [1] * 10], bool))
  full = forward(CFG, params, toks, mask=mask).logits
  pos = default_positions(mask)
  cache = init_cache(CFG, 2, 16)
  pieces = []
  for lo, hi in [(0, 4), (4, 5), (5, 6), (6, 10)]:  # prefill, then 1-token and 4-token steps
    out = forward(CFG, params, toks[:, lo:hi], pos[:, lo:hi], mask[:, lo:hi], cache)
    cache = out.cache
    pieces.append(out.logits)
  got = jnp.concatenate(pieces, axis=1)
  np.testing.assert_allclose(np.asarray(got)[np.asarray(mask)], np.asarray(full)[np.asarray(mask)],
                             atol=f32_atol(full))
  assert int(cache.index) == 10
  np.testing.assert_array_equal(np.asarray(cache.mask[:, :10]), np.asarray(mask))


def test_hidden_times_head_is_logits(params):
  toks = jnp.asarray(_seq(6, 5))[None]
  out = forward(CFG, params, toks, return_hidden=True)
  np.testing.assert_allclose(out.hidden @ head_matrix(CFG, params), out.logits, atol=f32_atol(out.logits))
  hidden_only = forward(CFG, params, toks, return_logits=False, return_hidden=True)
  assert hidden_only.logits is None
  np.testing.assert_allclose(hidden_only.hidden, out.hidden, atol=0)


def test_tied_head_and_token_logprobs():
  cfg = CFG.replace(tie_embeddings=True)
  p = init_params(cfg, jax.random.key(1))
  assert "lm_head" not in p
  toks = jnp.asarray(_seq(6, 6))[None]
  out = forward(cfg, p, toks, return_hidden=True)
  np.testing.assert_allclose(out.logits, out.hidden @ p["embedding"].T, atol=f32_atol(out.logits))
  lp = token_logprobs(out.logits, toks, temperature=0.7)
  ref = jax.nn.log_softmax(np.asarray(out.logits, np.float64) / 0.7, axis=-1)
  ref = np.take_along_axis(np.asarray(ref), np.asarray(toks)[..., None], -1)[..., 0]
  # A float32 logsumexp over V terms: ~sqrt(V) eps relative to |log-prob|.
  np.testing.assert_allclose(lp, ref, atol=4 * np.sqrt(cfg.vocab_size) * EPS32 * np.abs(ref).max())


def test_scalar_head_reads_last_real_token():
  cfg = CFG.replace(scalar_head=True)
  p = init_params(cfg, jax.random.key(2))
  toks = jnp.asarray(np.stack([_seq(7, 7), _seq(7, 8)]))
  mask = jnp.asarray(np.array([[1] * 5 + [0] * 2, [0] * 3 + [1] * 4], bool))
  out = forward(cfg, p, toks, mask=mask, return_hidden=True)
  expect = out.hidden @ p["value_head"] + p["value_bias"]
  np.testing.assert_allclose(out.values, expect[..., 0], atol=f32_atol(expect))
  got = last_token_values(out.values, mask)
  np.testing.assert_allclose(got, [out.values[0, 4], out.values[1, 6]], atol=0)


def test_every_param_has_logical_axes():
  specs = param_logical_axes(CFG)
  shapes = jax.eval_shape(lambda r: init_params(CFG, r), jax.random.key(0))
  flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  flat_shapes = jax.tree.leaves(shapes)
  assert len(flat_specs) == len(flat_shapes)
  for spec, shape in zip(flat_specs, flat_shapes):
    assert len(spec) == len(shape.shape) and all(isinstance(a, str) for a in spec), spec


def test_num_params_matches_tree():
  for cfg in [CFG, CFG.replace(tie_embeddings=True, qk_norm=False, qkv_bias=False),
              CFG.replace(scalar_head=True, o_bias=True, head_dim=16)]:
    p = init_params(cfg, jax.random.key(0))
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(p))


@pytest.mark.parametrize("changes, needle", [
    (dict(d_model=30, n_heads=4), "d_model=30 is not divisible by n_heads=4"),
    (dict(n_heads=4, n_kv_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
    (dict(vocab_size=0), "vocab_size must be a positive int, got 0"),
    (dict(dtype="float8"), "ModelConfig.dtype must be one of .*got 'float8'"),
    (dict(head_dim=7), "head_dim=7 must be even"),
])
def test_config_errors_name_field_and_value(changes, needle):
  with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
    CFG.replace(**changes)


def test_config_from_dict_rejects_unknown():
  with pytest.raises(ValueError, match=r"ModelConfig has unknown field\(s\) \['widht'\]"):
    ModelConfig.from_dict({"widht": 3})
  assert ModelConfig.from_dict(CFG.to_dict()) == CFG


def test_cache_without_positions_raises(params):
  with pytest.raises(ValueError, match="positions must be given"):
    forward(CFG, params, jnp.zeros((1, 2), jnp.int32), cache=init_cache(CFG, 1, 4))


def test_flat_init_matches_module_initialisers():
  """init_params (one flat draw) agrees with the module's own per-param init:
  same tree, ones where the module puts ones, zeros where zeros, and normal
  leaves with std ≈ 0.02 and distinct values across parameters."""
  from opd.models import Decoder
  cfg = CFG.replace(o_bias=True, scalar_head=True, n_layers=1)
  ours = init_params(cfg, jax.random.key(3))
  # The module's own init draws each param separately; a cheap PRNG keeps
  # its compile short (the values are only compared by kind).
  module_init = jax.jit(lambda k: Decoder(cfg).init(k, jnp.zeros((1, 2), jnp.int32))["params"])
  module = nn.meta.unbox(module_init(jax.random.key(3, impl="unsafe_rbg")))
  assert jax.tree.structure(ours) == jax.tree.structure(module)
  normals = []
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree.leaves(module)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, path
    if np.all(b == 1) or np.all(b == 0):
      np.testing.assert_array_equal(a, b, err_msg=str(path))
    else:
      normals.append(a.ravel())
  allv = np.concatenate(normals)
  # Six standard errors of the sample std (sigma / sqrt(2n)) and mean (sigma / sqrt(n)).
  n = allv.size
  assert abs(allv.std() - 0.02) < 6 * 0.02 / np.sqrt(2 * n) and abs(allv.mean()) < 6 * 0.02 / np.sqrt(n)
  assert len({float(v[0]) for v in normals}) == len(normals)  # no two params share a slice
  boxed = init_params(cfg, jax.random.key(3), boxed=True)
  assert nn.get_partition_spec(boxed) == param_logical_axes(cfg)


def test_packed_segments_equal_separate_sequences(params):
  """Two documents packed in one row with segment_ids and restarting
  positions give the same logits as each document alone."""
  a, b = _seq(4, 10), _seq(5, 11)
  toks = jnp.asarray(np.concatenate([a, b]))[None]
  seg = jnp.asarray([[1] * 4 + [2] * 5])
  pos = jnp.asarray([list(range(4)) + list(range(5))])
  packed = forward(CFG, params, toks, pos, segment_ids=seg).logits[0]
  np.testing.assert_allclose(packed[:4], forward(CFG, params, jnp.asarray(a)[None]).logits[0],
                             atol=f32_atol(packed))
  np.testing.assert_allclose(packed[4:], forward(CFG, params, jnp.asarray(b)[None]).logits[0],
                             atol=f32_atol(packed))
  with pytest.raises(ValueError, match="segment_ids"):
    forward(CFG, params, toks[:, :2], pos[:, :2], cache=init_cache(CFG, 1, 4), segment_ids=seg[:, :2])


# ---------------------------------------------------------------------------
# An independent float64 numpy forward on random, non-trivial params. The
# tests above only check self-consistency; this one sees wiring errors (RoPE
# on the wrong tensor, the wrong query-head -> kv-head map, a dropped
# sub-layer). Written from docs/DESIGN.md §2, not from the module.

REF_CFG = CFG.replace(o_bias=True)  # every optional piece on: biases, QK-norm


def _random_params(cfg, seed):
  """Params of the model's tree with non-trivial values: weights N(0, 1/fan_in)
  so every sub-layer contributes O(1) to the residual stream, norm scales in
  [0.5, 1.5] and biases N(0, 0.5^2) (init_params' 1 and 0 would hide a
  mis-wired scale or bias)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))

  def draw(path, s):
    name = path[-1].key
    if name == "scale":
      return rng.uniform(0.5, 1.5, s.shape)
    if name.endswith("bias"):
      return rng.normal(0.0, 0.5, s.shape)
    fan_in = s.shape[1] if name == "embedding" else int(np.prod(s.shape)) // s.shape[-1]
    if name in ("q", "k", "v"):
      fan_in = s.shape[0]
    return rng.normal(0.0, 1.0 if name == "embedding" else fan_in ** -0.5, s.shape)

  return jax.tree_util.tree_map_with_path(lambda p, s: draw(p, s).astype(np.float32), shapes)


def _np_rmsnorm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _np_rope(x, theta):
  """Rotate-half RoPE at positions 0..T-1. x: [T, N, Dh]."""
  T, _, dh = x.shape
  inv_freq = theta ** (-np.arange(0, dh, 2) / dh)  # [Dh/2]
  ang = np.arange(T)[:, None] * inv_freq  # [T, Dh/2]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # [T, 1, Dh/2]
  x1, x2 = x[..., :dh // 2], x[..., dh // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_forward(cfg, params, tokens):
  """float64 logits [T, V] of one unpadded sequence ``tokens`` [T]."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  T, H, K = len(tokens), cfg.n_heads, cfg.n_kv_heads
  dh, eps = cfg.resolved_head_dim, cfg.norm_eps
  x = p["embedding"][tokens]  # [T, D]
  causal = np.tril(np.ones((T, T), bool))
  for i in range(cfg.n_layers):
    lp, a = p[f"layers_{i}"], p[f"layers_{i}"]["attn"]
    h = _np_rmsnorm(x, lp["attn_norm"]["scale"], eps)
    q = np.einsum("td,dhe->the", h, a["q"]) + a["q_bias"]  # [T, H, Dh]
    k = np.einsum("td,dke->tke", h, a["k"]) + a["k_bias"]  # [T, K, Dh]
    v = np.einsum("td,dke->tke", h, a["v"]) + a["v_bias"]
    q = _np_rope(_np_rmsnorm(q, a["q_norm"]["scale"], eps), cfg.rope_theta)
    k = _np_rope(_np_rmsnorm(k, a["k_norm"]["scale"], eps), cfg.rope_theta)
    heads = []
    for hq in range(H):
      kv = hq // (H // K)  # query heads are grouped: G consecutive heads per kv head
      s = q[:, hq] @ k[:, kv].T / np.sqrt(dh)  # [T, T]
      s = np.where(causal, s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      heads.append((w / w.sum(-1, keepdims=True)) @ v[:, kv])  # [T, Dh]
    x = x + np.einsum("the,hed->td", np.stack(heads, 1), a["o"]) + a["o_bias"]
    m = lp["mlp"]
    h = _np_rmsnorm(x, lp["mlp_norm"]["scale"], eps)
    g = h @ m["gate"]
    x = x + (g / (1 + np.exp(-g)) * (h @ m["up"])) @ m["down"]
  return _np_rmsnorm(x, p["final_norm"]["scale"], eps) @ p["lm_head"]


@pytest.fixture(scope="module")
def ref_case():
  params = _random_params(REF_CFG, 0)
  toks = _seq(12, 12)
  return params, toks, _np_forward(REF_CFG, params, toks)


def test_forward_matches_numpy_reference(ref_case):
  params, toks, want = ref_case
  got = np.asarray(forward(REF_CFG, params, jnp.asarray(toks)[None]).logits[0], np.float64)
  # float32 with highest matmul precision (tests/conftest.py): see f32_atol.
  np.testing.assert_allclose(got, want, rtol=0, atol=f32_atol(want))


def test_bf16_compute_matches_numpy_reference(ref_case):
  params, toks, want = ref_case
  cfg = REF_CFG.replace(dtype="bfloat16")
  out = forward(cfg, params, jnp.asarray(toks)[None], return_hidden=True)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert out.hidden.dtype == jnp.bfloat16 and out.logits.dtype == jnp.float32
  err = np.asarray(out.logits[0], np.float64) - want
  # bf16 keeps 8 significant bits: each rounding (an activation, or a weight
  # cast to bf16) is a relative error uniform in +-u, u = 2^-8, std u/sqrt(3).
  # A logit contracts D such errors, so each rounded stage adds ~u/sqrt(3)
  # times the logits' RMS; counting ~25 stages per layer in the bf16 path
  # (the fp32 steps plus the casts of activations and of the 7 weight
  # matrices) and 4 more for the embedding, final norm and head, independent
  # stages add in quadrature. The RMS error stays below twice that estimate;
  # the max over the T*V logits below 6 of its standard deviations.
  sigma = 2.0 ** -8 / np.sqrt(3) * np.sqrt(25 * cfg.n_layers + 4) * _rms(want)
  assert _rms(err) < 2 * sigma
  assert np.abs(err).max() < 6 * sigma
  # The bound is meaningful: every sub-layer moves the logits by O(their RMS)
  # on these params (dropping the MLP changes them by ~3x their RMS), far
  # above 6 sigma ~ 0.1 RMS.
  assert 6 * sigma < 0.2 * _rms(want)


# ---------------------------------------------------------------------------
# Token ids at the boundary. Before: an id >= V read jnp.take's NaN fill row
# (NaN logits everywhere, through attention even from a pad position) and a
# negative id wrapped to another token, without an error.


@pytest.mark.parametrize("bad,needle", [
    (CFG.vocab_size, f"max {CFG.vocab_size}"), (CFG.vocab_size + 40, f"max {CFG.vocab_size + 40}"),
    (-1, "min -1")])
@pytest.mark.parametrize("as_jax", [False, True], ids=["numpy", "jax"])
def test_forward_refuses_out_of_range_token_ids(params, bad, needle, as_jax):
  toks = np.stack([_seq(6, 11), _seq(6, 12)]).astype(np.int32)
  mask = np.ones_like(toks, bool)
  mask[1, -2:] = False
  toks[1, -1] = bad  # at a pad position: it would still poison row 1 through 0 * NaN
  toks = jnp.asarray(toks) if as_jax else toks
  with pytest.raises(ValueError, match=rf"tokens ids must lie in \[0, vocab_size={CFG.vocab_size}\)"
                                       rf"; got {needle}"):
    forward(CFG, params, toks, mask=mask)


def test_forward_refuses_non_integer_tokens(params):
  with pytest.raises(ValueError, match="tokens must hold integer token ids, got dtype float32"):
    forward(CFG, params, np.zeros((1, 3), np.float32))


def test_token_logprobs_refuses_out_of_range_targets():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 7)), jnp.float32)
  ok = np.array([[0, 6, 3], [1, 2, 5]])
  assert np.isfinite(np.asarray(token_logprobs(logits, ok))).all()
  with pytest.raises(ValueError, match=r"targets ids must lie in \[0, vocab_size=7\); got max 7"):
    token_logprobs(logits, np.where(ok == 6, 7, ok))


def test_traced_token_ids_are_the_callers_contract(params):
  # Inside jit the check does not run (no per-step device round trip); valid
  # ids give the same logits as the checked entry.
  toks = jnp.asarray(np.stack([_seq(5, 13)]).astype(np.int32))
  jitted = jax.jit(lambda p, t: forward(CFG, p, t).logits)(params, toks)
  ref = forward(CFG, params, toks).logits
  # Two compiled programs may round differently: the forward's float32 bound.
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(ref), atol=f32_atol(ref))
