"""opd.training.lora_state: a LoRA student's train step (frozen bf16 base, adapter-only moments)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.models import ModelConfig, init_params
from opd.models.lora import TARGETS, LoRAConfig, lora_apply, lora_loss, lora_param_count
from opd.parallel.sharding import make_mesh
from opd.training.lora_state import LoRAStudent, export_params, init_lora_train_state
from opd.training.objectives import next_token_loss
from opd.training.optim import OptimConfig, make_optimizer
from opd.training.train_step import LossWithFrozen, make_train_step

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=48, qk_norm=True)
LORA = LoRAConfig(rank=3, alpha=6.0)


def _matrix(x, n_in):
  x = np.asarray(x, np.float64)
  return x.reshape(math.prod(x.shape[:n_in]), -1)


def test_step_changes_only_adapters_and_keeps_no_base_moments():
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  base = init_params(CFG, jax.random.key(0))
  optimizer = make_optimizer(OptimConfig(lr=1e-2, grad_accum_steps=2))
  state, shardings, frozen = init_lora_train_state(CFG, LORA, optimizer, mesh, base_params=base,
                                                   rng=1, check_min_size=None)
  base_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), frozen, base_bf16)
  n_lora = lora_param_count(CFG, LORA)
  # The state holds the adapters alone: their params and Adam's mu and nu.
  assert sum(x.size for x in jax.tree.leaves(state.params)) == n_lora
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  assert moments == 2 * n_lora
  step = make_train_step(LossWithFrozen(lora_loss(next_token_loss(CFG), LORA), frozen),
                         optimizer, mesh, shardings, donate=False)
  tokens = jax.random.randint(jax.random.key(3), (4, 9), 0, CFG.vocab_size)
  new = state
  for _ in range(2):  # two microbatches each
    new, metrics = step(new, {"tokens": tokens})
    assert bool(metrics["finite"])
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), frozen, base_bf16)
  assert np.abs(np.asarray(new.params["layers_0"]["attn"]["q"]["b"])).max() > 0
  merged = export_params(LoRAStudent(base, LORA), new.params)
  np.testing.assert_array_equal(  # export = the adapted params the loss saw
      np.asarray(merged["layers_1"]["mlp"]["down"]),
      np.asarray(lora_apply(base_bf16, new.params, LORA)["layers_1"]["mlp"]["down"]))
  for name, (module, n_in, _) in TARGETS.items():
    delta = _matrix(lora_apply(base, new.params, LORA)["layers_0"][module][name],
                    n_in) - _matrix(base["layers_0"][module][name], n_in)
    assert 0 < np.linalg.matrix_rank(delta, tol=1e-7) <= LORA.rank < min(delta.shape)


def test_wrong_base_is_refused():
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  base = init_params(CFG.replace(d_ff=40), jax.random.key(0))
  needle = r"params\['base'\]\['layers_0'\]\['mlp'\]\['\w+'\] has shape \(40, 32\)"
  with pytest.raises(ValueError, match=needle):
    init_lora_train_state(CFG, LORA, make_optimizer(OptimConfig()), mesh, base_params=base,
                          check_min_size=None)
