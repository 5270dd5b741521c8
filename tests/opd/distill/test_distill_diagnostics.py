"""Distillation diagnostics against a plain numpy reference (opd.distill.diagnostics)."""
import numpy as np
import pytest

import jax.numpy as jnp

from opd.distill import logit_diagnostics, sample_response_positions, teacher_diagnostics

EPS32 = np.finfo(np.float32).eps


def _reference(z, x, tokens, rel):
  """One token at a time, with sets and sorts."""
  rows = []
  for zi, xi, y in zip(z.astype(np.float64), x.astype(np.float64), tokens):
    p = np.exp(zi - zi.max())
    p /= p.sum()
    q = np.exp(xi - xi.max())
    q /= q.sum()
    top = lambda a, k: set(np.argsort(-a)[:k].tolist())
    rows.append({
        "overlap@1": len(top(zi, 1) & top(xi, 1)) / 1,
        "overlap@8": len(top(zi, 8) & top(xi, 8)) / 8,
        "teacher_mass@8": sum(q[i] for i in top(zi, 8)),
        "student_mass@8": sum(p[i] for i in top(xi, 8)),
        "rkl": float(np.sum(p * (np.log(p) - np.log(q)))),
        "gap": float(-np.sum(q * np.log(q)) + np.sum(p * np.log(p))),
        "ent": float(-np.sum(p * np.log(p))),
        "argmax_match": float(np.argmax(xi) == y),
    })

  def mean(key, sel=None):
    sel = np.ones(len(rows), bool) if sel is None else sel
    return float(np.mean([r[key] for r, s in zip(rows, sel) if s]))

  out = {k: mean(k) for k in ("overlap@1", "overlap@8", "teacher_mass@8", "student_mass@8",
                              "argmax_match")}
  out.update(rkl=mean("rkl"), entropy_gap=mean("gap"), student_entropy=mean("ent"),
             rkl_first=mean("rkl", rel < 0.25),
             rkl_middle=mean("rkl", (rel >= 0.25) & (rel < 0.75)),
             rkl_last=mean("rkl", rel >= 0.75))
  return out


def test_logit_diagnostics_match_numpy():
  rng = np.random.default_rng(0)
  n, v, tau = 64, 50, 0.8
  z = rng.normal(size=(n, v)).astype(np.float32) * 2
  # A teacher that agrees with the student in part, so overlaps are neither 0 nor 1.
  x = (0.6 * z + rng.normal(size=(n, v)) * 1.5).astype(np.float32)
  tokens = np.where(rng.random(n) < 0.5, np.argmax(x, -1), rng.integers(0, v, n))
  rel = rng.random(n)
  got = logit_diagnostics(z, x, tokens, rel, temperature=tau)
  want = _reference(z / tau, x / tau, tokens, rel)
  assert set(got) == set(want)
  # Means of n softmax-based terms over V in float32: eps x log V x |logit| scale.
  tol = 32 * EPS32 * np.log(v) * float(np.abs(z / tau).max() + np.abs(x / tau).max())
  for k in want:
    assert got[k] == pytest.approx(want[k], abs=tol), k
  assert 0 < got["overlap@8"] < 1 and 0 < got["argmax_match"] < 1


def test_sample_response_positions_relative_positions():
  loss_mask = np.zeros((3, 10))
  loss_mask[0, 2:6] = 1  # 4 response tokens
  loss_mask[1, 5:10] = 1  # 5
  loss_mask[2, 1:3] = 1  # 2
  idx, rel = sample_response_positions(loss_mask, 100, seed=1)
  expect = {}
  for b in range(3):
    cols = np.flatnonzero(loss_mask[b])
    for i, c in enumerate(cols):
      expect[b * 10 + c] = i / len(cols)
  assert sorted(idx.tolist()) == sorted(expect)
  np.testing.assert_allclose(rel, [expect[i] for i in idx], rtol=0, atol=0)
  idx4, _ = sample_response_positions(loss_mask, 4, seed=1)
  assert len(set(idx4.tolist())) == 4 and set(idx4.tolist()) <= set(expect)
  with pytest.raises(ValueError, match="n=0"):
    sample_response_positions(loss_mask, 0)


def test_teacher_diagnostics_from_hidden_states():
  rng = np.random.default_rng(2)
  b, t, v = 2, 12, 40
  h_s = rng.normal(size=(b, t, 6)).astype(np.float32)
  w_s = rng.normal(size=(6, v)).astype(np.float32)
  h_k = [rng.normal(size=(b, t, d)).astype(np.float32) for d in (4, 9)]
  w_k = [rng.normal(size=(d, v)).astype(np.float32) for d in (4, 9)]
  targets = rng.integers(0, v, (b, t))
  loss_mask = np.zeros((b, t))
  loss_mask[:, 4:] = 1  # 8 response tokens: r = 2/8 and 6/8 sit on the segment boundaries
  got = teacher_diagnostics(jnp.asarray(h_s), w_s, h_k, w_k, ["a", "b"], targets, loss_mask, n=16)
  idx, rel = sample_response_positions(loss_mask, 16, seed=0)
  assert {0.25, 0.75} <= set(rel.tolist())
  z = h_s.reshape(-1, 6)[idx] @ w_s
  for name, h, w in zip(["a", "b"], h_k, w_k):
    x = h.reshape(-1, h.shape[-1])[idx] @ w
    want = _reference(z, x, targets.reshape(-1)[idx], rel)
    tol = 32 * EPS32 * np.log(v) * float(np.abs(z).max() + np.abs(x).max())
    for k, val in want.items():
      assert got[f"diag/{name}/{k}"] == pytest.approx(val, abs=tol, nan_ok=True), (name, k)
