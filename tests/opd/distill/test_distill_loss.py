"""The OPD loss (opd.distill.loss) against a numpy reference on materialised logits.

Models are tiny (V=128, student D=32 x 2 layers, teacher D=48 x 1 layer);
the LM heads are scaled up so that logits are O(1) and the teachers differ
visibly from the student (at init std 0.02 every distribution is nearly
uniform and every KL nearly 0, which would let wrong code pass).
"""
import functools

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels

from opd.distill import loss as loss_lib
from opd.distill import teacher_weighting
from opd.models import ModelConfig, forward, head_matrix, init_params
from opd.parallel import sharding
from opd.training.train_step import init_train_state, make_train_step

EPS32 = np.finfo(np.float32).eps
V, B, T = 128, 4, 12
STUDENT = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
WIDE = ModelConfig(vocab_size=V, d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=96)


def _model(cfg, seed, head_scale=40.0):
  p = init_params(cfg, jax.random.key(seed))
  return {**p, "lm_head": p["lm_head"] * head_scale}


@functools.partial(jax.jit, static_argnames=("cfg", "grad"))
def _run(params, batch, heads, cfg=loss_lib.OPDLossConfig(), grad=False):
  """(loss, metrics, grads or None); one compile per (K, widths, cfg, grad)."""
  fn = loss_lib.make_opd_loss(STUDENT, heads, cfg)
  if not grad:
    return (*fn(params, batch, None), None)
  (loss, metrics), grads = jax.value_and_grad(fn, has_aux=True)(params, batch, None)
  return loss, metrics, grads


def _hidden(cfg, params, tokens, mask):
  return forward(cfg, params, tokens, None, mask, return_logits=False, return_hidden=True).hidden


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, size=(B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[1, 9:] = False  # a shorter row
  loss_mask = np.zeros((B, T), np.float32)
  loss_mask[:, 4:] = 1.0  # the prompt is 5 tokens; targets 4.. are response tokens
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
           "loss_mask": loss_mask * mask}
  student = _model(STUDENT, 0)
  teachers = [(STUDENT, _model(STUDENT, 1)), (WIDE, _model(WIDE, 2)), (STUDENT, _model(STUDENT, 3))]
  hidden = [_hidden(c, p, batch["tokens"], mask) for c, p in teachers]
  heads = [head_matrix(c, p) for c, p in teachers]
  weights = rng.random((B, T, 3)).astype(np.float32)
  return dict(batch=batch, student=student, hidden=hidden, heads=heads, weights=weights)


def _log_softmax(z):
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _reference(setup, weights, keep, tau, top_k=None, teacher_tau=1.0):
  """Per-token reverse KL, forward KL, token estimate and top-k KL in float64 numpy
  (teacher logits divided by ``tau * teacher_tau``, the student's by ``tau``)."""
  h_s = np.asarray(_hidden(STUDENT, setup["student"], setup["batch"]["tokens"],
                           setup["batch"]["mask"]), np.float64)
  lp = _log_softmax(h_s @ np.asarray(head_matrix(STUDENT, setup["student"]), np.float64) / tau)
  w = np.where(keep[..., None], weights, 0.0).astype(np.float64)
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
  y = setup["batch"]["targets"][..., None]
  rkl = fkl = topk = 0.0
  per_teacher = []
  token = np.take_along_axis(lp, y, -1)[..., 0]
  for k, (h, hd) in enumerate(zip(setup["hidden"], setup["heads"])):
    x = np.asarray(h, np.float64) @ np.asarray(hd, np.float64) / (tau * teacher_tau)
    lq = _log_softmax(x)
    per_teacher.append((np.exp(lp) * (lp - lq)).sum(-1))
    rkl = rkl + w[..., k] * per_teacher[-1]
    fkl = fkl + w[..., k] * (np.exp(lq) * (lq - lp)).sum(-1)
    token = token - w[..., k] * np.take_along_axis(lq, y, -1)[..., 0]
    if top_k:
      idx = np.argsort(-x, -1)[..., :top_k]
      lp_t = _log_softmax(np.take_along_axis(lp, idx, -1))
      lq_t = _log_softmax(np.take_along_axis(lq, idx, -1))
      topk = topk + w[..., k] * (np.exp(lp_t) * (lp_t - lq_t)).sum(-1)
  return rkl, fkl, token, topk, lp, per_teacher


def _tol(setup, tau=1.0):
  # float32 cancellation in KL = E_p[z - x] - lse(z) + lse(x): a few eps of the
  # largest |logit| and of log V, per token; a mean over tokens does not grow it.
  zmax = max(float(jnp.abs(h @ w).max()) for h, w in zip(setup["hidden"], setup["heads"]))
  return 64 * EPS32 * (zmax / tau + np.log(V))


