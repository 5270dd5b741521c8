"""experiments/estimator_noise.py: each estimator's loss and logit gradient against numpy."""
import numpy as np
import jax.numpy as jnp
import pytest

from experiments import estimator_noise as en


def _lsm(a):
  a = a - a.max(-1, keepdims=True)
  return a - np.log(np.exp(a).sum(-1, keepdims=True))


def _kl(z, x):
  lp, lq = _lsm(z), _lsm(x)
  return (np.exp(lp) * (lp - lq)).sum(-1)


def _topk_kl(z, x, k):
  idx = np.argsort(-x, axis=-1)[:, :k]
  zs, xs = np.take_along_axis(z, idx, 1), np.take_along_axis(x, idx, 1)
  return _kl(zs, xs)


def _num_grad(f, z, eps=1e-6):
  """Central differences of sum_t f(z)_t in float64 (each row's loss depends on its own row)."""
  g = np.zeros_like(z)
  for i in range(z.shape[0]):
    for j in range(z.shape[1]):
      zp, zm = z.copy(), z.copy()
      zp[i, j] += eps
      zm[i, j] -= eps
      g[i, j] = (f(zp)[i] - f(zm)[i]) / (2 * eps)
  return g


@pytest.fixture
def case():
  rng = np.random.default_rng(0)
  N, V = 5, 7
  z, x = rng.normal(size=(N, V)) * 1.5, rng.normal(size=(N, V)) * 1.5
  y = rng.integers(0, V, N)
  return z, x, y


def test_full_estimator_is_the_reverse_kl_and_its_gradient(case):
  z, x, y = case
  loss, grad = en.estimator_terms(jnp.asarray(z, jnp.float32), jnp.asarray(x, jnp.float32),
                                  jnp.asarray(y), "full")
  ref = _kl(z, x)
  np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6 * ref.max())
  g = _num_grad(lambda a: _kl(a, x), z)
  np.testing.assert_allclose(grad, g, atol=1e-5 * np.abs(g).max())


def test_top_k_estimator_renormalises_on_the_teachers_top_k(case):
  z, x, y = case
  loss, grad = en.estimator_terms(jnp.asarray(z, jnp.float32), jnp.asarray(x, jnp.float32),
                                  jnp.asarray(y), "top_k", top_k=3)
  ref = _topk_kl(z, x, 3)
  np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6 * ref.max())
  g = _num_grad(lambda a: _topk_kl(a, x, 3), z)
  np.testing.assert_allclose(grad, g, atol=1e-5 * np.abs(g).max())
  # Outside the teacher's top 3 the gradient is exactly zero.
  top = np.argsort(-x, axis=-1)[:, :3]
  outside = np.ones_like(z, bool)
  np.put_along_axis(outside, top, False, 1)
  assert np.all(np.asarray(grad)[outside] == 0)


def test_token_estimator_is_unbiased_for_the_full_gradient(case):
  # Σ_y p(y) · a(y) (onehot(y) − p) = ∇_z KL(p ‖ q): the expectation over the
  # sampled token, enumerated in numpy, equals the exact gradient.
  z, x, _ = case
  N, V = z.shape
  zj, xj = jnp.asarray(z, jnp.float32), jnp.asarray(x, jnp.float32)
  p = np.exp(_lsm(z))
  expect = np.zeros_like(z)
  for v in range(V):
    loss, grad = en.estimator_terms(zj, xj, jnp.full((N,), v), "token")
    np.testing.assert_allclose(loss, _lsm(z)[:, v] - _lsm(x)[:, v], rtol=1e-5, atol=1e-5)
    expect += p[:, v:v + 1] * np.asarray(grad, np.float64)
  g = _num_grad(lambda a: _kl(a, x), z)
  np.testing.assert_allclose(expect, g, atol=1e-5 * np.abs(g).max())


def test_batch_comparison_against_numpy(case):
  z, x, y = case
  out = en.batch_comparison(jnp.asarray(z, jnp.float32), jnp.asarray(x, jnp.float32),
                            jnp.asarray(y), top_ks=(3, 7))
  assert set(out) == {"full", "top_3", "top_7", "token"}
  # k = V keeps every token: top-V is the full estimator.
  assert out["top_7"]["cos"] == pytest.approx(1.0, abs=1e-6)
  assert out["top_7"]["loss_gap"] == pytest.approx(0.0, abs=1e-5)
  assert out["full"]["cos"] == pytest.approx(1.0, abs=1e-6)
  assert out["full"]["rel_err"] == pytest.approx(0.0, abs=1e-6)
  lp, lq = _lsm(z), _lsm(x)
  p = np.exp(lp)
  gf = p * (lp - lq - _kl(z, x)[:, None]) / len(y)
  a = lp[np.arange(len(y)), y] - lq[np.arange(len(y)), y]
  gt = a[:, None] * (np.eye(z.shape[1])[y] - p) / len(y)
  cos = (gt * gf).sum() / np.linalg.norm(gt) / np.linalg.norm(gf)
  assert out["token"]["cos"] == pytest.approx(cos, rel=1e-4)
  assert out["token"]["rel_err"] == pytest.approx(np.linalg.norm(gt - gf) / np.linalg.norm(gf),
                                                  rel=1e-4)
  assert out["token"]["loss_gap"] == pytest.approx((a.mean() - _kl(z, x).mean())
                                                   / _kl(z, x).mean(), rel=1e-4)


def test_summarize_against_numpy():
  rng = np.random.default_rng(1)
  full = rng.uniform(0.5, 1.5, 6)
  tok = full + rng.normal(0, 0.3, 6)
  batches = [{"full": {"loss": f, "cos": 1.0, "rel_err": 0.0},
              "token": {"loss": t, "cos": c, "rel_err": r}}
             for f, t, c, r in zip(full, tok, rng.uniform(0, 1, 6), rng.uniform(1, 3, 6))]
  s = en.summarize(batches)
  assert s["full"]["own_noise_pct"] == 0
  assert s["token"]["fluctuation_pct"] == pytest.approx(100 * tok.std(ddof=1) / tok.mean())
  assert s["token"]["own_noise_pct"] == pytest.approx(100 * (tok - full).std(ddof=1)
                                                      / full.mean())
  assert s["token"]["loss_gap_pct"] == pytest.approx(100 * (tok.mean() - full.mean())
                                                     / full.mean())
  assert s["token"]["cos_min"] == min(b["token"]["cos"] for b in batches)
  with pytest.raises(ValueError, match="2 batches"):
    en.summarize(batches[:1])


def test_bad_estimator_and_k_are_refused(case):
  z, x, y = (jnp.asarray(a) for a in case)
  with pytest.raises(ValueError, match="estimator='topk'"):
    en.estimator_terms(z, x, y, "topk")
  with pytest.raises(ValueError, match="top_k=8"):
    en.estimator_terms(z, x, y, "top_k", top_k=8)
