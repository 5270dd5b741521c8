"""Tests for opd/training/train_step.py on 8 fake CPU devices (tests/conftest.py).

The single-device run is the reference. Every mesh must reproduce its
first-step gradients (captured inside the compiled step) to a relative
tolerance derived from float32 eps and the reduction lengths, and its params
after 3 AdamW steps to within a bound derived from the learning rates: Adam
divides by sqrt(v), so a gradient element that is pure reduction-order noise
may flip sign between meshes and move its parameter by up to ~2 lr per step.
Comparing post-Adam params with a hard 1e-5 was tuned to one CPU (see
docs/DEVELOPING.md, "Choosing tolerances"). Compiled steps are shared between
assertions through module-scoped fixtures. Compiles use XLA's backend
optimisation level 0: at this size compile time dominates, and the level
changes code generation only, not the SPMD partitioning under test.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from opd.parallel import sharding
from opd.training.objectives import next_token_loss
from opd.models import ModelConfig, init_params
from opd.training.train_step import (NonFiniteError, OptimConfig, abstract_train_state,
                            init_train_state, make_optimizer, make_schedule, make_train_step,
                            process_batch_rows, raise_if_nonfinite, shard_batch)

CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
OPT_CFG = OptimConfig(lr=1e-3, warmup_steps=2, decay_steps=10, schedule="cosine",
                      end_lr_ratio=0.1, weight_decay=0.1, clip_norm=1.0)
FAST = {"xla_backend_optimization_level": 0}
STEPS = 3
B, T = 8, 32


@jax.custom_vjp
def _scale_grad(x, s):
  return x


def _scale_grad_fwd(x, s):
  return x, s


def _scale_grad_bwd(s, g):
  return g * s, jnp.zeros_like(s)


_scale_grad.defvjp(_scale_grad_fwd, _scale_grad_bwd)


def _loss_fn(params, batch, rng):
  """Next-token loss; ``loss_scale`` poisons the loss, ``grad_scale`` only the
  gradients (both 1 in normal batches)."""
  loss, metrics = next_token_loss(CFG)(params, batch, rng)
  loss = _scale_grad(loss, batch["grad_scale"][0]) * batch["loss_scale"][0]
  return loss, metrics


def _batches(loss_scale=1.0, grad_scale=1.0):
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (STEPS, B, T + 1)).astype(np.int32)
  return [{"tokens": tokens[i], "loss_scale": np.full((B,), loss_scale, np.float32),
           "grad_scale": np.full((B,), grad_scale, np.float32)} for i in range(STEPS)]


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _max_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _global_norm(tree):
  return math.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64))) for x in jax.tree.leaves(tree)))


def _rel_diff(a, b):
  """||a - b|| / ||b|| over the whole pytree (global L2 norms)."""
  return _global_norm(jax.tree.map(np.subtract, a, b)) / _global_norm(b)


EPS32 = float(np.finfo(np.float32).eps)
# Float32 sums of n terms taken in another order differ by ~sqrt(n) eps
# relative to the sum of |terms| (random-walk rounding). A mesh re-orders the
# token sum (data/fsdp shards) and the head/MLP/attention contractions (tensor
# shards); the loss and every gradient element are fed by at most n = N*V
# rounded terms (N = B*T tokens, V the longest contraction, the LM head).
REORDER_RTOL = math.sqrt(B * T * CFG.vocab_size) * EPS32  # ~3e-5
LOSS0_RTOL = REORDER_RTOL
# The backward pass chains ~8 such sums per layer over 2 layers; independent
# errors add in quadrature, so sqrt(16) = 4 times one sum's. A wiring error (a
# dropped psum, a mis-sharded param, a lost token) is >= 1/N ~ 4e-3 relative.
GRAD_RTOL = 4 * REORDER_RTOL


def _adam_step_bound(b1, b2, t):
  """max |m_hat_t / sqrt(v_hat_t)| over all gradient sequences, by Cauchy-Schwarz.

  m_hat = sum_i w_i g_i and v_hat = sum_i u_i g_i^2 with the bias-corrected
  weights w_i = (1-b1) b1^(t-i) / (1-b1^t), u_i = (1-b2) b2^(t-i) / (1-b2^t);
  so |m_hat| <= sqrt(sum_i w_i^2 / u_i) sqrt(v_hat). At t = 1 it is exactly 1.
  """
  w = [(1 - b1) * b1 ** (t - i) / (1 - b1 ** t) for i in range(1, t + 1)]
  u = [(1 - b2) * b2 ** (t - i) / (1 - b2 ** t) for i in range(1, t + 1)]
  return math.sqrt(sum(wi * wi / ui for wi, ui in zip(w, u)))


def _adam_param_bound(lrs):
  """Bound on |p_a - p_b| after AdamW steps with rates ``lrs`` from equal params.

  Each run's normalised step is at most lr_t * A_t per element (A_t from
  ``_adam_step_bound``), whatever its gradients, so two runs differ by at most
  2 lr_t A_t per step; decoupled weight decay multiplies an existing gap by
  (1 - lr_t wd), which can only shrink it, but we allow (1 + lr_t wd).
  A run whose moments are sharded unlike their params (m of one element, v
  of another) or that applies another rate breaks this bound.
  """
  bound = 0.0
  for t, lr in enumerate(lrs, start=1):
    bound = bound * (1 + lr * OPT_CFG.weight_decay) + 2 * lr * _adam_step_bound(OPT_CFG.b1, OPT_CFG.b2, t)
  return bound


def _capture_grads() -> optax.GradientTransformation:
  """An optax stage that passes the gradients on unchanged and keeps them in
  its state, which the step shards like the params: the gradients the compiled
  sharded step really computed, readable after the step."""
  return optax.GradientTransformation(init=lambda params: jax.tree.map(jnp.zeros_like, params),
                                      update=lambda grads, state, params=None: (grads, grads))


def _train(mesh, init_params_host=None, grad_accum_steps=1, rules=sharding.DEFAULT_RULES):
  optimizer = optax.chain(_capture_grads(), make_optimizer(OPT_CFG))
  state, shardings = init_train_state(CFG, optimizer, mesh, rules, rng=0, params=init_params_host,
                                      compiler_options=FAST)
  init_host = _host(state.params)
  step = make_train_step(_loss_fn, optimizer, mesh, shardings, rules=rules,
                         grad_accum_steps=grad_accum_steps, compiler_options=FAST)
  losses, metrics, grads = [], [], None
  for batch in _batches():
    state, m = step(state, shard_batch(batch, mesh, rules))
    losses.append(float(m["loss"]))
    metrics.append(_host(m))
    if grads is None:  # the first step's gradients, taken at the shared initial params
      grads = _host(state.opt_state[0])
  return dict(state=state, shardings=shardings, step=step, optimizer=optimizer,
              losses=np.asarray(losses), params=_host(state.params), init_params=init_host,
              metrics=metrics, grads=grads)


def _assert_same_training(run, ref):
  """``run`` reproduces ``ref`` (same initial params, same batches) to within
  float32 reduction-order noise: see REORDER_RTOL, GRAD_RTOL, _adam_param_bound."""
  assert _rel_diff(run["grads"], ref["grads"]) < GRAD_RTOL
  # Only the first loss is a function of equal params; later ones follow from
  # the params, which are checked directly below.
  np.testing.assert_allclose(run["losses"][0], ref["losses"][0], rtol=LOSS0_RTOL)
  lrs = [float(m["lr"]) for m in ref["metrics"]]
  np.testing.assert_allclose([float(m["lr"]) for m in run["metrics"]], lrs, rtol=4 * EPS32)
  diff = np.concatenate([np.abs(a - b).ravel() for a, b in
                         zip(jax.tree.leaves(run["params"]), jax.tree.leaves(ref["params"]))])
  assert diff.max() <= _adam_param_bound(lrs)
  # An element whose gradient is well above the noise gets the same normalised
  # step to within its relative gradient noise (~GRAD_RTOL); at least half of
  # the elements are such, so the median gap is far below the worst case.
  assert np.median(diff) <= _adam_param_bound(lrs) * GRAD_RTOL


@pytest.fixture(scope="module")
def sharded_222():
  """Random init created directly on the (2, 2, 2) mesh, then 3 steps."""
  return _train(sharding.make_mesh((2, 2, 2)))


@pytest.fixture(scope="module")
def reference(sharded_222):
  """The same 3 steps on one device, from the same initial params."""
  return _train(sharding.make_mesh((1, 1, 1), jax.devices()[:1]), sharded_222["init_params"])


def test_random_init_on_mesh_equals_model_init(sharded_222):
  # Sharded random init must give the model's own init_params(cfg, key(seed)).
  expected = _host(jax.jit(lambda k: init_params(CFG, k), compiler_options=FAST)(jax.random.key(0)))
  assert _max_diff(sharded_222["init_params"], expected) == 0.0


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)], ids=lambda s: f"mesh={s}")
def test_sharded_step_matches_single_device(shape, reference, sharded_222):
  if shape == (2, 2, 2):
    run = sharded_222
  else:
    run = _train(sharding.make_mesh(shape), reference["init_params"])
  _assert_same_training(run, reference)
  # The update was really applied (Adam's first step moves every decayed
  # param by ~lr/2 here) and the loss went down.
  assert _max_diff(run["params"], reference["init_params"]) > 0.25 * OPT_CFG.lr
  assert reference["losses"][-1] < reference["losses"][0]
  assert int(run["state"].step) == STEPS


def test_metrics_report_lr_schedule_and_grad_norm(reference):
  lrs = [float(m["lr"]) for m in reference["metrics"]]
  # Warmup (s+1)/W * lr for s < W=2; step 2 starts the cosine decay at the peak.
  expected = [1e-3 * 1 / 2, 1e-3 * 2 / 2, 1e-3]
  # A few float32 ops, each rounding by <= eps/2 relative.
  np.testing.assert_allclose(lrs, expected, rtol=4 * EPS32)
  for m in reference["metrics"]:
    assert bool(m["finite"]) and bool(m["loss_finite"]) and bool(m["grads_finite"])
    assert float(m["grad_norm"]) > 0
    assert float(m["tokens"]) == B * T


def test_fsdp_params_are_really_sharded():
  # Hand-computed per-device shapes with DEFAULT_RULES (vocab, mlp, heads ->
  # tensor; embed -> fsdp) on fsdp=4, tensor=2. Only shapes are needed, so
  # this uses the abstract state (no compile).
  mesh = sharding.make_mesh((1, 4, 2))
  abstract, shardings = abstract_train_state(CFG, make_optimizer(OPT_CFG), mesh)
  p = shardings.params
  D, V, F, H, K, Dh = 64, 256, 128, 4, 2, 16
  expected = {
      ("embedding",): ((V, D), (V // 2, D // 4)),
      ("lm_head",): ((D, V), (D // 4, V // 2)),
      ("layers_0", "mlp", "gate"): ((D, F), (D // 4, F // 2)),
      ("layers_0", "mlp", "down"): ((F, D), (F // 2, D // 4)),
      ("layers_1", "attn", "q"): ((D, H, Dh), (D // 4, H // 2, Dh)),
      ("layers_1", "attn", "k"): ((D, K, Dh), (D // 4, K // 2, Dh)),
      ("layers_1", "attn", "o"): ((H, Dh, D), (H // 2, Dh, D // 4)),
      ("final_norm", "scale"): ((D,), (D,)),
  }
  mu = abstract.opt_state[1].inner_state[0].mu  # clip, then inject(adamw)=(adam, decay, lr)
  for path, (shape, shard_shape) in expected.items():
    s, m = p, mu
    for k in path:
      s, m = s[k], m[k]
    assert s.shard_shape(shape) == shard_shape, path
    # Adam's first moment is sharded exactly like its parameter.
    assert m.sharding == s, path
  assert shardings.step.is_fully_replicated


def test_state_is_created_sharded_and_fp32(sharded_222):
  state = sharded_222["state"]
  emb = state.params["embedding"]
  assert emb.sharding.shard_shape(emb.shape) == (128, 32)  # vocab/tensor=2, embed/fsdp=2
  assert all(len(s.data.shape) and s.data.shape == (128, 32) for s in emb.addressable_shards)
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32


def test_check_sharded_fails_on_replicated_large_param(reference):
  # A rule table that maps nothing to the model axes leaves the 256x64
  # embedding (2**14 elements) replicated on fsdp*tensor = 8.
  rules = tuple((name, None) for name, _ in sharding.DEFAULT_RULES)
  mesh = sharding.make_mesh((1, 4, 2))
  with pytest.raises(ValueError, match=r"fully replicated.*\['embedding'\]"):
    init_train_state(CFG, make_optimizer(OPT_CFG), mesh, rules, params=reference["init_params"],
                     compiler_options=FAST)


def test_grad_accumulation_equals_full_batch(sharded_222):
  run = _train(sharding.make_mesh((2, 2, 2)), sharded_222["init_params"], grad_accum_steps=2)
  # The mean of two microbatch gradients equals the full-batch gradient up to
  # the order of the token sum: the same tolerances as across meshes.
  _assert_same_training(run, sharded_222)
  # Microbatches that do not divide the batch are refused by name.
  bad = make_train_step(_loss_fn, run["optimizer"], sharding.make_mesh((2, 2, 2)),
                        run["shardings"], grad_accum_steps=3, compiler_options=FAST)
  with pytest.raises(ValueError, match=r"grad_accum_steps=3"):
    bad(run["state"], _batches()[0])


@pytest.mark.parametrize("poison", ["loss", "grads"])
def test_nonfinite_update_is_not_applied(poison, reference):
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  state, before_step = reference["state"], int(reference["state"].step)
  before = _host(state)
  batch = _batches(**({"loss_scale": np.nan} if poison == "loss" else {"grad_scale": np.inf}))[0]
  new_state, metrics = reference["step"](state, shard_batch(batch, mesh))
  reference["state"] = new_state  # the old one was donated
  assert not bool(metrics["finite"])
  assert bool(metrics["loss_finite"]) == (poison == "grads")
  assert not bool(metrics["grads_finite"])
  assert _max_diff(_host(new_state), before) == 0.0  # step, params, moments, rng unchanged
  assert int(new_state.step) == before_step
  what = "loss" if poison == "loss" else "gradients"
  with pytest.raises(NonFiniteError, match=f"non-finite {what}.* at step 7"):
    raise_if_nonfinite(metrics, 7)


def test_mesh_shape_must_match_device_count():
  with pytest.raises(ValueError, match=r"needs 16 devices but 8 are available"):
    sharding.make_mesh((4, 2, 2))


def test_shard_batch_places_rows_and_rejects_indivisible_batch():
  mesh = sharding.make_mesh((2, 2, 2))
  x = np.arange(8 * 3).reshape(8, 3)
  out = shard_batch({"x": x}, mesh)["x"]
  assert out.sharding.shard_shape(out.shape) == (2, 3)  # batch over data*fsdp = 4
  np.testing.assert_array_equal(np.asarray(out), x)
  assert process_batch_rows(mesh, sharding.DEFAULT_RULES, 8) == slice(0, 8)
  with pytest.raises(ValueError, match=r"x.shape=\(6, 3\).*4 batch shards"):
    shard_batch({"x": x[:6]}, mesh)
  with pytest.raises(ValueError, match="scalar"):
    shard_batch({"n": np.float32(1.0)}, mesh)


def test_start_from_given_params_checks_shapes(reference):
  params = dict(reference["init_params"])
  params["embedding"] = params["embedding"][:128]
  with pytest.raises(ValueError, match=r"params\['embedding'\] has shape \(128, 64\).*\(256, 64\)"):
    init_train_state(CFG, make_optimizer(OPT_CFG), sharding.make_mesh((1, 1, 1), jax.devices()[:1]),
                     params=params)


def test_bf16_compute_keeps_fp32_master_state():
  # bf16 compute and even bf16 storage in the config: the state (params and
  # Adam moments) stays fp32 through a step, and so do the gradients. Traced
  # only (eval_shape), so nothing is compiled.
  cfg = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  optimizer = make_optimizer(OPT_CFG)
  abstract, shardings = abstract_train_state(cfg, optimizer, mesh)
  loss = next_token_loss(cfg)
  step = make_train_step(loss, optimizer, mesh, shardings)
  batch = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
  with jax.set_mesh(mesh):
    new_state, metrics = step.jitted_for(batch).eval_shape(abstract, batch)
  grads = jax.eval_shape(jax.grad(lambda p, b: loss(p, b, None)[0]), abstract.params, batch)
  for tree in (abstract.params, abstract.opt_state, new_state.params, new_state.opt_state, grads):
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
  assert metrics["loss"].dtype == jnp.float32


@pytest.mark.parametrize("field,value", [("lr", 0.0), ("lr", float("nan")), ("warmup_steps", -1),
                                         ("schedule", "exp"), ("end_lr_ratio", 1.5), ("b2", 1.0),
                                         ("clip_norm", 0.0), ("grad_accum_steps", 0)])
def test_optim_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=f"OptimConfig.{field}"):
    OptimConfig(**{field: value, **({"decay_steps": 5} if field == "schedule" else {})})


def test_decay_schedule_needs_decay_steps():
  with pytest.raises(ValueError, match="decay_steps"):
    OptimConfig(schedule="cosine", decay_steps=0)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_matches_reference(kind):
  cfg = OptimConfig(lr=2.0, warmup_steps=4, decay_steps=8, schedule=kind, end_lr_ratio=0.25)

  def ref(s):
    if s < 4:
      return 2.0 * (s + 1) / 4
    if kind == "constant":
      return 2.0
    frac = min((s - 4) / 8, 1.0)
    if kind == "cosine":
      return 0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi * frac))
    return 2.0 + (0.5 - 2.0) * frac

  sched = make_schedule(cfg)
  got = [float(sched(s)) for s in range(16)]
  # float32 cos/mul/add, each rounding by <= eps/2; near the end of the cosine
  # 1 + cos(pi frac) cancels, so the error is absolute (~eps * lr) against a
  # value >= end_lr_ratio * lr: 8 eps relative covers both.
  np.testing.assert_allclose(got, [ref(s) for s in range(16)], rtol=8 * EPS32)
