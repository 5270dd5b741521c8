"""Gradient-in-forward cross-entropy (pallas_kernels.train_ce) against a float64 oracle.

Loss ``Σ_t c_t (lse(z_t) − z_{t,y_t})``, gradient ``c (p − onehot(y))`` pulled
back through ``z = h W / τ``, both in numpy float64 from the definitions.
Chunk sizes leave a remainder chunk and a remainder tile; some coefficients
are 0 (tokens outside the loss) and one is negative.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kl_problems as kp
from pallas_kernels import fused_cross_entropy
from pallas_kernels.train_ce import fused_cross_entropy_train
from pallas_kernels.train_loss import TrainChunkSizes


def _problem(t, v, dtype, seed):
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(t, kp.DS))
  w = rng.normal(size=(kp.DS, v)) * 2 / np.sqrt(kp.DS)
  labels = rng.integers(0, v, size=t)
  c = rng.uniform(0.5, 1.5, size=t) * (rng.uniform(size=t) < 0.7) / t
  c[0] = -0.3 / t
  cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
  return cast(h), cast(w), jnp.asarray(labels, jnp.int32), c


def _oracle(h, w, labels, c, tau):
  h, w = kp.f64(h), kp.f64(w)
  lp = kp.np_log_softmax(h @ w / tau)
  nll = -lp[np.arange(len(labels)), np.asarray(labels)]
  g = np.exp(lp)
  g[np.arange(len(labels)), np.asarray(labels)] -= 1.0
  g *= c[:, None] / tau
  return float((c * nll).sum()), np.where(c != 0, nll, 0.0), g @ w.T, h.T @ g


# (T, V, τ, block_t, block_v, dtype)
CASES = [(37, 1000, 0.7, 16, 256, jnp.float32), (300, 512, 1.0, 64, 512, jnp.bfloat16)]


@pytest.mark.parametrize("case", CASES, ids=[f"T={c[0]}_V={c[1]}_{jnp.dtype(c[5]).name}"
                                             for c in CASES])
def test_train_ce_matches_oracle_and_per_token_path(case):
  t, v, tau, bt, bv, dtype = case
  h, w, labels, c = _problem(t, v, dtype, seed=t)
  cj = jnp.asarray(c, jnp.float32)

  def train(impl, sizes):
    return lambda h, w: fused_cross_entropy_train(h, w, labels, cj, tau, impl=impl,
                                                  block_sizes=sizes, return_aux=True)

  def per_token(h, w):
    nll = fused_cross_entropy(h, w, labels, cj != 0, tau, impl="chunked")
    return jnp.sum(cj * nll), {"nll": nll}

  fns = (train("reference", None), train("chunked", TrainChunkSizes(bt, bv)), per_token)
  run = jax.jit(lambda h, w: tuple(jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w)
                                   for f in fns), compiler_options=kp.FAST_COMPILE)
  loss_o, nll_o, dh_o, dw_o = _oracle(h, w, labels, c, tau)
  # Each logit is a D-term dot product, off by ~sqrt(D)·eps·z_max; nll = lse −
  # z_y adds a handful of such terms (factor 8, as kl_problems.tolerances).
  # Gradients: relative ~sqrt(D)·eps·z_max (×2), bf16 adds 3u (dz and the
  # two rounded gradients).
  z_max = float(np.abs(kp.f64(h) @ kp.f64(w)).max()) / tau
  atol = 8 * np.sqrt(kp.DS) * kp.EPS32 * z_max
  grad_rtol = 2 * np.sqrt(kp.DS) * kp.EPS32 * z_max + (
      3 * kp.BF16_U if dtype == jnp.bfloat16 else 0.0)
  for (loss, aux), grads in run(h, w):
    np.testing.assert_allclose(float(loss), loss_o, atol=atol * np.abs(c).sum(), rtol=0)
    np.testing.assert_allclose(kp.f64(aux["nll"]), nll_o, atol=atol, rtol=0)
    for g, g_o, x in zip(grads, (dh_o, dw_o), (h, w)):
      assert g.dtype == x.dtype and g.shape == x.shape
      assert kp.rel_err(g, g_o) < grad_rtol, (kp.rel_err(g, g_o), grad_rtol)
  (_, _), (dh, _) = run(h, w)[1]
  assert np.all(kp.f64(dh)[c == 0] == 0)  # outside the loss: exactly no gradient


def test_train_ce_cotangent_scaling():
  h, w, labels, c = _problem(9, 300, jnp.float32, seed=1)
  f = lambda h, w: fused_cross_entropy_train(h, w, labels, c, impl="chunked",
                                             block_sizes=TrainChunkSizes(4, 128))
  g1 = jax.grad(f, argnums=(0, 1))(h, w)
  g3 = jax.grad(lambda h, w: 3.0 * f(h, w), argnums=(0, 1))(h, w)
  for a, b in zip(g1, g3):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a * 3.0))  # one multiply by 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(labels=np.full(6, 128)), r"labels must lie in \[0, V=128\)"),
    (dict(coef=np.ones(4)), r"coef.shape=\(4,\)"),
    (dict(coef=np.array([0, 0, np.nan, 0, 0, 0])), r"coef\[2\]=nan"),
    (dict(impl="pallas"), r"impl='pallas'"),
    (dict(impl="chunked", block_sizes=object()), r"TrainChunkSizes"),
])
def test_train_ce_bad_input_raises(kwargs, match):
  h, w, _, _ = _problem(6, 128, jnp.float32, seed=0)
  args = dict(labels=np.zeros(6, np.int32), coef=np.full(6, 1 / 6))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    fused_cross_entropy_train(h, w, **args)
