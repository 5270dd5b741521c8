"""Decoder properties. Parity with `transformers` lives in test_hf.py.

Here: padding invariance (the same sequence left-, right- or un-padded gives
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
  np.testing.assert_allclose(out[0, pad:], alone_a, atol=1e-5)
  np.testing.assert_allclose(out[1, :5], alone_a, atol=1e-5)
  np.testing.assert_allclose(out[2], alone_b, atol=1e-5)
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
                             atol=1e-5)
  assert int(cache.index) == 10
  np.testing.assert_array_equal(np.asarray(cache.mask[:, :10]), np.asarray(mask))


def test_hidden_times_head_is_logits(params):
  toks = jnp.asarray(_seq(6, 5))[None]
  out = forward(CFG, params, toks, return_hidden=True)
  np.testing.assert_allclose(out.hidden @ head_matrix(CFG, params), out.logits, atol=1e-5)
  hidden_only = forward(CFG, params, toks, return_logits=False, return_hidden=True)
  assert hidden_only.logits is None
  np.testing.assert_allclose(hidden_only.hidden, out.hidden, atol=0)


def test_tied_head_and_token_logprobs():
  cfg = CFG.replace(tie_embeddings=True)
  p = init_params(cfg, jax.random.key(1))
  assert "lm_head" not in p
  toks = jnp.asarray(_seq(6, 6))[None]
  out = forward(cfg, p, toks, return_hidden=True)
  np.testing.assert_allclose(out.logits, out.hidden @ p["embedding"].T, atol=1e-5)
  lp = token_logprobs(out.logits, toks, temperature=0.7)
  ref = jax.nn.log_softmax(np.asarray(out.logits, np.float64) / 0.7, axis=-1)
  ref = np.take_along_axis(np.asarray(ref), np.asarray(toks)[..., None], -1)[..., 0]
  np.testing.assert_allclose(lp, ref, atol=1e-5)


def test_scalar_head_reads_last_real_token():
  cfg = CFG.replace(scalar_head=True)
  p = init_params(cfg, jax.random.key(2))
  toks = jnp.asarray(np.stack([_seq(7, 7), _seq(7, 8)]))
  mask = jnp.asarray(np.array([[1] * 5 + [0] * 2, [0] * 3 + [1] * 4], bool))
  out = forward(cfg, p, toks, mask=mask, return_hidden=True)
  expect = out.hidden @ p["value_head"] + p["value_bias"]
  np.testing.assert_allclose(out.values, expect[..., 0], atol=1e-5)
  got = last_token_values(out.values, mask)
  np.testing.assert_allclose(got, [out.values[0, 4], out.values[1, 6]], atol=0)


def test_bf16_compute_keeps_fp32_params():
  cfg = CFG.replace(dtype="bfloat16")
  p = init_params(cfg, jax.random.key(0))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))
  toks = jnp.asarray(_seq(8, 9))[None]
  out = forward(cfg, p, toks, return_hidden=True)
  assert out.hidden.dtype == jnp.bfloat16 and out.logits.dtype == jnp.float32
  ref = forward(CFG, init_params(CFG, jax.random.key(0)), toks).logits
  # bf16 has 8 mantissa bits: logits of size ~0.1 agree to a few 1e-2.
  np.testing.assert_allclose(out.logits, ref, atol=5e-2)


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
    (dict(dtype="float8"), "dtype='float8'"),
    (dict(head_dim=7), "head_dim=7 must be even"),
])
def test_config_errors_name_field_and_value(changes, needle):
  with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
    CFG.replace(**changes)


def test_config_from_dict_rejects_unknown():
  with pytest.raises(ValueError, match="unknown ModelConfig field.*'widht'"):
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
  assert abs(allv.std() - 0.02) < 0.002 and abs(allv.mean()) < 0.002
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
  np.testing.assert_allclose(packed[:4], forward(CFG, params, jnp.asarray(a)[None]).logits[0], atol=1e-5)
  np.testing.assert_allclose(packed[4:], forward(CFG, params, jnp.asarray(b)[None]).logits[0], atol=1e-5)
  with pytest.raises(ValueError, match="segment_ids"):
    forward(CFG, params, toks[:, :2], pos[:, :2], cache=init_cache(CFG, 1, 4), segment_ids=seg[:, :2])
