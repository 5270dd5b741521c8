"""grm.shared: the joint rule-RL + meta-BCE loss of the shared-backbone GRM,
checked against the two losses computed separately."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grm.shared import meta_labels_from_rewards, shared_loss_fn
from opd.models import ModelConfig, forward, init_params
from opd.rl import GRPOConfig
from opd.rl.loss import make_grpo_loss
from opd.training.loop_config import LoopConfig, Runtime

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  scalar_head=True)
GRPO = GRPOConfig(group_size=2, prompts_per_step=2, max_new_tokens=6, seq_len=12, kl_coef=0.05)
B, L, W = 4, 12, 0.7


def _batch():
  rng = np.random.default_rng(0)
  lengths = np.array([12, 9, 7, 10])
  mask = np.arange(L)[None] < lengths[:, None]
  tokens = np.where(mask, rng.integers(1, CFG.vocab_size, (B, L)), 0).astype(np.int32)
  targets = np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], 1)
  loss_mask = mask & (np.arange(L)[None] >= 4) & (np.arange(L)[None] < lengths[:, None] - 1)
  return {"tokens": tokens, "targets": targets, "mask": mask, "loss_mask": loss_mask,
          "old_logprobs": (-4.0 + 0.1 * rng.standard_normal((B, L))).astype(np.float32),
          "ref_logprobs": (-4.0 + 0.1 * rng.standard_normal((B, L))).astype(np.float32),
          "advantages": np.array([1.0, -1.0, 0.5, -0.5], np.float32),
          "meta_labels": meta_labels_from_rewards([1, -1, -1, 1])}, lengths


def _meta_reference(params, batch, lengths):
  """BCE of the value head at each row's last real token, gathered by index."""
  values = forward(CFG, params, batch["tokens"], mask=batch["mask"], return_logits=False).values
  m = values[jnp.arange(B), lengths - 1]
  y = batch["meta_labels"]
  return -jnp.mean(y * jax.nn.log_sigmoid(m) + (1 - y) * jax.nn.log_sigmoid(-m))


def _global_norm(tree):
  return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2)
                           for x in jax.tree.leaves(tree))))


def test_joint_loss_and_gradients_are_rl_plus_weighted_meta_bce():
  params = init_params(CFG, jax.random.key(0))
  batch, lengths = _batch()
  rl_batch = {k: v for k, v in batch.items() if k != "meta_labels"}
  rl_fn, joint_fn = make_grpo_loss(CFG, GRPO), shared_loss_fn(CFG, GRPO, W)

  joint, metrics = joint_fn(params, batch, None)
  rl = rl_fn(params, rl_batch, None)[0]
  meta = _meta_reference(params, batch, lengths)
  # Sums of <= D*F terms per stage; the two BCE forms (softplus - y m vs
  # log-sigmoid) agree to a few eps of |m| + log 2 ~ 1: 1e-6 absolute.
  assert float(metrics["meta_bce"]) == pytest.approx(float(meta), abs=1e-6)
  assert float(joint) == pytest.approx(float(rl) + W * float(meta), abs=1e-6)

  g_joint = jax.grad(lambda p: joint_fn(p, batch, None)[0])(params)
  g_rl = jax.grad(lambda p: rl_fn(p, rl_batch, None)[0])(params)
  g_meta = jax.grad(lambda p: _meta_reference(p, batch, lengths))(params)
  # The heads are separate: no policy-loss gradient reaches the value head,
  # and no BCE gradient reaches the LM head (exact zeros).
  assert not np.any(np.asarray(g_rl["value_head"])) and not np.any(np.asarray(g_rl["value_bias"]))
  assert not np.any(np.asarray(g_meta["lm_head"]))
  assert _global_norm(g_meta["layers_0"]) > 0 and _global_norm(g_rl["layers_0"]) > 0
  ref = jax.tree.map(lambda a, b: a + W * b, g_rl, g_meta)
  diff = jax.tree.map(lambda a, b: a - b, g_joint, ref)
  # Same math in a different summation order: each gradient element moves by
  # ~sqrt(n)·eps of the gradient scale (n <= B·L·F = 3072 terms, 2 layers in
  # quadrature): sqrt(2·3072)·1.2e-7 ≈ 1e-5 relative to the global norm.
  assert _global_norm(diff) <= 1e-5 * _global_norm(ref)
  # And the weight matters: w = 0 leaves only the RL gradient.
  g0 = jax.grad(lambda p: shared_loss_fn(CFG, GRPO, 0.0)(p, batch, None)[0])(params)
  assert _global_norm(jax.tree.map(lambda a, b: a - b, g0, g_rl)) <= 1e-5 * _global_norm(g_rl)


