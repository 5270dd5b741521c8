"""An MoE student through lm_loss and make_train_step: balance terms, router metrics, and
DeepSeek-V3's selection-bias update applied after the optimizer, outside the gradient."""
import jax
import jax.numpy as jnp
import numpy as np

from opd.models import ModelConfig, MoEConfig, forward, moe_balance
from opd.parallel import sharding
from opd.training.objectives import lm_loss
from opd.training.train_step import (OptimConfig, init_train_state, make_optimizer,
                                     make_train_step, shard_batch)

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  moe=MoEConfig(n_routed_experts=4, experts_per_token=2, moe_d_ff=16,
                                router="sigmoid", n_shared_experts=1, first_k_dense=1,
                                seq_aux_loss_coef=0.01, bias_update_rate=0.05))


def _batch(seed=0, B=4, T=8):
  rng = np.random.default_rng(seed)
  seq = rng.integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[0, :3] = False  # a left-padded row
  return {"tokens": seq[:, :-1], "targets": seq[:, 1:], "mask": mask,
          "loss_mask": mask.copy()}


def test_bias_update_hook_after_the_optimizer():
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  optimizer = make_optimizer(OptimConfig(lr=1e-2, weight_decay=0.1))
  state, shardings = init_train_state(CFG, optimizer, mesh, rng=0, check_min_size=None)
  hook = moe_balance.bias_update_hook(CFG)
  assert moe_balance.bias_update_hook(CFG.replace(moe=None)) is None
  step = make_train_step(lm_loss(CFG), optimizer, mesh, shardings, after_update=hook,
                         donate=False)
  batch = _batch()
  before = jax.device_get(state.params)
  out = forward(CFG, before, batch["tokens"], None, batch["mask"])
  new_state, metrics = step(state, shard_batch(batch, mesh))
  assert bool(metrics["finite"])

  # Router statistics are logged as scalars; the counts array was consumed.
  assert moe_balance.COUNTS_KEY not in metrics
  assert all(np.shape(v) == () for v in metrics.values())
  assert int(metrics["moe/dropped"]) == 0 and float(metrics["moe/entropy"]) > 0
  loads = [float(metrics[f"moe/load/e{e}"]) for e in range(4)]
  np.testing.assert_allclose(sum(loads), 4.0, rtol=1e-6)  # shares x E sum to E
  # The reported balance term is the model's, at the pre-step params.
  np.testing.assert_allclose(float(metrics["moe/aux_loss"]),
                             float(moe_balance.aux_loss(CFG.moe, out.moe)), rtol=1e-5)

  # The bias moved by exactly γ·sign(mean - load) from the pre-step forward's
  # counts: the optimizer left it alone (zero gradient, no decay on 1-D).
  after = jax.device_get(new_state.params)
  counts = np.asarray(out.moe.counts[0])
  want = 0.05 * np.sign(counts.mean() - counts)
  assert np.any(want != 0)  # the constructed batch is imbalanced
  np.testing.assert_allclose(after["layers_1"]["mlp"]["selection_bias"], want, atol=1e-7)
  # ...while the router itself was trained.
  assert not np.allclose(after["layers_1"]["mlp"]["router"], before["layers_1"]["mlp"]["router"])
  g = jax.grad(lambda p: lm_loss(CFG)(p, {k: jnp.asarray(v) for k, v in batch.items()},
                                      None)[0])(before)
  assert np.all(np.asarray(g["layers_1"]["mlp"]["selection_bias"]) == 0)
