"""Tests for opd/training/optim.py: ``OptimConfig`` validation and that the
optimizer ``make_optimizer`` builds carries ``grad_accum_steps`` into
``make_train_step`` (one source of truth for the microbatch count).

The accumulation test uses a loss that is NOT a mean over rows, the square of
the batch-mean residual, so the mean of microbatch gradients differs from
the full-batch gradient: a step that ignored the count would fail it.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from opd.parallel import sharding
from opd.training.optim import OptimConfig, Optimizer, make_optimizer
from opd.training.train_step import init_train_state, make_train_step

FAST = {"xla_backend_optimization_level": 0}
B, D, N = 16, 8, 4  # batch rows, features, microbatches
LR = 0.1


def _init(rng):
  return {"w": nn.LogicallyPartitioned(jax.random.normal(rng, (D,)), names=(None,))}


def _loss_fn(params, batch, rng):
  del rng
  resid = (batch["x"] @ params["w"] - batch["y"]).mean()
  return resid ** 2, {"rows": jnp.float32(batch["x"].shape[0])}


def _reference(w, x, y):
  """Numpy (float64) loss and gradient of ``_loss_fn`` on one (micro)batch."""
  resid = (x @ w - y).mean()
  return resid ** 2, 2.0 * resid * x.mean(axis=0)


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(0)
  # Row r is offset by 3r mod N, the same within a microbatch (r mod N) and
  # different between them, so the microbatch residual means differ.
  x = rng.normal(size=(B, D)).astype(np.float32)
  y = (rng.normal(size=(B,)) + 3.0 * np.arange(B) % N).astype(np.float32)
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  return dict(x=x, y=y, mesh=mesh)


def _one_step(problem, optimizer, **step_kwargs):
  state, shardings = init_train_state(_init, optimizer, problem["mesh"], rng=0,
                                      compiler_options=FAST)
  w0 = np.asarray(jax.device_get(state.params["w"]), np.float64)
  step = make_train_step(_loss_fn, optimizer, problem["mesh"], shardings, donate=False,
                         compiler_options=FAST, **step_kwargs)
  new, metrics = step(state, {"x": problem["x"], "y": problem["y"]})
  return w0, jax.device_get(new), jax.device_get(metrics)


def test_config_grad_accum_steps_is_honoured(problem):
  cfg = OptimConfig(lr=LR, clip_norm=None, grad_accum_steps=N)
  optimizer = make_optimizer(cfg)
  assert isinstance(optimizer, Optimizer) and optimizer.grad_accum_steps == N
  w0, state, metrics = _one_step(problem, optimizer)  # the count is not passed again

  # Reference: microbatch i holds rows i, i + N, ... (make_train_step's strided split).
  x, y = problem["x"].astype(np.float64), problem["y"].astype(np.float64)
  micro = [_reference(w0, x[i::N], y[i::N]) for i in range(N)]
  loss_ref = np.mean([l for l, _ in micro])
  grad_ref = np.mean([g for _, g in micro], axis=0)
  full_loss, full_grad = _reference(w0, x, y)
  # float32 sums over B*D products of O(1) values, relative to the result.
  rtol = np.finfo(np.float32).eps * B * D
  # The test can fail: without accumulation the step would see the full batch.
  assert abs(full_loss - loss_ref) > 100 * rtol * loss_ref
  assert np.linalg.norm(full_grad - grad_ref) > 100 * rtol * np.linalg.norm(grad_ref)

  assert metrics["rows"] == B / N
  np.testing.assert_allclose(metrics["loss"], loss_ref, rtol=rtol)
  np.testing.assert_allclose(metrics["grad_norm"], np.linalg.norm(grad_ref), rtol=rtol)
  # Adam's first moment after one update is (1 - b1) * gradient: the gradient itself.
  mu = np.asarray(optax.tree_utils.tree_get(state.opt_state, "mu")["w"])
  np.testing.assert_allclose(mu / (1 - cfg.b1), grad_ref, rtol=rtol,
                             atol=rtol * np.abs(grad_ref).max())
  # First bias-corrected Adam step: w - lr * g / (|g| + eps).
  w_ref = w0 - LR * grad_ref / (np.abs(grad_ref) + cfg.eps)
  np.testing.assert_allclose(np.asarray(state.params["w"]), w_ref, rtol=0,
                             atol=4 * np.finfo(np.float32).eps * np.abs(w_ref).max())


def test_explicit_count_must_agree_with_the_config(problem):
  optimizer = make_optimizer(OptimConfig(lr=LR, grad_accum_steps=N))
  _, _, metrics = _one_step(problem, optimizer, grad_accum_steps=N)  # agreeing: fine
  assert metrics["rows"] == B / N
  with pytest.raises(ValueError, match=rf"grad_accum_steps=2 but the optimizer's "
                                       rf"OptimConfig.grad_accum_steps={N}"):
    make_train_step(_loss_fn, optimizer, problem["mesh"], None, grad_accum_steps=2)
  with pytest.raises(ValueError, match=r"make_train_step.grad_accum_steps must be a positive "
                                       r"int or None, got 0"):
    make_train_step(_loss_fn, optimizer, problem["mesh"], None, grad_accum_steps=0)


def test_plain_optax_transformation_takes_the_explicit_count(problem):
  # Not built from an OptimConfig: the argument is the only source (default 1).
  _, _, metrics = _one_step(problem, optax.sgd(LR), grad_accum_steps=N)
  assert metrics["rows"] == B / N
  _, _, metrics = _one_step(problem, optax.sgd(LR))
  assert metrics["rows"] == B


@pytest.mark.parametrize("field,value", [
    ("lr", 0.0), ("lr", float("nan")), ("lr", True), ("warmup_steps", -1),
    ("warmup_steps", 2.0), ("schedule", "exp"), ("end_lr_ratio", 1.5), ("b1", 1.0),
    ("b2", -0.1), ("eps", 0.0), ("clip_norm", 0.0), ("grad_accum_steps", 0),
    ("grad_accum_steps", True)])
def test_optim_config_rejects_and_names_the_field(field, value):
  with pytest.raises(ValueError, match=rf"OptimConfig\.{field}.* got {value!r}"):
    OptimConfig(**{field: value})


def test_optim_config_stores_numpy_numbers_as_python():
  cfg = OptimConfig(lr=np.float32(0.5), warmup_steps=np.int64(3), grad_accum_steps=np.int32(2),
                    clip_norm=None)
  assert cfg == OptimConfig(lr=0.5, warmup_steps=3, grad_accum_steps=2, clip_norm=None)
  assert type(cfg.lr) is float and type(cfg.warmup_steps) is int
  assert type(cfg.grad_accum_steps) is int
  assert make_optimizer(cfg).grad_accum_steps == 2
  with pytest.raises(ValueError, match="make_optimizer needs an OptimConfig, got dict"):
    make_optimizer({"lr": 0.1})


@pytest.mark.parametrize("field,value", [("lr", 1e39), ("weight_decay", 4e38), ("clip_norm", 1e40)])
def test_values_that_overflow_float32_are_refused(field, value):
  """1e39 is a fine float64 but inf in float32, the step's precision: the
  first update would make every parameter inf/NaN."""
  assert value > float(np.finfo(np.float32).max)  # the premise: float32(value) is inf
  message = f"OptimConfig.{field}={value!r} is not finite in float32"
  with pytest.raises(ValueError, match=re.escape(message)):
    OptimConfig(**{field: value})
  largest = float(np.finfo(np.float32).max)
  assert getattr(OptimConfig(**{field: largest}), field) == largest


def test_clip_norm_none_on_the_command_line_disables_clipping():
  """docs: experiments/configs/README.md lists clip_norm; OptimConfig says None disables it."""
  from opd.config.fields import from_group, to_group
  from opd.config.overrides import apply_overrides
  import ml_collections
  config = ml_collections.ConfigDict({"optim": to_group(OptimConfig, lr=1e-3)})
  assert config.optim.clip_norm == 1.0
  apply_overrides(config, ["optim.clip_norm=None"])
  cfg = from_group(OptimConfig, config.optim, "config.optim")
  assert cfg.clip_norm is None
  # Without clipping the optimizer is AdamW alone (its state is the injected
  # hyperparameters' state), not a chain that starts with clip_by_global_norm.
  params = {"w": jnp.zeros(2)}
  assert hasattr(make_optimizer(cfg).init(params), "hyperparams")
  assert not hasattr(make_optimizer(cfg.replace(clip_norm=1.0)).init(params), "hyperparams")
  # A field that cannot be None still names itself.
  apply_overrides(config, ["optim.lr=None"])
  with pytest.raises(ValueError, match=r"lr"):
    from_group(OptimConfig, config.optim, "config.optim")
