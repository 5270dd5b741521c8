"""Properties of the fused reverse KL, finite differences and bad input.

Each property runs on the chunked path and on the Pallas tiled layout in
interpret mode (where it is a compile per case, one shared small shape).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kl_problems as kp
from pallas_kernels import BlockSizes, ChunkSizes, fused_reverse_kl, tile_math
from pallas_kernels import api, reference

IMPLS = {
    "chunked": ChunkSizes(block_v=256),
    "pallas": BlockSizes(block_t=8, block_v=128, layout="tiled"),
}
T, V, K, TAU = 7, 300, 2, 0.7   # V=300: ragged last tile for both block sizes


def _loss_and_grads(impl, p, cot=None):
  """(loss [T], (dh_s, dW_s)) of Σ cot·loss, all arrays as jit arguments."""
  cot = jnp.ones((p.h_s.shape[0],)) if cot is None else cot

  def obj(h_s, w_s, h_k, w_k, weights, mask):
    loss = fused_reverse_kl(h_s, w_s, h_k, w_k, weights, mask, TAU, impl=impl,
                            block_sizes=IMPLS.get(impl))
    return jnp.sum(cot * loss), loss
  run = jax.jit(jax.value_and_grad(obj, argnums=(0, 1), has_aux=True),
                compiler_options=kp.FAST_COMPILE)
  (_, loss), grads = run(p.h_s, p.w_s, p.h_k, p.w_k, p.weights, p.mask)
  return loss, grads


@pytest.mark.parametrize("impl", IMPLS)
def test_student_equal_to_teacher_gives_zero_loss_and_gradient(impl):
  p = kp.make_problem(T, V, K, with_mask=False)
  # Every teacher is the student itself (as hidden states and head).
  p.h_k, p.w_k = [p.h_s] * K, [p.w_s] * K
  loss, (dh, dw) = _loss_and_grads(impl, p)
  # KL(p||p) = E_p[z - z] - lse + lse: what is left is float32 rounding of
  # O(z_max) terms (kl_problems.tolerances); the gradient's terms are
  # p*(logit differences), O(1) on this problem, so their rounding is
  # grad_rtol in absolute terms.
  atol, grad_rtol = kp.tolerances(p, TAU, jnp.float32)
  assert np.abs(kp.f64(loss)).max() <= atol
  assert np.abs(kp.f64(dh)).max() <= grad_rtol and np.abs(kp.f64(dw)).max() <= grad_rtol


@pytest.mark.parametrize("impl", IMPLS)
def test_fd_gradient_matches_float64_oracle(impl):
  """Directional derivatives of the kernel's gradient vs central differences
  of the float64 numpy oracle (mask, zero weights, τ and aux all included)."""
  p = kp.make_problem(T, V, K, with_mask=True, seed=3)

  def fn(*args):
    return fused_reverse_kl(*args, temperature=TAU, impl=impl, block_sizes=IMPLS[impl],
                            return_aux=True)
  (obj, _), (dh, dw) = kp.objective_and_grads(fn, p)
  atol, grad_rtol = kp.tolerances(p, TAU, jnp.float32)
  # The objective is a sum of c * value over all outputs, each within atol.
  c_l1 = sum(np.abs(kp.f64(c)).sum() for c in p.cot)
  assert abs(float(obj) - kp.np_objective(p, TAU)) < atol * c_l1
  rng = np.random.default_rng(0)
  for grad, which in ((dh, "h"), (dw, "w")):
    base = kp.f64(p.h_s if which == "h" else p.w_s)
    for _ in range(2):
      d = rng.normal(size=base.shape)
      eps = 1e-5
      args = lambda s: {"h_s": base + s * d} if which == "h" else {"w_s": base + s * d}
      fd = (kp.np_objective(p, TAU, **args(eps)) - kp.np_objective(p, TAU, **args(-eps))) / (2 * eps)
      an = float((kp.f64(grad) * d).sum())
      # |sum(dg * d)| <= max|dg| * ||d||_1 and max|dg| <= grad_rtol * max|g|;
      # the float64 central difference is exact to ~1e-10 (h^2 times the third
      # derivative, plus eps64 * |f| / h), far below that.
      bound = grad_rtol * np.abs(kp.f64(grad)).max() * np.abs(d).sum()
      assert abs(an - fd) <= bound, (which, an, fd, bound)


def test_oracle_gradient_matches_finite_differences():
  """The analytic float64 oracle gradient (used by the chunked / Pallas grid
  tests) against central differences of the float64 oracle objective."""
  p = kp.make_problem(T, V, 3, with_mask=True, seed=4)
  dh, dw = kp.np_objective_grads(p, TAU)
  rng = np.random.default_rng(1)
  for grad, which in ((dh, "h_s"), (dw, "w_s")):
    base = kp.f64(getattr(p, which))
    for _ in range(3):
      d = rng.normal(size=base.shape)
      eps = 1e-6
      fd = (kp.np_objective(p, TAU, **{which: base + eps * d})
            - kp.np_objective(p, TAU, **{which: base - eps * d})) / (2 * eps)
      assert abs(float((grad * d).sum()) - fd) <= 1e-6 * max(1.0, abs(fd))


@pytest.mark.parametrize("impl", IMPLS)
def test_absent_tokens_give_exact_zero_and_no_nan(impl):
  """Masked tokens and all-zero weights: loss exactly 0 and their rows of
  dh_s exactly 0; loss ≥ 0 elsewhere; large logits (scale 40) stay finite."""
  p = kp.make_problem(T, V, K, with_mask=True, seed=5, scale=40.0)
  loss, (dh, dw) = _loss_and_grads(impl, p)
  absent = ~np.asarray(p.mask) | (kp.f64(p.weights).sum(1) == 0)
  assert absent.sum() >= 2
  assert (kp.f64(loss)[absent] == 0).all()
  assert (kp.f64(dh)[absent] == 0).all()
  atol, _ = kp.tolerances(p, TAU, jnp.float32)  # z_max ~ 300 here: atol ~ 2e-3
  assert (kp.f64(loss) >= -atol).all()
  assert np.isfinite(kp.f64(dh)).all() and np.isfinite(kp.f64(dw)).all()
  np.testing.assert_allclose(kp.f64(loss), kp.np_reverse_kl(p, TAU)[0], rtol=0, atol=atol)


def test_one_hot_weights_equal_single_teacher_call():
  p = kp.make_problem(T, V, 3, with_mask=False, seed=7)
  one_hot = jnp.zeros((T, 3)).at[:, 1].set(2.5)

  @jax.jit
  def both(h_s, w_s, h_k, w_k):
    multi = fused_reverse_kl(h_s, w_s, h_k, w_k, one_hot, None, TAU, impl="chunked")
    single = fused_reverse_kl(h_s, w_s, h_k[1:2], w_k[1:2], jnp.ones((T, 1)), None, TAU,
                              impl="chunked")
    return multi, single
  multi, single = both(p.h_s, p.w_s, p.h_k, p.w_k)
  # Each within atol of the same true loss (kl_problems.tolerances).
  np.testing.assert_allclose(multi, single, rtol=0, atol=2 * kp.tolerances(p, TAU, jnp.float32)[0])


def test_stacked_and_sequence_teachers_agree_and_teachers_get_no_gradient():
  p = kp.make_problem(T, V, 2, with_mask=False, seed=9)
  h_k = [p.h_k[0][:, :16], p.h_k[1]]          # both width 16 -> stackable
  w_k = [p.w_k[0][:16], p.w_k[1]]

  @jax.jit
  def run(h_s, w_s, h_k, w_k, weights):
    seq = fused_reverse_kl(h_s, w_s, h_k, w_k, weights, impl="chunked")
    loss = lambda h, w, wt: fused_reverse_kl(h_s, w_s, h, w, wt, impl="chunked").sum()
    stacked, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(
        jnp.stack(h_k), jnp.stack(w_k), weights)
    return seq, stacked, grads
  seq, stacked, (g_h, g_w, g_wt) = run(p.h_s, p.w_s, h_k, w_k, p.weights)
  # Two sums of T per-token losses, each loss within atol of the truth.
  np.testing.assert_allclose(seq.sum(), stacked, rtol=0, atol=2 * T * kp.tolerances(p, TAU, jnp.float32)[0])
  assert not np.any(kp.f64(g_h)) and not np.any(kp.f64(g_w)) and not np.any(kp.f64(g_wt))


def test_merge_stats_is_exact_with_an_empty_partition():
  p = kp.make_problem(T, V, 2, with_mask=False)
  stats = jax.jit(reference.vocab_stats_reference, static_argnums=4)
  full = stats(p.h_s, p.w_s, p.h_k, p.w_k, TAU)
  cuts = [(0, 100), (100, 100), (100, 300)]   # the middle partition is empty
  parts = []
  for a, b in cuts:
    if a == b:  # what an empty kernel split finalises to
      acc = tile_math.acc_init(T, 2)
      lse, ent, e_k, lse_k = tile_math.acc_finalize(acc)
      parts.append(tile_math.stats_from_columns(lse, ent, e_k, lse_k, 2))
    else:
      parts.append(stats(p.h_s, p.w_s[:, a:b], p.h_k, [w[:, a:b] for w in p.w_k], TAU))
  merged = jax.jit(tile_math.merge_stats)(jax.tree.map(lambda *xs: jnp.stack(xs), *parts))
  atol, _ = kp.tolerances(p, TAU, jnp.float32)
  for got, want in zip(merged, full):
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def test_auto_picks_chunked_on_cpu():
  assert api.resolve_impl("auto") == "chunked"


def test_bad_weight_under_jit_gives_nan_not_a_silent_value():
  p = kp.make_problem(T, V, 2, with_mask=False)
  weights = p.weights.at[4, 0].set(-1.0)
  loss = jax.jit(lambda w: fused_reverse_kl(p.h_s, p.w_s, p.h_k, p.w_k, w, impl="chunked"))(weights)
  loss = kp.f64(loss)
  assert np.isnan(loss[4]) and np.isfinite(np.delete(loss, 4)).all()


def _bad_cases():
  p = kp.make_problem(T, V, 2, with_mask=True)
  ok = dict(student_hidden=p.h_s, student_head=p.w_s, teacher_hidden=p.h_k, teacher_heads=p.w_k,
            teacher_weights=p.weights, mask=p.mask)
  nan_h = p.h_s.at[2, 3].set(jnp.nan)
  inf_t = p.h_k[1].at[0, 0].set(jnp.inf)
  return {
      "vocab_differs": (dict(ok, teacher_heads=[p.w_k[0], p.w_k[1][:, :-1]]), "vocabulary V differs"),
      "student_width": (dict(ok, student_head=p.w_s[:-1]), "hidden width Ds differs"),
      "teacher_width": (dict(ok, teacher_heads=[p.w_k[0][:-1], p.w_k[1]]), "hidden width Dt"),
      "teacher_T": (dict(ok, teacher_hidden=[p.h_k[0][:-1], p.h_k[1]]), "T differs"),
      "weights_T": (dict(ok, teacher_weights=p.weights[:-1]), r"teacher_weights.shape=\(6, 2\)"),
      "mask_T": (dict(ok, mask=p.mask[:-1]), r"mask.shape=\(6,\)"),
      "K_heads": (dict(ok, teacher_heads=p.w_k[:1]), "K=2 teachers but teacher_heads has K=1"),
      "K_weights": (dict(ok, teacher_weights=p.weights[:, :1]), r"expected \[T, K\]"),
      "negative_weight": (dict(ok, teacher_weights=p.weights.at[3, 1].set(-0.5)), r"\(3, 1\)\]=-0.5"),
      "nan_weight": (dict(ok, teacher_weights=p.weights.at[0, 0].set(jnp.nan)), "finite and >= 0"),
      "nan_student_hidden": (dict(ok, student_hidden=nan_h), r"student_hidden .* non-finite"),
      "inf_teacher_hidden": (dict(ok, teacher_hidden=[p.h_k[0], inf_t]), r"teacher_hidden\[1\]"),
      "temperature": (dict(ok, temperature=0.0), "temperature"),
      "impl": (dict(ok, impl="triton"), "impl="),
  }


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_bad_input_raises_value_error(name):
  kwargs, match = _bad_cases()[name]
  with pytest.raises(ValueError, match=match):
    fused_reverse_kl(**kwargs)
