"""Tests for opd/train_step.py on 8 fake CPU devices (tests/conftest.py).

The single-device run is the reference; every mesh must reproduce its losses
and parameters after 3 AdamW steps. Compiled steps are shared between
assertions through module-scoped fixtures. Compiles use XLA's backend
optimisation level 0: at this size compile time dominates, and the level
changes code generation only, not the SPMD partitioning under test.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
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


def _train(mesh, init_params_host=None, grad_accum_steps=1, rules=sharding.DEFAULT_RULES):
  optimizer = make_optimizer(OPT_CFG)
  state, shardings = init_train_state(CFG, optimizer, mesh, rules, rng=0, params=init_params_host,
                                      compiler_options=FAST)
  init_host = _host(state.params)
  step = make_train_step(_loss_fn, optimizer, mesh, shardings, rules=rules,
                         grad_accum_steps=grad_accum_steps, compiler_options=FAST)
  losses, metrics = [], []
  for batch in _batches():
    state, m = step(state, shard_batch(batch, mesh, rules))
    losses.append(float(m["loss"]))
    metrics.append(_host(m))
  return dict(state=state, shardings=shardings, step=step, losses=np.asarray(losses),
              params=_host(state.params), init_params=init_host, metrics=metrics)


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
  np.testing.assert_allclose(run["losses"], reference["losses"], rtol=0, atol=1e-5)
  assert _max_diff(run["params"], reference["params"]) < 1e-5
  # The loss went down and the update was really applied.
  assert _max_diff(run["params"], reference["init_params"]) > 1e-4
  assert reference["losses"][-1] < reference["losses"][0]
  assert int(run["state"].step) == STEPS


def test_metrics_report_lr_schedule_and_grad_norm(reference):
  lrs = [float(m["lr"]) for m in reference["metrics"]]
  # Warmup (s+1)/W * lr for s < W=2; step 2 starts the cosine decay at the peak.
  expected = [1e-3 * 1 / 2, 1e-3 * 2 / 2, 1e-3]
  np.testing.assert_allclose(lrs, expected, rtol=1e-6)
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
  np.testing.assert_allclose(run["losses"], sharded_222["losses"], rtol=0, atol=1e-5)
  assert _max_diff(run["params"], sharded_222["params"]) < 1e-5
  # Microbatches that do not divide the batch are refused by name.
  bad = make_train_step(_loss_fn, make_optimizer(OPT_CFG), sharding.make_mesh((2, 2, 2)),
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
  np.testing.assert_allclose(got, [ref(s) for s in range(16)], rtol=1e-6)
