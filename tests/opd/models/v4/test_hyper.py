"""mHC (opd.models.v4.hyper) against transformers' DeepseekV4HyperConnection / HyperHead
and a float64 numpy Sinkhorn."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from opd.models.v4.hyper import HyperConfig, HyperConnection, HyperHead, expand, sinkhorn
from v4_torch import np_, randomize, rel_err, tiny_config

EPS32 = 2.0 ** -23


def np_sinkhorn(m, iters, eps):
  """The projection in float64: columns, then (rows, columns) iters - 1 times."""
  m = np.asarray(m, np.float64)
  m = m / (m.sum(-2, keepdims=True) + eps)
  for _ in range(iters - 1):
    m = m / (m.sum(-1, keepdims=True) + eps)
    m = m / (m.sum(-2, keepdims=True) + eps)
  return m


def _hilbert(x):
  """Hilbert projective distance of a positive vector to the all-ones vector."""
  return float(np.log(x.max() / x.min()))


@pytest.mark.parametrize("iters", [3, 20])
def test_sinkhorn_doubly_stochastic_within_the_iteration_bound(iters):
  # Birkhoff: a positive matrix M with projective diameter
  # Δ = max log(M_ij M_kl / (M_il M_kj)) contracts the Hilbert metric by κ = tanh(Δ/4).
  # Once the columns sum to 1 (M^T 1 = 1), one (row, column) round maps the row
  # sums r to r'' with d(r'', 1) <= κ² d(r, 1) (d(c, 1) = d(M^T(1/r), M^T 1) <= κ d(r, 1),
  # then d(r'', 1) = d(M(1/c), M 1) <= κ d(c, 1)); diagonal scalings keep Δ. So after
  # the first column step and iters - 1 rounds, d(r, 1) <= κ^(2(iters-1)) d(r_1, 1), and
  # since Σ r = N, max |r - 1| <= exp(d) - 1. The columns end within eps of 1. The eps
  # in every divisor moves each sum by <= N·eps per step relative; fp32 rounding adds
  # N ε per sum: both folded into `slack`.
  rng = np.random.default_rng(iters)
  N, eps = 4, 1e-6
  logits = rng.normal(size=(6, N, N)) * 1.5
  m = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True) + eps
  got = np.asarray(sinkhorn(jnp.asarray(m, jnp.float32), iters, eps), np.float64)
  want = np_sinkhorn(m, iters, eps)
  # Each of the 2·iters normalisations divides by a sum of N terms: <= (N + 1) ε relative each.
  assert rel_err(got, want) <= 2 * iters * (N + 1) * EPS32 * 4
  slack = 4 * N * eps + 8 * N * EPS32
  for k in range(m.shape[0]):
    a = m[k]
    delta = np.log(np.max(a[:, None, :, None] * a[None, :, None, :]
                          / (a[:, None, None, :] * a[None, :, :, None])))
    kappa = np.tanh(delta / 4)
    r1 = (a / a.sum(0, keepdims=True)).sum(1)
    bound = np.expm1(kappa ** (2 * (iters - 1)) * _hilbert(r1))
    assert np.max(np.abs(got[k].sum(1) - 1)) <= bound + slack, (k, bound)
    assert np.max(np.abs(got[k].sum(0) - 1)) <= slack
  # The bound is not vacuous at 3 iterations: the rows are not yet within `slack`.
  if iters == 3:
    assert np.max(np.abs(want.sum(-1) - 1)) > slack


def test_sinkhorn_rejects_zero_iterations():
  with pytest.raises(ValueError, match="iters"):
    sinkhorn(jnp.ones((2, 2)), 0, 1e-6)


def _hc_params(mod, prefix_fn, prefix_base, prefix_scale):
  return {"proj": jnp.asarray(np_(prefix_fn).T), "bias": jnp.asarray(np_(prefix_base)),
          "scale": jnp.asarray(np_(prefix_scale)).reshape(-1)}


def test_hyper_connection_and_head_match_transformers():
  # Tolerance: the projection sums N·D = 128 products (<= 128 ε relative), the
  # sigmoid/softmax pass that on scaled by |logit| <= ~3, and the Sinkhorn's 2·20
  # normalisations add <= 40 (N + 1) ε: (3·128 + 200) ε ≈ 7e-5 < 1e-4.
  cfg_hf = tiny_config()
  cfg = HyperConfig(d_model=cfg_hf.hidden_size, n_streams=cfg_hf.hc_mult,
                    sinkhorn_iters=cfg_hf.hc_sinkhorn_iters, eps=cfg_hf.hc_eps,
                    norm_eps=cfg_hf.rms_norm_eps)
  tm = hf.DeepseekV4HyperConnection(cfg_hf)
  randomize(tm, seed=0, std=0.3)
  head = hf.DeepseekV4HyperHead(cfg_hf)
  randomize(head, seed=1, std=0.3)
  rng = np.random.default_rng(0)
  B, T, N, D = 2, 5, cfg.n_streams, cfg.d_model
  h = rng.normal(size=(B, T, N, D)).astype(np.float32)
  y = rng.normal(size=(B, T, D)).astype(np.float32)
  with torch.no_grad():
    post_t, comb_t, coll_t = tm(torch.from_numpy(h))
    # The decoder layer's mixing (DeepseekV4DecoderLayer.forward): post ⊗ y + combᵀ h.
    mixed_t = post_t.unsqueeze(-1) * torch.from_numpy(y).unsqueeze(-2) + torch.matmul(
        comb_t.transpose(-1, -2), torch.from_numpy(h))
    head_t = head(torch.from_numpy(h))
  params = {"params": _hc_params(tm, tm.fn, tm.base, tm.scale)}
  post, comb, coll = HyperConnection(cfg).apply(params, jnp.asarray(h))
  mixed = expand(post, comb, jnp.asarray(y), jnp.asarray(h))
  hp = {"params": _hc_params(head, head.hc_fn, head.hc_base, head.hc_scale)}
  out_head = HyperHead(cfg).apply(hp, jnp.asarray(h))
  errs = {"post": rel_err(post, np_(post_t)), "comb": rel_err(comb, np_(comb_t)),
          "collapsed": rel_err(coll, np_(coll_t)), "expand": rel_err(mixed, np_(mixed_t)),
          "head": rel_err(out_head, np_(head_t))}
  print("mHC parity (max rel err):", errs)
  assert max(errs.values()) <= 1e-4, errs
  # Non-trivial case: the streams get unequal weights and comb is not the uniform matrix.
  assert np.ptp(np.asarray(post)) > 0.1 and np.ptp(np.asarray(comb)) > 0.1


def test_hyper_connection_rejects_wrong_stream_shape():
  cfg = HyperConfig(d_model=8, n_streams=2)
  with pytest.raises(ValueError, match="n_streams=2"):
    HyperConnection(cfg).init(jax.random.key(0), jnp.zeros((1, 3, 3, 8)))
  with pytest.raises(ValueError, match="HyperConfig.n_streams"):
    HyperConfig(d_model=8, n_streams=0)
