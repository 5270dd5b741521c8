"""One sharded training step for every objective (SFT, GRPO, distillation, RMs).

The step is generic over a loss function::

    loss_fn(params, batch, rng) -> (loss, metrics)   # loss: fp32 scalar

and does the rest: gradient accumulation over microbatches (``lax.scan``,
mean of the microbatch gradients), global-norm clipping and AdamW with a
warmup + decay schedule (``OptimConfig`` / ``make_optimizer``), a
non-finite guard, and explicit shardings on a ``(data, fsdp, tensor)`` mesh.

Typical use::

    mesh = opd.parallel.sharding.make_mesh((1, 4, 2))
    optimizer = make_optimizer(OptimConfig(lr=3e-4, warmup_steps=100, decay_steps=10_000,
                                           grad_accum_steps=4))
    state, shardings = init_train_state(model_cfg, optimizer, mesh, rules, rng=0)
    step = make_train_step(opd.training.objectives.next_token_loss(model_cfg), optimizer, mesh,
                           shardings, rules=rules)   # 4 microbatches, from the OptimConfig
    state, metrics = step(state, shard_batch(host_batch, mesh, rules))

Precision: parameters and optimizer moments are stored in fp32 (the "master"
copy; ``init_train_state`` casts floating params to ``master_dtype``); the
model casts them to its compute dtype (``ModelConfig.dtype``, e.g. bf16)
inside ``apply``, so gradients arrive in fp32.

Non-finite guard: when the loss, the gradient global norm, or any updated
parameter or optimizer-state value (an overflowing update: a learning rate of
1e39 is inf in float32) is NaN/inf, the update is discarded inside the jitted
step (the returned state equals the input state, ``step`` included) and
``metrics["finite"]`` is False, with ``loss_finite`` / ``grads_finite`` /
``update_finite`` saying which; ``raise_if_nonfinite`` turns
that into a ``NonFiniteError`` on the host (``opd.training.loop.train`` calls it).

Multi-host: every function here works with several processes; each process
passes its local rows to ``shard_batch`` (``process_batch_rows`` says which
rows of the global batch those are; both live in ``opd.parallel.distributed`` and are
re-exported here) and gets the global array back.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from opd.parallel import sharding as sharding_lib
# Re-exported: callers build optimizers and place batches through this module.
from opd.parallel.distributed import batch_shard_count, process_batch_rows, shard_batch  # noqa: F401
from opd.models import ModelConfig, init_params
from opd.config.fields import check_int
# Re-exported: the optimizer API lives in opd.training.optim.
from opd.training.optim import (OptimConfig, Optimizer, make_optimizer,  # noqa: F401
                                make_schedule)

__all__ = [
    "LossFn", "LossWithFrozen", "NonFiniteError", "OptimConfig", "Optimizer", "RESERVED_METRICS", "TrainState",
    "abstract_train_state", "init_train_state", "make_optimizer", "make_schedule",
    "make_train_step", "process_batch_rows", "raise_if_nonfinite", "shard_batch",
]

Array = jax.Array
PyTree = Any
LossFn = Callable[[PyTree, PyTree, Array], tuple[Array, Mapping[str, Array]]]

# Metric names the step itself writes; a loss_fn may not reuse them.
RESERVED_METRICS = ("loss", "grad_norm", "lr", "finite", "loss_finite", "grads_finite",
                    "update_finite")


class LossWithFrozen(flax.struct.PyTreeNode):
  """A loss that reads arrays it never trains (a LoRA student's base,
  ``opd.training.lora_state``), for ``make_train_step``.

  The step passes ``frozen`` to its jitted program as an argument on the
  arrays' own shardings (never a compile-time constant, never donated, not in
  the ``TrainState`` nor its checkpoints) and differentiates only ``params``:
  ``fn(params, batch, rng, frozen) -> (loss, metrics)``.
  """
  fn: Callable = flax.struct.field(pytree_node=False)
  frozen: PyTree = None


class NonFiniteError(FloatingPointError):
  """A step produced a NaN/inf loss, gradient or updated parameter/optimizer
  state; its update was not applied."""

  def __init__(self, step: int, loss_finite: bool, grads_finite: bool, loss: float | None = None,
               update_finite: bool = True):
    self.step, self.loss = step, loss
    self.loss_finite, self.grads_finite = loss_finite, grads_finite
    self.update_finite = update_finite
    bad = [name for name, ok in (("loss", loss_finite), ("gradients", grads_finite)) if not ok]
    if not bad and not update_finite:  # an overflow in the update itself
      bad = ["updated parameters or optimizer state"]
    super().__init__(
        f"non-finite {' and '.join(bad) or 'values'} at step {step} (loss={loss}); the update "
        "was not applied and the state is the one from before this step")


# ---------------------------------------------------------------------------
# State.


class TrainState(flax.struct.PyTreeNode):
  """Everything a step changes, as one pytree (checkpointed whole).

  Attributes:
    step: int32 scalar, number of updates applied so far.
    params: fp32 master parameters.
    opt_state: the optimizer state (fp32 moments, sharded like the params).
    rng: uint32 ``[2]`` raw key data; step ``s`` uses ``fold_in(rng, s)``, so a
      resumed run draws the same randomness as an uninterrupted one.
  """
  step: Array
  params: PyTree
  opt_state: PyTree
  rng: Array


def _key_data(rng) -> Array:
  if isinstance(rng, (int, np.integer)):
    return jax.random.key_data(jax.random.key(int(rng)))
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  if rng.shape != (2,) or rng.dtype != jnp.uint32:
    raise ValueError(f"rng must be an int seed, a typed key or uint32[2] key data; got "
                     f"{rng.shape=} {rng.dtype=}")
  return rng


def _opt_state_shardings(abstract_opt, params_treedef, param_shardings, mesh):
  """Subtrees of the optimizer state shaped like the params (Adam's mu, nu)
  are sharded like the params; everything else (counts, hyperparams) is
  replicated."""
  def is_param_tree(x):
    return params_treedef.num_leaves > 1 and jax.tree.structure(x) == params_treedef

  rep = sharding_lib.replicated(mesh)
  return jax.tree.map(lambda x: param_shardings if is_param_tree(x) else rep, abstract_opt,
                      is_leaf=is_param_tree)


def _to_global(x, target, sharding: NamedSharding) -> Array:
  """Places a host (or device) array onto a global sharding in ``target.dtype``;
  works with several processes as long as each holds the full value."""
  if isinstance(x, jax.Array) and x.sharding == sharding and x.dtype == target.dtype:
    return x
  host = np.asarray(jax.device_get(x)).astype(target.dtype)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _init_fn(model):
  if isinstance(model, ModelConfig):
    return lambda r: init_params(model, r, boxed=True)
  if not callable(model):
    raise ValueError(f"model must be a ModelConfig or an init_fn(rng) -> boxed params, "
                     f"got {model!r}")
  return model


def _cast_floating(tree, dtype):
  if dtype is None:
    return tree
  return jax.tree.map(
      lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, tree)


def abstract_train_state(model: ModelConfig | Callable[[Array], PyTree],
                         optimizer: optax.GradientTransformation, mesh,
                         rules=sharding_lib.DEFAULT_RULES, *, master_dtype=jnp.float32):
  """Shapes and shardings of the ``TrainState`` without creating it.

  Returns ``(abstract_state, state_shardings)``: a ``TrainState`` of
  ``jax.ShapeDtypeStruct`` (with ``sharding``) — the target to restore a
  checkpoint onto without a random init first — and the same tree of
  ``NamedSharding``s. Arguments as for ``init_train_state``.
  """
  rules = sharding_lib.validate_rules(rules)
  init_fn = _init_fn(model)
  key = jax.random.key(0)
  logical = nn.get_partition_spec(jax.eval_shape(init_fn, key))
  abstract_params = jax.eval_shape(
      lambda k: _cast_floating(nn.meta.unbox(init_fn(k)), master_dtype), key)
  param_shardings = sharding_lib.tree_shardings(logical, abstract_params, mesh, rules)
  abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
  opt_shardings = _opt_state_shardings(abstract_opt, jax.tree.structure(abstract_params),
                                       param_shardings, mesh)
  rep = sharding_lib.replicated(mesh)
  shardings = TrainState(step=rep, params=param_shardings, opt_state=opt_shardings, rng=rep)
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                        opt_state=abstract_opt, rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return abstract, shardings


def init_train_state(model: ModelConfig | Callable[[Array], PyTree],
                     optimizer: optax.GradientTransformation, mesh,
                     rules=sharding_lib.DEFAULT_RULES, rng=0, *, params: PyTree | None = None,
                     master_dtype=jnp.float32, check_min_size: int | None = 2 ** 14,
                     compiler_options: dict | None = None):
  """Creates a sharded ``TrainState`` and its shardings.

  Args:
    model: a ``ModelConfig``, or ``init_fn(rng) -> params`` returning params
      boxed with logical axis names (``nn.with_logical_partitioning``).
    optimizer: e.g. ``make_optimizer(OptimConfig(...))``.
    mesh: a ``(data, fsdp, tensor)`` mesh from ``opd.parallel.sharding.make_mesh``.
    rules: logical → mesh axis rule table.
    rng: int seed or key. A random init uses it as is (the params equal
      ``init_params(cfg, jax.random.key(seed))`` on any mesh); it is also
      stored in the state as the base key of the per-step randomness.
    params: start from these (unboxed) params instead of a random init, e.g.
      a loaded HF checkpoint or a specialist; structure and shapes must match
      the model's. Host or device arrays; each process must hold the full value.
    master_dtype: floating params are stored in this dtype (None: as given).
    check_min_size: ``opd.parallel.sharding.check_sharded`` raises when a parameter
      with at least this many elements is left replicated on a mesh with
      fsdp*tensor > 1; None disables the check.
    compiler_options: XLA options for the init computation.

  Returns:
    ``(state, state_shardings)``: the state, created directly with its target
    shardings (parameters never exist unsharded on one device), and a
    ``TrainState`` of ``NamedSharding``s for ``make_train_step``.
  """
  init_fn = _init_fn(model)
  abstract, shardings = abstract_train_state(init_fn, optimizer, mesh, rules,
                                             master_dtype=master_dtype)
  key_data = _key_data(rng)

  def make_state(p, k):
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p), rng=k)

  rep = sharding_lib.replicated(mesh)
  key_data = _to_global(key_data, abstract.rng, rep)
  if params is None:
    create = jax.jit(
        lambda k: make_state(_cast_floating(nn.meta.unbox(init_fn(jax.random.wrap_key_data(k))),
                                            master_dtype), k),
        in_shardings=(rep,), out_shardings=shardings, compiler_options=compiler_options)
    state = create(key_data)
  else:
    params = nn.meta.unbox(params)
    check_same_tree(params, abstract.params)
    placed = jax.tree.map(_to_global, params, abstract.params, shardings.params)
    state = jax.jit(make_state, in_shardings=(shardings.params, rep), out_shardings=shardings,
                    compiler_options=compiler_options)(placed, key_data)
  if check_min_size is not None:
    sharding_lib.check_sharded(state.params, min_size=check_min_size)
  return state, shardings


def check_same_tree(given, expected) -> None:
  """ValueError naming the paths of ``expected`` missing from ``given`` and those
  it does not expect, or the first array of another shape (arrays or abstract values)."""
  def by_path(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

  g_paths, e_paths = by_path(given), by_path(expected)
  missing, extra = sorted(set(e_paths) - set(g_paths)), sorted(set(g_paths) - set(e_paths))
  if missing or extra:
    raise ValueError(f"params do not match the model: missing {missing}, unexpected {extra}")
  for name, e in e_paths.items():
    if tuple(np.shape(g_paths[name])) != tuple(e.shape):
      raise ValueError(f"params{name} has shape {tuple(np.shape(g_paths[name]))}, the model "
                       f"expects {tuple(e.shape)}")


# ---------------------------------------------------------------------------
# The step.


def _split_microbatches(x: Array, n: int, spec: P) -> Array:
  """``[B, ...] -> [n, B/n, ...]`` with microbatch i = rows i, i+n, i+2n, ...

  Strided rather than contiguous so that every device's block of rows
  splits locally: no data moves between devices.
  """
  B = x.shape[0]
  x = x.reshape((B // n, n) + x.shape[1:])
  x = jnp.swapaxes(x, 0, 1)
  return jax.lax.with_sharding_constraint(x, P(None, *spec))


def _injected_lr(opt_state) -> Array | None:
  """The ``learning_rate`` an ``optax.inject_hyperparams`` state holds (the
  rate its last update used), or None."""
  found = []
  is_inject = lambda x: isinstance(getattr(x, "hyperparams", None), dict)
  for node in jax.tree.leaves(opt_state, is_leaf=is_inject):
    if is_inject(node) and "learning_rate" in node.hyperparams:
      found.append(node.hyperparams["learning_rate"])
  return found[0] if len(found) == 1 else None


def _all_finite(tree) -> Array:
  """True when every floating value of ``tree`` is finite."""
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _grad_accum_steps(optimizer, requested: int | None) -> int:
  """N for ``make_train_step``: the optimizer's config, else ``requested``, else 1."""
  requested = check_int("make_train_step", "grad_accum_steps", requested, min_value=1,
                        allow_none=True)
  if not isinstance(optimizer, Optimizer):
    return 1 if requested is None else requested
  configured = optimizer.config.grad_accum_steps
  if requested is not None and requested != configured:
    raise ValueError(f"make_train_step got grad_accum_steps={requested} but the optimizer's "
                     f"OptimConfig.grad_accum_steps={configured}; set it in the OptimConfig only")
  return configured


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh,
                    state_shardings: TrainState, batch_shardings: PyTree | None = None, *,
                    rules=sharding_lib.DEFAULT_RULES, grad_accum_steps: int | None = None,
                    donate: bool = True, compiler_options: dict | None = None,
                    after_update: Callable[[PyTree, dict], tuple[PyTree, dict]] | None = None
                    ) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
  """Builds ``step(state, batch) -> (state, metrics)``, jitted with explicit shardings.

  Args:
    loss_fn: ``loss_fn(params, batch, rng) -> (loss, metrics)``; ``loss`` a
      scalar mean over the (micro)batch, ``metrics`` a dict of arrays that are
      averaged over microbatches. ``rng`` is a typed key, distinct per step
      and microbatch. A ``LossWithFrozen`` also gets its frozen arrays (an
      argument of the jitted step, which ``jitted_for(batch)`` then takes as
      ``(state, batch, frozen)``), with gradients for ``params`` only.
    optimizer: the transformation the state was created with; an
      ``Optimizer`` from ``make_optimizer`` also sets ``grad_accum_steps``.
    mesh: the mesh of ``state_shardings``.
    state_shardings: from ``init_train_state``.
    batch_shardings: pytree of ``NamedSharding`` matching the batch (or one
      for every leaf); None shards every leaf's leading dim over the
      ``batch`` rule.
    rules: logical → mesh rules, active while tracing so the model's
      ``with_logical_constraint`` calls take effect.
    grad_accum_steps: N microbatches per step; every leaf's batch dim B must
      satisfy B % N == 0 and (B / N) % batch_shards == 0. Gradients are the
      mean over microbatches, equal to the full-batch gradient when the loss
      is a mean over equally weighted rows. None (the default) takes N from
      ``optimizer.config.grad_accum_steps`` for an ``Optimizer`` and 1 for
      any other transformation; a value that differs from the optimizer's
      config raises (the config is the one source of N).
    donate: donate the input state's buffers (do not reuse it after a call).
    compiler_options: XLA options for the step's compilation.
    after_update: ``(params, metrics) -> (params, metrics)`` applied to the
      optimizer's updated params inside the step, outside the gradient (an
      MoE's selection-bias update: ``opd.models.moe_balance.bias_update_hook``);
      it may consume array-valued metrics. Skipped steps skip it too.

  Returns:
    ``step``. Its metrics (replicated, fp32) hold the loss_fn's metrics plus
    ``loss``, ``grad_norm`` (before clipping), ``lr`` (the rate used by this
    update, when the optimizer injects ``learning_rate``), ``finite``,
    ``loss_finite``, ``grads_finite`` and ``update_finite`` (every updated
    parameter and optimizer-state value finite). When ``finite`` is False the
    state is returned unchanged.
  """
  rules = sharding_lib.validate_rules(rules)
  frozen = loss_fn.frozen if isinstance(loss_fn, LossWithFrozen) else None
  if isinstance(loss_fn, LossWithFrozen):
    loss_fn = loss_fn.fn
  n_micro = _grad_accum_steps(optimizer, grad_accum_steps)
  rep = sharding_lib.replicated(mesh)
  param_shardings = state_shardings.params

  def check_outputs(loss, metrics):
    if jnp.shape(loss) != ():
      raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}")
    if not isinstance(metrics, Mapping):
      raise ValueError(f"loss_fn must return (loss, metrics dict), got metrics {type(metrics)}")
    clash = sorted(set(metrics) & set(RESERVED_METRICS))
    if clash:
      raise ValueError(f"loss_fn metrics use reserved names {clash}; reserved: {RESERVED_METRICS}")
    return metrics

  def compute_grads(params, batch, key, batch_specs, fixed):
    def checked_loss(params, batch, key):
      out = loss_fn(params, batch, key) if frozen is None else loss_fn(params, batch, key, fixed)
      loss, metrics = out
      return loss, dict(check_outputs(loss, metrics))

    grad_fn = jax.value_and_grad(checked_loss, has_aux=True)
    if n_micro == 1:
      (loss, metrics), grads = grad_fn(params, batch, key)
      return loss, metrics, grads

    def split(path, x, spec):
      B = x.shape[0]
      if B % n_micro:
        raise ValueError(f"batch{jax.tree_util.keystr(path)} has {x.shape=}; batch dim {B} is not "
                         f"divisible by grad_accum_steps={n_micro}")
      shards = batch_shard_count(NamedSharding(mesh, spec))
      if (B // n_micro) % shards:
        raise ValueError(f"batch{jax.tree_util.keystr(path)}: microbatch size {B // n_micro} "
                         f"(B={B} / grad_accum_steps={n_micro}) is not divisible by the {shards} "
                         "batch shards of the mesh")
      return _split_microbatches(x, n_micro, spec)

    micro = jax.tree_util.tree_map_with_path(split, batch, batch_specs)
    first = jax.tree.map(lambda x: x[0], micro)
    _, metric_shapes = jax.eval_shape(checked_loss, params, first, key)
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)
    grad_zero = jax.lax.with_sharding_constraint(
        jax.tree.map(jnp.zeros_like, params), param_shardings)

    def body(carry, xs):
      i, mb = xs
      g_acc, l_acc, m_acc = carry
      (loss, metrics), grads = grad_fn(params, mb, jax.random.fold_in(key, i))
      g_acc = jax.tree.map(jnp.add, g_acc, grads)
      m_acc = jax.tree.map(lambda a, m: a + m.astype(jnp.float32), m_acc, dict(metrics))
      return (g_acc, l_acc + loss.astype(jnp.float32), m_acc), None

    init = (grad_zero, jnp.zeros((), jnp.float32), zeros(dict(metric_shapes)))
    (g_sum, l_sum, m_sum), _ = jax.lax.scan(body, init, (jnp.arange(n_micro), micro))
    scale = 1.0 / n_micro
    return (l_sum * scale, jax.tree.map(lambda m: m * scale, m_sum),
            jax.tree.map(lambda g: g * scale, g_sum))

  def step_impl(state: TrainState, batch, batch_specs, fixed=None):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    loss, user_metrics, grads = compute_grads(state.params, batch, key, batch_specs, fixed)
    loss = loss.astype(jnp.float32)
    grads = jax.lax.with_sharding_constraint(grads, param_shardings)
    grad_norm = optax.tree.norm(grads)
    loss_ok, grads_ok = jnp.isfinite(loss), jnp.isfinite(grad_norm)
    ok = loss_ok & grads_ok
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                        opt_state=new_opt)
    if after_update is not None:
      new_params, user_metrics = after_update(new.params, user_metrics)
      new = new.replace(params=new_params)
    update_ok = _all_finite((new.params, new.opt_state))
    ok = ok & update_ok
    # Discard the whole update (step count, moments, params) on NaN/inf.
    out = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in user_metrics.items()}
    metrics.update(loss=loss, grad_norm=grad_norm, finite=ok, loss_finite=loss_ok,
                   grads_finite=grads_ok, update_finite=update_ok)
    lr = _injected_lr(new_opt)
    if lr is not None:
      metrics["lr"] = jnp.asarray(lr, jnp.float32)
    return out, metrics

  compiled: dict[Any, Callable] = {}

  def jitted_for(batch):
    key = jax.tree.structure(batch), tuple(np.ndim(x) for x in jax.tree.leaves(batch))
    if batch_shardings is None:
      shard = jax.tree.map(lambda x: sharding_lib.batch_sharding(mesh, rules, np.ndim(x)), batch)
    elif isinstance(batch_shardings, NamedSharding):
      shard = jax.tree.map(lambda x: batch_shardings, batch)
    else:
      shard = batch_shardings
    if key not in compiled:
      specs = jax.tree.map(lambda s: s.spec, shard)
      if frozen is not None:
        compiled[key] = jax.jit(
            lambda state, batch, fixed: step_impl(state, batch, specs, fixed),
            in_shardings=(state_shardings, shard, jax.tree.map(lambda x: x.sharding, frozen)),
            out_shardings=(state_shardings, rep), donate_argnums=(0,) if donate else (),
            compiler_options=compiler_options)
        return compiled[key]
      impl = lambda state, batch: step_impl(state, batch, specs)
      compiled[key] = jax.jit(impl, in_shardings=(state_shardings, shard),
                              out_shardings=(state_shardings, rep),
                              donate_argnums=(0,) if donate else (),
                              compiler_options=compiler_options)
    return compiled[key]

  def step(state: TrainState, batch) -> tuple[TrainState, dict]:
    fn = jitted_for(batch)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return fn(state, batch) if frozen is None else fn(state, batch, frozen)

  step.jitted_for = jitted_for  # exposed for lowering / cost analysis
  return step


def raise_if_nonfinite(metrics: Mapping[str, Any], step: int) -> None:
  """Raises ``NonFiniteError`` naming ``step`` if the step's update was skipped."""
  if bool(np.asarray(metrics["finite"])):
    return
  loss = float(np.asarray(metrics["loss"]))
  raise NonFiniteError(step, bool(np.asarray(metrics["loss_finite"])),
                       bool(np.asarray(metrics["grads_finite"])), loss,
                       bool(np.asarray(metrics.get("update_finite", True))))
