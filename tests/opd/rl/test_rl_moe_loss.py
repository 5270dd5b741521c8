"""The GRPO loss of an MoE policy adds the model's balance terms and router metrics."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from opd.models import ModelConfig, MoEConfig, forward, init_params, moe_balance
from opd.rl import GRPOConfig
from opd.rl.loss import make_grpo_loss

MOE = MoEConfig(n_routed_experts=4, experts_per_token=2, moe_d_ff=16, aux_loss_coef=0.1,
                seq_aux_loss_coef=0.05)
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  moe=MOE)


def test_grpo_loss_adds_the_moe_balance_terms():
  params = init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32)
  mask = jnp.asarray(np.arange(6)[None] >= np.array([[0], [2]]))  # row 1 left-padded
  batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1), "mask": mask,
           "loss_mask": mask, "old_logprobs": jnp.full((2, 6), -4.0),
           "advantages": jnp.array([1.0, -0.5])}
  gcfg = GRPOConfig(kl_coef=0.0)
  loss, metrics = make_grpo_loss(CFG, gcfg)(params, batch, None)
  no_balance = CFG.replace(moe=dataclasses.replace(MOE, aux_loss_coef=0.0,
                                                   seq_aux_loss_coef=0.0))
  plain, plain_metrics = make_grpo_loss(no_balance, gcfg)(params, batch, None)
  want = moe_balance.aux_loss(MOE, forward(CFG, params, tokens, None, mask).moe)
  assert float(want) > 0
  # loss - plain is the balance term up to the fp32 rounding of the sum (|loss| ~ 1).
  np.testing.assert_allclose(float(loss - plain), float(want), atol=8 * 1.2e-7)
  np.testing.assert_allclose(float(metrics["moe/aux_loss"]), float(want), rtol=1e-6)
  assert float(plain_metrics["moe/aux_loss"]) == 0.0
  assert int(metrics["moe/dropped"]) == 0 and "moe/load/e3" in metrics