def _batch(setup, weights, hidden=None):
  return {**setup["batch"], "teacher_hidden": tuple(hidden or setup["hidden"]),
          "teacher_weights": jnp.asarray(weights)}


def _keep(setup, weights):
  b = setup["batch"]
  return (b["loss_mask"] > 0) & b["mask"] & (np.asarray(weights).sum(-1) > 0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_full_loss_matches_numpy(setup, aggregation):
  weights = setup["weights"].copy()
  weights[2] = 0.0  # a row no teacher answered: out of the mean entirely
  cfg = loss_lib.OPDLossConfig(temperature=1.5, aggregation=aggregation, forward_kl_coef=0.25)
  loss, metrics, _ = _run(setup["student"], _batch(setup, weights), tuple(setup["heads"]), cfg)
  keep = _keep(setup, weights)
  rkl, fkl, _, _, lp, per_teacher = _reference(setup, weights, keep, 1.5)
  per_tok = np.where(keep, rkl + 0.25 * fkl, 0.0)
  if aggregation == "token_mean":
    expect = per_tok.sum() / keep.sum()
  else:
    rows = keep.sum(1) > 0
    expect = (per_tok.sum(1)[rows] / keep.sum(1)[rows]).mean()
  assert abs(float(loss) - expect) <= _tol(setup, 1.5)
  assert float(metrics["opd_tokens"]) == keep.sum()
  assert float(metrics["opd_rows"]) == 3
  ent = -(np.exp(lp) * lp).sum(-1)
  assert abs(float(metrics["student_entropy"]) - ent[keep].mean()) <= _tol(setup, 1.5)
  for k, kl in enumerate(per_teacher):  # over the tokens teacher k weighs
    uses = keep & (weights[..., k] > 0)
    assert abs(float(metrics[f"kl/t{k}"]) - kl[uses].mean()) <= _tol(setup, 1.5)
    assert abs(float(metrics[f"loss/t{k}"]) - kl[uses].mean()) <= _tol(setup, 1.5)


@pytest.mark.parametrize("teacher_tau", [0.5, 2.0])
def test_teacher_temperature_divides_only_the_teachers_logits(setup, teacher_tau):
  """τ_T sharpens (or flattens) the targets: KL(p_s^τ ‖ softmax(x_k / (τ τ_T)))."""
  weights = setup["weights"]
  cfg = loss_lib.OPDLossConfig(temperature=1.5, teacher_temperature=teacher_tau)
  loss, metrics, _ = _run(setup["student"], _batch(setup, weights), tuple(setup["heads"]), cfg)
  keep = _keep(setup, weights)
  rkl, _, _, _, _, per_teacher = _reference(setup, weights, keep, 1.5, teacher_tau=teacher_tau)
  tol = _tol(setup, 1.5 * min(teacher_tau, 1.0))
  assert abs(float(loss) - rkl[keep].mean()) <= tol
  plain, _, _ = _run(setup["student"], _batch(setup, weights), tuple(setup["heads"]),
                     loss_lib.OPDLossConfig(temperature=1.5))
  rkl1, *_ = _reference(setup, weights, keep, 1.5)
  assert abs(rkl[keep].mean() - rkl1[keep].mean()) > 100 * tol  # the option changes the loss
  assert abs(float(plain) - rkl1[keep].mean()) <= tol
  for k, kl in enumerate(per_teacher):
    uses = keep & (weights[..., k] > 0)
    assert abs(float(metrics[f"kl/t{k}"]) - kl[uses].mean()) <= tol


def test_topk_and_token_estimators_match_numpy(setup):
  weights = setup["weights"]
  keep = _keep(setup, weights)
  _, _, token, topk, _, _ = _reference(setup, weights, keep, 1.0, top_k=8)
  # Routing (one teacher per row) makes loss/<teacher> a per-domain curve.
  routed = np.zeros_like(weights)
  routed[np.arange(B), :, np.arange(B) % 3] = 1.0
  for w in (weights, routed):
    keep = _keep(setup, w)
    _, _, token, topk, _, _ = _reference(setup, w, keep, 1.0, top_k=8)
    for est, per_tok in (("top_k", topk), ("token", token)):
      cfg = loss_lib.OPDLossConfig(estimator=est, top_k=8)
      loss, metrics, _ = _run(setup["student"], _batch(setup, w), tuple(setup["heads"]), cfg)
      assert abs(float(loss) - per_tok[keep].mean()) <= _tol(setup), est
      for k in range(3):  # the mean per-token loss over the tokens teacher k weighs
        uses = keep & (w[..., k] > 0)
        assert abs(float(metrics[f"loss/t{k}"]) - per_tok[uses].mean()) <= _tol(setup), (est, k)


def test_token_estimator_gradient_is_the_policy_gradient(setup):
  """grad = mean_t sg(a_t) ∇ log p_s(y_t), a_t = log p_s(y_t) − Σ ŵ log q_k(y_t).

  The values a_t are checked against numpy above; here they are taken from the
  kernel (float32, outside the gradient) so that both sides use the same
  advantages and differ only in how ∇ log p_s(y) is computed (fused
  statistics vs materialised logits).
  """
  weights = setup["weights"]
  keep = _keep(setup, weights)
  b = setup["batch"]
  h_s = _hidden(STUDENT, setup["student"], b["tokens"], b["mask"]).reshape(B * T, -1)
  w = np.where(keep[..., None], weights, 0.0).reshape(B * T, -1)
  adv = pallas_kernels.fused_token_level_kl(
      h_s, head_matrix(STUDENT, setup["student"]),
      [h.reshape(B * T, -1) for h in setup["hidden"]], setup["heads"], w,
      b["targets"].reshape(-1)).reshape(B, T)

  def reference(params):  # materialised logits, plain jnp
    logits = forward(STUDENT, params, b["tokens"], None, b["mask"]).logits
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), b["targets"][..., None], -1)[..., 0]
    return jnp.sum(jnp.where(keep, adv, 0.0) * logp) / keep.sum()

  got = _run(setup["student"], _batch(setup, weights), tuple(setup["heads"]),
             loss_lib.OPDLossConfig(estimator="token"), grad=True)[2]
  want = jax.jit(jax.grad(reference))(setup["student"])
  # Reordered float32 sums (tokens x the V-long softmax), chained ~8 per layer
  # in quadrature: as in the sharded test. Dropping the stop-gradient doubles
  # the gradient; a wrong token or sign is O(1) relative.
  rtol = np.sqrt(8 * STUDENT.n_layers) * np.sqrt(B * T * V) * EPS32
  diff = jax.tree.map(np.subtract, jax.device_get(got), jax.device_get(want))
  assert _global_norm(diff) <= rtol * _global_norm(want)