def test_bad_inputs():
  with pytest.raises(ValueError, match="scalar_head"):
    shared_loss_fn(CFG.replace(scalar_head=False), GRPO, 1.0)
  with pytest.raises(ValueError, match="meta_weight"):
    shared_loss_fn(CFG, GRPO, -1.0)
  batch, _ = _batch()
  params = init_params(CFG, jax.random.key(0))
  with pytest.raises(ValueError, match="meta_labels"):
    shared_loss_fn(CFG, GRPO, 1.0)(params, {k: v for k, v in batch.items()
                                            if k != "meta_labels"}, None)
  with pytest.raises(ValueError, match="rewards"):
    meta_labels_from_rewards([[1.0]])
  np.testing.assert_array_equal(meta_labels_from_rewards([1, -1, 0.5]), [1, 0, 1])


def test_shared_trainer_feeds_its_own_judgements_labels_to_the_joint_loss(monkeypatch):
  """``train_shared_rule_rl``: each rollout batch carries labels = (rule reward
  > 0) of its own judgements; the logged first-step ``meta_bce`` equals the
  BCE recomputed here from the initial params on the recorded batch; the
  value head moves with w > 0 and stays exactly put with w = 0 (no weight
  decay, zero gradient → zero Adam update)."""
  import grm.shared as shared
  from opd.parallel import sharding
  from opd.rl import grpo as grpo_module
  from opd.text.tokenizers import ByteTokenizer
  from opd.training.train_step import OptimConfig
  from tests.grm.test_grm_training import _groups

  tok = ByteTokenizer()
  cfg = CFG.replace(vocab_size=tok.vocab_size)
  grpo = GRPOConfig(group_size=2, prompts_per_step=2, max_new_tokens=8, seq_len=640,
                    kl_coef=0.01, updates_per_batch=1)
  optim = OptimConfig(lr=1e-2, weight_decay=0.0)
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  params = init_params(cfg, jax.random.key(1))
  seen, extras_seen = [], []
  real_step, real_extras = grpo_module.make_train_step, shared._meta_label_extras

  def recording_step(*args, **kwargs):
    step = real_step(*args, **kwargs)

    def recorded(state, batch):
      seen.append(jax.device_get({k: batch[k] for k in ("tokens", "mask", "meta_labels")}))
      return step(state, batch)
    return recorded

  def recording_extras(episodes, rewards):
    extras_seen.append(np.asarray(rewards))
    return real_extras(episodes, rewards)

  monkeypatch.setattr(grpo_module, "make_train_step", recording_step)
  monkeypatch.setattr(shared, "_meta_label_extras", recording_extras)

  def run(w):
    return shared.train_shared_rule_rl(cfg, params, _groups()[:4], grpo, optim,
                                       LoopConfig(1, progress=False),
                                       runtime=Runtime(mesh, sharding.DEFAULT_RULES,
                                                       tokenizer=tok),
                                       meta_weight=w)

  trained = run(1.0)
  (batch,), (rewards,) = seen, extras_seen
  assert set(np.unique(rewards)) <= {-1.0, 1.0}
  np.testing.assert_array_equal(batch["meta_labels"], (rewards > 0).astype(np.float32))
  lengths = batch["mask"].sum(1)
  values = forward(cfg, params, batch["tokens"], mask=batch["mask"], return_logits=False).values
  m = np.asarray(values, np.float64)[np.arange(len(lengths)), lengths - 1]
  y = batch["meta_labels"]
  want = np.mean(np.logaddexp(0, m) - y * m)  # BCE with logits, float64
  # float32 forward over D = 32 features, one mean of B terms: 1e-5 absolute
  # at a BCE of order log 2.
  assert trained.history[0]["train/meta_bce"] == pytest.approx(want, abs=1e-5)
  moved = np.abs(np.asarray(trained.state.params["value_head"]) - params["value_head"]).max()
  assert moved > 0
  still = run(0.0)
  np.testing.assert_array_equal(np.asarray(still.state.params["value_head"]),
                                np.asarray(params["value_head"]))
