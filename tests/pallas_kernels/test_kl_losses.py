"""Companion losses (CE, forward KL, JSD(β), top-k KL, token-level estimator).

Values against float64 numpy oracles written from the definitions below;
gradients against the materialised jnp references (autodiff). One shape with
a ragged last vocabulary tile (V=1000, block 128), teachers of different
widths, a mask, zero weights and τ = 0.7.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kl_problems as kp
from pallas_kernels import ChunkSizes, fused_reverse_kl, losses

T, V, K, TAU, BETA, TOP_K = 7, 1000, 2, 0.7, 0.3, 5
CHUNK = ChunkSizes(block_v=128)


def _np_logprobs(p):
  lp = kp.np_log_softmax(kp.np_logits(p.h_s, p.w_s, TAU))
  lqs = [kp.np_log_softmax(kp.np_logits(h, w, TAU)) for h, w in zip(p.h_k, p.w_k)]
  return lp, lqs


def _np_weighted(p, per_teacher):
  out = (kp.np_weights(p.weights, p.mask) * np.stack(per_teacher, axis=1)).sum(1)
  return out * np.asarray(p.mask)


def np_cross_entropy(p, ids):
  lp, _ = _np_logprobs(p)
  return -lp[np.arange(T), ids] * np.asarray(p.mask)


def np_forward_kl(p, ids):
  lp, lqs = _np_logprobs(p)
  return _np_weighted(p, [(np.exp(lq) * (lq - lp)).sum(1) for lq in lqs])


def np_jsd(p, ids):
  lp, lqs = _np_logprobs(p)
  out = []
  for lq in lqs:
    m = BETA * np.exp(lq) + (1 - BETA) * np.exp(lp)
    out.append(BETA * (np.exp(lq) * (lq - np.log(m))).sum(1)
               + (1 - BETA) * (np.exp(lp) * (lp - np.log(m))).sum(1))
  return _np_weighted(p, out)


def np_topk_kl(p, ids):
  out = []
  z = kp.np_logits(p.h_s, p.w_s, TAU)
  for h, w in zip(p.h_k, p.w_k):
    x = kp.np_logits(h, w, TAU)
    top = np.argsort(-x, axis=1)[:, :TOP_K]
    lp = kp.np_log_softmax(np.take_along_axis(z, top, 1))
    lq = kp.np_log_softmax(np.take_along_axis(x, top, 1))
    out.append((np.exp(lp) * (lp - lq)).sum(1))
  return _np_weighted(p, out)


def np_token_level(p, ids):
  lp, lqs = _np_logprobs(p)
  w_hat = kp.np_weights(p.weights, p.mask)
  rows = np.arange(T)
  est = lp[rows, ids] - sum(w_hat[:, k] * lq[rows, ids] for k, lq in enumerate(lqs))
  return np.where(w_hat.sum(1) > 0, est, 0.0)


LOSSES = {
    "cross_entropy": (lambda a, impl, bs: losses.fused_cross_entropy(
        a[0], a[1], a[6], a[5], TAU, impl=impl, block_sizes=bs), np_cross_entropy),
    "forward_kl": (lambda a, impl, bs: losses.fused_forward_kl(
        *a[:6], TAU, impl=impl, block_sizes=bs), np_forward_kl),
    "jsd": (lambda a, impl, bs: losses.fused_jsd(
        *a[:6], TAU, beta=BETA, impl=impl, block_sizes=bs), np_jsd),
    "topk_kl": (lambda a, impl, bs: losses.fused_topk_kl(
        *a[:6], TAU, top_k=TOP_K, impl=impl, block_sizes=bs), np_topk_kl),
    "token_level": (lambda a, impl, bs: losses.fused_token_level_kl(
        *a[:5], a[6], a[5], TAU, impl=impl, block_sizes=bs), np_token_level),
}


def _value_and_grads(loss_fn, impl, block_sizes, p, ids, cot):
  def obj(h_s, w_s, *rest):
    loss = loss_fn((h_s, w_s, *rest), impl, block_sizes)
    return jnp.sum(cot * loss), loss
  run = jax.jit(jax.value_and_grad(obj, argnums=(0, 1), has_aux=True),
                compiler_options=kp.FAST_COMPILE)
  (_, loss), grads = run(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, p.mask, ids)
  return loss, grads


CASES = [(name, "chunked", CHUNK) for name in LOSSES] + [
    ("cross_entropy", "pallas", None), ("token_level", "pallas", None)]


@pytest.mark.parametrize("name,impl,block_sizes", CASES, ids=[f"{n}_{i}" for n, i, _ in CASES])
def test_loss_matches_oracle_and_reference_gradient(name, impl, block_sizes):
  loss_fn, oracle = LOSSES[name]
  p = kp.make_problem(T, V, K, with_mask=True, seed=13)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, V, size=T), jnp.int32)
  cot = jnp.asarray(np.random.default_rng(1).normal(size=T), jnp.float32)
  loss, grads = _value_and_grads(loss_fn, impl, block_sizes, p, ids, cot)
  _, grads_r = _value_and_grads(loss_fn, "reference", None, p, ids, cot)
  # float32 on both sides: kl_problems.tolerances (from eps, D and the logit
  # scale); two float32 gradients each within grad_rtol of the truth differ by
  # at most twice that.
  atol, grad_rtol = kp.tolerances(p, TAU, jnp.float32)
  np.testing.assert_allclose(kp.f64(loss), oracle(p, np.asarray(ids)), atol=atol, rtol=0)
  for g, g_r in zip(grads, grads_r):
    assert kp.rel_err(g, g_r) < 2 * grad_rtol, (kp.rel_err(g, g_r), grad_rtol)


def test_jsd_endpoints_are_forward_and_reverse_kl():
  p = kp.make_problem(T, V, K, with_mask=True, seed=17)

  @jax.jit
  def run(*args):
    return (losses.fused_jsd(*args, TAU, beta=0.0, block_sizes=CHUNK),
            losses.fused_forward_kl(*args, TAU, block_sizes=CHUNK),
            losses.fused_jsd(*args, TAU, beta=1.0, block_sizes=CHUNK),
            fused_reverse_kl(*args, TAU, impl="chunked", block_sizes=CHUNK))
  jsd0, fkl, jsd1, rkl = run(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, p.mask)
  np.testing.assert_array_equal(jsd0, fkl)
  np.testing.assert_array_equal(jsd1, rkl)


def test_companion_bad_input():
  p = kp.make_problem(T, V, K, with_mask=True)
  base = (p.h_s, p.w_s, p.h_k, p.w_k, p.weights, p.mask)
  with pytest.raises(ValueError, match=r"labels must lie in \[0, V=1000\)"):
    losses.fused_cross_entropy(p.h_s, p.w_s, jnp.full((T,), V, jnp.int32))
  with pytest.raises(ValueError, match=r"labels.shape=\(6,\)"):
    losses.fused_cross_entropy(p.h_s, p.w_s, jnp.zeros((T - 1,), jnp.int32))
  with pytest.raises(ValueError, match="tokens.dtype"):
    losses.fused_token_level_kl(*base[:5], jnp.zeros((T,), jnp.float32))
  with pytest.raises(ValueError, match="top_k"):
    losses.fused_topk_kl(*base, top_k=V + 1)
  with pytest.raises(ValueError, match="beta"):
    losses.fused_jsd(*base, beta=1.5)
  with pytest.raises(ValueError, match="impl='pallas'"):
    losses.fused_forward_kl(*base, impl="pallas")
  with pytest.raises(ValueError, match="vocabulary V differs"):
    losses.fused_forward_kl(p.h_s, p.w_s, p.h_k, [w[:, :-1] for w in p.w_k], p.weights)
