"""The DeepSeek-V4 family member (``ModelConfig.v4``) under the shared training code:
the LM loss (plain and fused head) trains it, gradients reach every trainable
parameter, and the sharded step on 8 fake CPU devices equals the single-device one
(tolerances as tests/opd/training/test_train_step.py, derived there)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from opd.models import init_params
from opd.parallel import sharding
from opd.training.objectives import lm_loss, next_token_loss
from opd.training.train_step import (OptimConfig, init_train_state, make_optimizer,
                                     make_train_step, shard_batch)
from v4_family import tiny_v4

CFG = tiny_v4()
FAST = {"xla_backend_optimization_level": 0}
OPT = OptimConfig(lr=1e-2)
B, T, STEPS = 8, 16, 6  # T > W = 8; 4 CSA and 2 HCA windows
EPS32 = float(np.finfo(np.float32).eps)


def _tokens():
  """Rows of a period-5 cycle at random offsets: learnable in a few steps."""
  rng = np.random.default_rng(0)
  start = rng.integers(0, 5, (B, 1))
  vocab = rng.permutation(CFG.vocab_size)[:5]
  return vocab[(start + np.arange(T + 1)) % 5].astype(np.int32)


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _capture_grads():
  """Passes the gradients on and keeps them in its (param-sharded) state."""
  return optax.GradientTransformation(init=lambda p: jax.tree.map(jnp.zeros_like, p),
                                      update=lambda g, s, p=None: (g, g))


def _train(mesh, params=None):
  optimizer = optax.chain(_capture_grads(), make_optimizer(OPT))
  state, shardings = init_train_state(CFG, optimizer, mesh, rng=0, params=params,
                                      compiler_options=FAST)
  init = _host(state.params)
  step = make_train_step(next_token_loss(CFG), optimizer, mesh, shardings,
                         compiler_options=FAST)
  losses, grads = [], None
  for _ in range(STEPS):
    state, m = step(state, shard_batch({"tokens": _tokens()}, mesh, sharding.DEFAULT_RULES))
    losses.append(float(m["loss"]))
    grads = _host(state.opt_state[0]) if grads is None else grads
  return dict(state=state, losses=np.asarray(losses), grads=grads, init=init,
              params=_host(state.params), metrics=_host(m))


@pytest.fixture(scope="module")
def single():
  return _train(sharding.make_mesh((1, 1, 1), jax.devices()[:1]))


def test_lm_loss_falls_and_is_finite(single):
  losses = single["losses"]
  print("V4 LM loss over steps:", losses)
  assert np.all(np.isfinite(losses))
  # From ~ln V = 4.16 nats; a period-5 cycle is learnable: the loss must fall clearly.
  assert losses[-1] < 0.8 * losses[0] and np.all(np.diff(losses[-3:]) < 0)
  m = single["metrics"]
  assert math.isfinite(float(m["moe/aux_loss"])) and float(m["moe/aux_loss"]) > 0
  # The hash table is not trained: the step leaves it bit for bit.
  np.testing.assert_array_equal(single["params"]["layers_0"]["mlp"]["tid2eid"],
                                single["init"]["layers_0"]["mlp"]["tid2eid"])


def test_gradients_reach_every_trainable_param(single):
  """Every param gets a gradient except by design: the hash table and the selection
  bias (selection only) and CSA's lightning indexer (discrete top-k; as transformers)."""
  flat = jax.tree_util.tree_flatten_with_path(single["grads"])[0]
  frozen = lambda path: ("tid2eid" in path or "selection_bias" in path or "indexer" in path)
  checked = 0
  for keys, g in flat:
    path = jax.tree_util.keystr(keys)
    if frozen(path):
      assert np.max(np.abs(g)) == 0.0, path
    else:
      assert np.max(np.abs(g)) > 0.0, path
      checked += 1
  assert checked > 40 and any("compressor" in jax.tree_util.keystr(k) for k, _ in flat)


def test_fused_head_loss_equals_plain_loss(single):
  # The fused loss reads hidden states and head_matrix (the OPD / hidden-state path).
  # Same CE in another summation order: |Δ| <~ sqrt(V) eps · max|logit| + the same for the
  # per-token mean over B·T tokens, both << 1e-5 · loss here.
  tokens = jnp.asarray(_tokens())
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((B, T), bool),
           "loss_mask": jnp.ones((B, T), jnp.float32)}
  params = jax.tree.map(jnp.asarray, single["init"])
  plain, _ = jax.jit(lm_loss(CFG))(params, batch, None)
  fused, _ = jax.jit(lm_loss(CFG, fused=True))(params, batch, None)
  np.testing.assert_allclose(float(fused), float(plain), rtol=1e-5)


def test_sharded_step_matches_single_device(single):
  # A (2, 2, 2) mesh reorders the token sums (data/fsdp) and the head/MoE/attention
  # contractions (tensor): ~sqrt(n) eps relative with n = B·T·V terms, four-fold over the
  # backward's chained sums (test_train_step.py's derivation); a wiring error (a dropped
  # reduction, a lost token) is >= 1/(B·T) ~ 8e-3.
  run = _train(sharding.make_mesh((2, 2, 2)), single["init"])
  rtol = math.sqrt(B * T * CFG.vocab_size) * EPS32
  np.testing.assert_allclose(run["losses"][0], single["losses"][0], rtol=rtol)
  num = math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in
                      zip(jax.tree.leaves(run["grads"]), jax.tree.leaves(single["grads"]))))
  den = math.sqrt(sum(float(np.sum(b ** 2)) for b in jax.tree.leaves(single["grads"])))
  assert num / den < 4 * rtol
  # Adam's normalised step is <= lr · A_t per element whatever the gradient (A_1 = 1,
  # A_t <= sqrt(Σ w_i²/u_i) ~ 3 for t <= 6 at b1 = 0.9, b2 = 0.999), so two runs from equal
  # params differ by at most Σ_t 2 lr A_t; a mis-sharded moment breaks it.
  b1, b2 = OPT.b1, OPT.b2
  bound = sum(2 * OPT.lr * math.sqrt(sum(((1 - b1) * b1 ** (t - i) / (1 - b1 ** t)) ** 2
                                         / ((1 - b2) * b2 ** (t - i) / (1 - b2 ** t))
                                         for i in range(1, t + 1)))
              for t in range(1, STEPS + 1))
  diff = max(float(np.max(np.abs(a - b))) for a, b in
             zip(jax.tree.leaves(run["params"]), jax.tree.leaves(single["params"])))
  assert diff <= bound
  # The embedding and the experts really are split over the mesh.
  p = run["state"].params
  assert not p["embedding"].sharding.is_fully_replicated
  assert not p["layers_1"]["mlp"]["gate"].sharding.is_fully_replicated


def test_init_params_fill_the_hash_table():
  params = init_params(CFG, jax.random.key(0))
  table = np.asarray(params["layers_0"]["mlp"]["tid2eid"]).reshape(CFG.vocab_size, 2)
  t, j = np.arange(CFG.vocab_size)[:, None], np.arange(2)[None]
  np.testing.assert_array_equal(table, (t * 2 + j) % 8)  # (t·k + j) mod E
