"""Teacher weights [B, T, K] against numpy references (opd.distill.teacher_weighting)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from opd.distill import teacher_weighting

EPS32 = np.finfo(np.float32).eps


def _softmax(x, axis=-1):
  e = np.exp(x - x.max(axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def test_routing_puts_weight_only_on_the_domain_teacher():
  teacher_domains = ["math", "code", None, "code"]
  domains = ["code", "math", "math", "code"]
  w = np.asarray(teacher_weighting.routing_weights(domains, teacher_domains, t=5))
  assert w.shape == (4, 5, 4)
  for b, dom in enumerate(domains):
    hits = [k for k, d in enumerate(teacher_domains) if d == dom]
    expect = np.zeros(4)
    expect[hits] = 1.0 / len(hits)
    np.testing.assert_array_equal(w[b], np.broadcast_to(expect, (5, 4)))


def test_routing_unknown_domain_names_it():
  with pytest.raises(ValueError, match=r"domains\[1\]='poetry'.*\['math', 'code'\]"):
    teacher_weighting.routing_weights(["math", "poetry"], ["math", "code"], t=3)


def test_uniform_and_bad_sizes():
  np.testing.assert_array_equal(teacher_weighting.uniform_weights(2, 3, 4),
                                np.full((2, 3, 4), 0.25))
  with pytest.raises(ValueError, match="K=0"):
    teacher_weighting.uniform_weights(2, 3, 0)


@pytest.mark.parametrize("per", ["sequence", "token"])
def test_confidence_weights_match_numpy(per):
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(3, 6, 4)).astype(np.float32)
  mask = rng.random((3, 6)) < 0.6
  mask[:, 0] = True
  temp = 0.7
  got = np.asarray(teacher_weighting.confidence_weights(jnp.asarray(scores), jnp.asarray(mask),
                                               temperature=temp, per=per))
  s = scores.astype(np.float64)
  if per == "sequence":
    mean = np.stack([s[b][mask[b]].mean(0) for b in range(3)])  # [B, K]
    expect = np.broadcast_to(_softmax(mean / temp)[:, None, :], s.shape)
  else:
    expect = _softmax(s / temp)
  # softmax of O(1) scores: a few float32 roundings per entry.
  np.testing.assert_allclose(got, expect, rtol=0, atol=16 * EPS32)


def test_confidence_scores_match_materialised_logits():
  rng = np.random.default_rng(1)
  b, t, v, tau = 2, 5, 40, 1.3
  hid = [rng.normal(size=(b, t, d)).astype(np.float32) for d in (6, 10)]
  heads = [rng.normal(size=(d, v)).astype(np.float32) for d in (6, 10)]
  targets = rng.integers(0, v, size=(b, t))
  lp = []
  ent = []
  for h, w in zip(hid, heads):
    z = (h.astype(np.float64) @ w) / tau
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(
        -1, keepdims=True)
    lp.append(np.take_along_axis(logp, targets[..., None], -1)[..., 0])
    ent.append(-(np.exp(logp) * logp).sum(-1))
  args = ([jnp.asarray(h) for h in hid], [jnp.asarray(w) for w in heads], jnp.asarray(targets))
  got_lp = teacher_weighting.confidence_scores(*args, score="logprob", temperature=tau,
                                               impl="chunked")
  got_ne = teacher_weighting.confidence_scores(*args, score="neg_entropy", temperature=tau,
                                               impl="chunked")
  # |logits| ~ sqrt(D) * 3 / tau; a log-softmax over V=40 of them in float32.
  tol = 64 * EPS32 * np.log(v) * max(np.abs(h @ w).max() for h, w in zip(hid, heads))
  np.testing.assert_allclose(got_lp, np.stack(lp, -1), rtol=0, atol=tol)
  np.testing.assert_allclose(got_ne, -np.stack(ent, -1), rtol=0, atol=tol)


def test_anneal_is_linear_and_exactly_uniform_at_the_last_step():
  rng = np.random.default_rng(2)
  w = rng.random((2, 3, 4)).astype(np.float32) + 0.1
  w_hat = w / w.sum(-1, keepdims=True)
  total, n = 10, 4
  for step in range(total):
    got = np.asarray(teacher_weighting.anneal(jnp.asarray(w), step, total, n))
    alpha = min(max((step - (total - n) + 1) / n, 0.0), 1.0)
    np.testing.assert_allclose(got, (1 - alpha) * w_hat + alpha / 4, rtol=0, atol=4 * EPS32)
  last = np.asarray(teacher_weighting.anneal(jnp.asarray(w), total - 1, total, n))
  np.testing.assert_array_equal(last, np.full_like(last, 0.25))
  # Before the window the weights are the (renormalised) schedule.
  np.testing.assert_allclose(teacher_weighting.anneal(jnp.asarray(w), total - n - 1, total, n),
                             w_hat, rtol=0, atol=4 * EPS32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(step=-1, total_steps=5, anneal_steps=2), "step=-1"),
    (dict(step=0, total_steps=5, anneal_steps=6), "anneal_steps=6 exceeds total_steps=5"),
])
def test_anneal_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    teacher_weighting.anneal(jnp.ones((1, 1, 2)), **kwargs)


def test_normalize_rejects_weights_without_positive_sum():
  w = np.ones((2, 3, 2), np.float32)
  w[1, 2] = 0.0
  with pytest.raises(ValueError, match=r"weights\[\(1, 2\)\] sum to 0.0"):
    teacher_weighting.normalize(jnp.asarray(w))
  w[1, 2] = [-1.0, 2.0]
  with pytest.raises(ValueError, match=r"weights\[\(1, 2, 0\)\]=-1.0"):
    teacher_weighting.normalize(jnp.asarray(w))


def test_apply_availability_renormalises_and_masks_empty_rows():
  rng = np.random.default_rng(3)
  w = rng.random((3, 4, 3)).astype(np.float32)
  available = np.array([[True, False, True], [False, False, False], [False, True, False]])
  got, row_ok = teacher_weighting.apply_availability(jnp.asarray(w), jnp.asarray(available))
  expect = np.zeros_like(w)
  for b in range(3):
    keep = np.flatnonzero(available[b])
    if keep.size:
      expect[b][:, keep] = w[b][:, keep] / w[b][:, keep].sum(-1, keepdims=True)
  np.testing.assert_allclose(got, expect, rtol=0, atol=4 * EPS32)
  np.testing.assert_array_equal(row_ok, [True, False, True])


def test_weight_metrics_mean_over_masked_tokens():
  w = np.zeros((1, 3, 2), np.float32)
  w[0, :, 0] = [1.0, 0.0, 0.5]
  w[0, :, 1] = 1 - w[0, :, 0]
  mask = np.array([[True, True, False]])
  got = teacher_weighting.weight_metrics(w, mask, ["a", "b"])
  assert got == {"weight/a": 0.5, "weight/b": 0.5}  # (1 + 0) / 2 and (0 + 1) / 2: exact


def test_confidence_weights_under_jit_sum_to_one():
  scores = jnp.asarray(np.random.default_rng(4).normal(size=(2, 3, 5)), jnp.float32)
  got = jax.jit(lambda s: teacher_weighting.confidence_weights(
      s, jnp.ones((2, 3), bool), per="token"))(scores)
  np.testing.assert_allclose(np.asarray(got).sum(-1), 1.0, rtol=0, atol=8 * EPS32)


def test_anneal_towards_a_target_mixes_the_renormalised_target():
  rng = np.random.default_rng(3)
  w = rng.random((2, 3, 4)).astype(np.float32) + 0.1
  t = rng.random((2, 3, 4)).astype(np.float32) + 0.1
  w_hat, t_hat = w / w.sum(-1, keepdims=True), t / t.sum(-1, keepdims=True)
  total, n = 6, 3
  for step in range(total):
    got = np.asarray(teacher_weighting.anneal(jnp.asarray(w), step, total, n, jnp.asarray(t)))
    alpha = min(max((step - (total - n) + 1) / n, 0.0), 1.0)
    np.testing.assert_allclose(got, (1 - alpha) * w_hat + alpha * t_hat, rtol=0, atol=4 * EPS32)
  with pytest.raises(ValueError, match=r"target shape \(2, 3\) != weights shape \(2, 3, 4\)"):
    teacher_weighting.anneal(jnp.asarray(w), 0, total, n, jnp.ones((2, 3)))
