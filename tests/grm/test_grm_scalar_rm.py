"""grm.scalar_rm / grm.meta_rm: BT and BCE losses against torch, batching, and a tiny RM that learns."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from grm.meta_rm import add_scalar_head, binary_cross_entropy, meta_loss_fn
from grm.scalar_rm import (bradley_terry_loss, bt_loss_fn, pair_batch, score_sequences,
                           sequence_rewards, train_reward_model)
from opd.models import ModelConfig, forward, init_params
from opd.parallel import sharding
from opd.training.loop_config import LoopConfig, Runtime
from opd.training.optim import OptimConfig

EPS32 = float(np.finfo(np.float32).eps)
CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                  scalar_head=True)


def _float32_bound(terms: np.ndarray, magnitudes: np.ndarray) -> float:
  """Error of a float32 mean of per-term results: each term carries a few
  roundings relative to its magnitude (the input difference, exp/log1p), and
  the mean of B terms adds sqrt(B)·eps relative to the mean |term|."""
  B = terms.size
  return 4 * EPS32 * float(np.mean(magnitudes)) + math.sqrt(B) * EPS32 * float(np.mean(np.abs(terms)))


def test_bradley_terry_loss_and_grad_match_torch():
  rng = np.random.default_rng(0)
  rc = rng.normal(0, 3, 64).astype(np.float32)
  rr = rng.normal(0, 3, 64).astype(np.float32)
  loss, (gc, gr) = jax.value_and_grad(bradley_terry_loss, argnums=(0, 1))(jnp.asarray(rc),
                                                                           jnp.asarray(rr))
  tc = torch.tensor(rc, dtype=torch.float64, requires_grad=True)
  tr = torch.tensor(rr, dtype=torch.float64, requires_grad=True)
  ref = -torch.nn.functional.logsigmoid(tc - tr).mean()
  ref.backward()
  terms = -torch.nn.functional.logsigmoid(tc - tr).detach().numpy()
  tol = _float32_bound(terms, np.abs(rc) + np.abs(rr) + terms)
  assert abs(float(loss) - ref.item()) <= tol
  # d/dr+ = -sigmoid(r- - r+) / B: each element one sigmoid of a rounded difference.
  gtol = 4 * EPS32 * (np.abs(rc) + np.abs(rr) + 1) / rc.size
  assert np.all(np.abs(np.asarray(gc) - tc.grad.numpy()) <= gtol)
  assert np.all(np.abs(np.asarray(gr) - tr.grad.numpy()) <= gtol)


def test_binary_cross_entropy_matches_torch():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 4, 64).astype(np.float32)
  labels = (rng.random(64) < 0.4).astype(np.float32)
  loss = binary_cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
  t = torch.nn.functional.binary_cross_entropy_with_logits(
      torch.tensor(logits, dtype=torch.float64), torch.tensor(labels, dtype=torch.float64),
      reduction="none").numpy()
  assert abs(float(loss) - t.mean()) <= _float32_bound(t, np.abs(logits) + t)


def _rows(rng, n, lengths):
  # Few distinct lengths: each one compiles its own unpadded reference forward.
  return [rng.integers(0, CFG.vocab_size, size=rng.choice(lengths)) for _ in range(n)]


def test_losses_read_each_row_at_its_last_real_token():
  """bt_loss_fn / meta_loss_fn on padded batches equal the losses of per-row,
  unpadded forwards (the reward at the last position)."""
  params = init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(2)
  chosen, rejected = _rows(rng, 6, (3, 12)), _rows(rng, 6, (3, 12))

  fwd = jax.jit(lambda p, t: forward(CFG, p, t, mask=jnp.ones(t.shape, bool)))

  def single(row):
    out = fwd(params, jnp.asarray(row)[None])
    return float(out.values[0, -1])

  rc = np.array([single(r) for r in chosen])
  rr = np.array([single(r) for r in rejected])
  batch = pair_batch(chosen, rejected, seq_len=16, pad_id=0)
  loss, metrics = jax.jit(bt_loss_fn(CFG))(params, batch, None)
  ref = torch.nn.functional.softplus(torch.tensor(rr - rc, dtype=torch.float64)).numpy()
  # Padded vs unpadded forwards reorder float32 sums over <= 16 keys and D = 32
  # widths through 2 layers: a relative 1e-5 of the value scale bounds it with
  # room (sqrt(16 * 32 * 2) * eps ≈ 4e-6), and the loss inherits it.
  scale = np.abs(rc).max() + np.abs(rr).max() + 1
  assert abs(float(loss) - ref.mean()) <= 1e-5 * scale
  np.testing.assert_allclose(np.asarray(score_sequences(CFG, params, chosen, seq_len=16, pad_id=0,
                                                        batch_size=4)), rc, atol=1e-5 * scale)
  # Length-bucketed batches (rows sorted by length, each batch cut to its longest
  # rounded up to 4) read the same last-token values, in the given order.
  np.testing.assert_allclose(np.asarray(score_sequences(CFG, params, chosen, seq_len=16, pad_id=0,
                                                        batch_size=4, length_bucket=4)),
                             rc, atol=1e-5 * scale)
  # A float32 mean of six 0/1 values: one or two roundings of the quotient.
  np.testing.assert_allclose(float(metrics["accuracy"]), np.mean(rc > rr), rtol=2 * EPS32)

  labels = np.array([1, 0, 1, 1, 0, 0], np.float32)
  meta = {"tokens": batch["chosen_tokens"], "mask": batch["chosen_mask"], "labels": labels}
  mloss, _ = jax.jit(meta_loss_fn(CFG))(params, meta, None)
  mref = torch.nn.functional.binary_cross_entropy_with_logits(
      torch.tensor(rc), torch.tensor(labels, dtype=torch.float64))
  assert abs(float(mloss) - mref.item()) <= 1e-5 * scale


def test_scalar_head_is_required_and_can_be_added():
  plain = CFG.replace(scalar_head=False)
  with pytest.raises(ValueError, match="scalar_head"):
    bt_loss_fn(plain)
  params = init_params(plain, jax.random.key(0))
  cfg, with_head = add_scalar_head(plain, params, jax.random.key(1))
  assert cfg.scalar_head and with_head["value_head"].shape == (CFG.d_model, 1)
  assert with_head["embedding"] is params["embedding"]
  tokens = jnp.arange(8)[None] % CFG.vocab_size
  np.testing.assert_array_equal(forward(cfg, with_head, tokens).logits,
                                forward(plain, params, tokens).logits)


GOOD = CFG.vocab_size // 2  # tokens < GOOD are "good"


def _preference_pairs(rng, n, T=10):
  """Pairs of random length-T rows whose counts of good tokens differ by >= 3;
  the row with more good tokens is preferred (a separable rule)."""
  chosen, rejected = [], []
  while len(chosen) < n:
    g = rng.integers(0, T + 1, size=2)
    if abs(int(g[0]) - int(g[1])) < 3:
      continue
    rows = []
    for count in g:
      good = rng.integers(0, GOOD, size=count)
      bad = rng.integers(GOOD, CFG.vocab_size, size=T - count)
      rows.append(rng.permutation(np.concatenate([good, bad])).astype(np.int32))
    hi, lo = (rows[0], rows[1]) if g[0] > g[1] else (rows[1], rows[0])
    chosen.append(hi)
    rejected.append(lo)
  return chosen, rejected


def test_bradley_terry_rm_beats_chance_on_held_out_pairs():
  train_c, train_r = _preference_pairs(np.random.default_rng(10), 1024)
  test_c, test_r = _preference_pairs(np.random.default_rng(11), 256)
  seen = {(c.tobytes(), r.tobytes()) for c, r in zip(train_c, train_r)}
  assert not any((c.tobytes(), r.tobytes()) in seen for c, r in zip(test_c, test_r))

  def batches():
    for i in range(0, 10 ** 9, 32):
      j = i % len(train_c)
      yield pair_batch(train_c[j:j + 32], train_r[j:j + 32], seq_len=10, pad_id=0)

  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  state = train_reward_model(CFG, bt_loss_fn(CFG), batches(),
                             OptimConfig(lr=3e-3, warmup_steps=5, decay_steps=60),
                             LoopConfig(60, progress=False),
                             runtime=Runtime(mesh, sharding.DEFAULT_RULES, seed=0))
  rc = score_sequences(CFG, state.params, test_c, seq_len=10, pad_id=0, batch_size=64)
  rr = score_sequences(CFG, state.params, test_r, seq_len=10, pad_id=0, batch_size=64)
  accuracy = float(np.mean(rc > rr))
  # Chance is 0.5; a chance-level RM stays under 0.5 + 3 binomial SEs of 256 pairs.
  assert accuracy > 0.5 + 3 * math.sqrt(0.25 / len(test_c)), accuracy