def test_student_equal_to_teacher_gives_zero_loss_and_gradient(setup):
  b = setup["batch"]
  same = _hidden(STUDENT, setup["student"], b["tokens"], b["mask"])
  head = head_matrix(STUDENT, setup["student"])
  w = jnp.ones((B, T, 1))
  grads = {}
  for name, hidden, heads in (("same", same, head), ("other", setup["hidden"][0],
                                                      setup["heads"][0])):
    loss, _, grads[name] = _run(setup["student"], _batch(setup, w, [hidden]), (heads,),
                                grad=True)
    if name == "same":
      assert abs(float(loss)) <= _tol(setup)
    else:
      assert float(loss) > 100 * _tol(setup)  # the comparison case has signal
  norm = lambda g: float(optax.tree.norm(g))
  # The gradient is linear in the logit difference z − x: rounding-level
  # (≤ layers · D · eps relative, x16 headroom) for equal models, O(1) otherwise.
  assert norm(grads["same"]) <= 16 * STUDENT.n_layers * STUDENT.d_model * EPS32 * norm(
      grads["other"])


def test_one_hot_weights_equal_the_single_teacher_call(setup):
  one_hot = np.zeros((B, T, 3), np.float32)
  one_hot[..., 2] = 1.0
  l3, _, g3 = _run(setup["student"], _batch(setup, one_hot), tuple(setup["heads"]), grad=True)
  l1, _, g1 = _run(setup["student"], _batch(setup, np.ones((B, T, 1), np.float32),
                                            setup["hidden"][2:3]), (setup["heads"][2],), grad=True)
  assert abs(float(l3) - float(l1)) <= _tol(setup)
  # At most a reordering of the same float32 sums (see the sharded test).
  rtol = np.sqrt(8 * STUDENT.n_layers) * np.sqrt(B * T * V) * EPS32
  diff = jax.tree.map(np.subtract, jax.device_get(g3), jax.device_get(g1))
  assert _global_norm(diff) <= rtol * _global_norm(g1)


def test_renormalisation_after_a_skip_equals_a_pool_without_that_teacher(setup):
  available = np.ones((B, 3), bool)
  available[:, 1] = False  # teacher 1 skipped for the batch
  w, _ = teacher_weighting.apply_availability(setup["weights"], available)
  zeroed = list(setup["hidden"])
  zeroed[1] = jnp.zeros_like(zeroed[1])  # what the fault layer hands over
  l3 = _run(setup["student"], _batch(setup, w, zeroed), tuple(setup["heads"]), grad=True)[0]
  keep_two = [0, 2]
  l2 = _run(setup["student"], _batch(setup, setup["weights"][..., keep_two],
                                     [setup["hidden"][k] for k in keep_two]),
            tuple(setup["heads"][k] for k in keep_two))[0]
  assert abs(float(l3) - float(l2)) <= _tol(setup)


def _capture_grads() -> optax.GradientTransformation:
  """Passes the gradients on and keeps them in its state (sharded like the
  params): the gradients the compiled step really computed."""
  return optax.GradientTransformation(init=lambda params: jax.tree.map(jnp.zeros_like, params),
                                      update=lambda grads, state, params=None: (grads, grads))


def _global_norm(tree):
  return np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))


def test_sharded_222_step_equals_single_device(setup):
  fn = loss_lib.make_opd_loss(STUDENT, setup["heads"])
  batch = {k: np.asarray(v) for k, v in _batch(setup, setup["weights"]).items()
           if k != "teacher_hidden"}
  batch["teacher_hidden"] = tuple(np.asarray(h) for h in setup["hidden"])
  fast = {"xla_backend_optimization_level": 0}  # codegen only; the partitioning is unchanged
  out = {}
  for name, devices, shape in (("one", jax.devices()[:1], (1, 1, 1)),
                               ("mesh", jax.devices(), (2, 2, 2))):
    mesh = sharding.make_mesh(shape, devices)
    opt = optax.chain(_capture_grads(), optax.sgd(1.0))
    state, shardings = init_train_state(STUDENT, opt, mesh, sharding.DEFAULT_RULES, rng=0,
                                        params=setup["student"], compiler_options=fast)
    step = make_train_step(fn, opt, mesh, shardings, donate=False, compiler_options=fast)
    new, metrics = step(state, batch)
    out[name] = (float(metrics["loss"]), jax.device_get(new.opt_state[0]))
  assert abs(out["one"][0] - out["mesh"][0]) <= _tol(setup)
  # The mesh reorders the token sum (data/fsdp) and the contractions (tensor);
  # a float32 sum of n terms reordered moves by ~sqrt(n) eps relative, n <=
  # B*T*V (tokens x the longest contraction, the LM head). The backward pass
  # chains ~8 such sums per layer: sqrt(8 * layers) in quadrature. A wiring
  # error (a lost token or teacher, a dropped psum) is >= 1/(B*T) ~ 2e-2.
  rtol = np.sqrt(8 * STUDENT.n_layers) * np.sqrt(B * T * V) * EPS32
  diff = jax.tree.map(np.subtract, out["one"][1], out["mesh"][1])
  assert _global_norm(diff) <= rtol * _global_norm(out["one"][1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(estimator="beam"), r"OPDLossConfig.estimator must be one of .*'beam'"),
    (dict(temperature=0.0), r"OPDLossConfig.temperature must be .*0.0"),
    (dict(teacher_temperature=-0.5), r"OPDLossConfig.teacher_temperature must be .*-0.5"),
    (dict(top_k=0), r"OPDLossConfig.top_k must be .*0"),
    (dict(forward_kl_coef=-1.0), r"OPDLossConfig.forward_kl_coef must be .*-1.0"),
])
def test_bad_config_names_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    loss_lib.OPDLossConfig(**kwargs)


def test_bad_heads_and_batch_name_the_field(setup):
  with pytest.raises(ValueError, match=r"teacher_heads\[0\].shape=\(48, 100\).*V=128"):
    loss_lib.make_opd_loss(STUDENT, [jnp.zeros((48, 100))])
  with pytest.raises(ValueError, match="teacher_heads=()"):
    loss_lib.make_opd_loss(STUDENT, [])
  fn = loss_lib.make_opd_loss(STUDENT, setup["heads"])
  bad = _batch(setup, setup["weights"][..., :2])
  with pytest.raises(ValueError, match=r"teacher_weights'\].shape=\(4, 12, 2\).*\(4, 12, 3\)"):
    fn(setup["student"], bad, None)
  missing = {k: v for k, v in _batch(setup, setup["weights"]).items() if k != "loss_mask"}
  with pytest.raises(ValueError, match=r"missing \['loss_mask'\]"):
    fn(setup["student"], missing, None)
