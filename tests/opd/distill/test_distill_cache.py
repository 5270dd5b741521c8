"""The hidden-state cache: K teacher forwards per rollout batch, whatever the epochs."""
import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp

from opd.distill import (CachedBatch, FaultTolerantTeachers, HiddenStateCache, Teacher,
                         TeacherPool, loss_batch, make_opd_loss, uniform_weights)
from opd.models import ModelConfig
from opd.parallel import sharding
from opd.training.train_step import init_train_state, make_train_step

V, B, T = 64, 2, 8
CFGS = [ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32),
        ModelConfig(vocab_size=V, d_model=24, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)]


def _teacher(name, cfg, seed):
  t = Teacher.random(name, cfg, seed)  # a sharper head: logits O(1), a KL worth fitting
  return Teacher(name, cfg, {**t.params, "lm_head": t.params["lm_head"] * 30})


def test_cache_serves_every_epoch_of_training_with_k_teacher_forwards():
  teachers = [_teacher(f"t{i}", cfg, i) for i, cfg in enumerate(CFGS)]
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  pool, reference = TeacherPool(teachers, V, mesh), TeacherPool(teachers, V, mesh)
  # The first call compiles inside the deadline: give it room.
  cache = HiddenStateCache(FaultTolerantTeachers.from_pool(pool, deadline_s=300.0),
                           sharding=sharding.batch_sharding(mesh, ndim=3))
  opt = optax.adam(1e-2)
  state, shardings = init_train_state(CFGS[0], opt, mesh, sharding.DEFAULT_RULES, rng=9)
  step = make_train_step(make_opd_loss(CFGS[0], pool.heads, teacher_names=pool.names), opt, mesh,
                         shardings)
  rng = np.random.default_rng(0)
  epochs, losses = 3, []
  for rollout in range(2):
    batch = {"tokens": rng.integers(0, V, (B, T)).astype(np.int32), "mask": np.ones((B, T), bool),
             "targets": rng.integers(0, V, (B, T)).astype(np.int32),
             "loss_mask": np.ones((B, T), np.float32)}
    for _ in range(epochs):
      cached = cache.get(rollout, batch["tokens"], batch["mask"])
      state, metrics = step(state, loss_batch(batch, cached, uniform_weights(B, T, 2))[0])
      losses.append(float(metrics["loss"]))
      assert pool.forward_count == {"t0": rollout + 1, "t1": rollout + 1}
    # Every epoch on the batch moved the student towards the teachers.
    assert losses[-1] < losses[-2] < losses[-3]
    direct = {n: np.asarray(reference.hidden_one(n, batch["tokens"], batch["mask"]))
              for n in pool.names}
    for name, h in zip(cached.names, cached.hidden):
      assert h.dtype == jnp.bfloat16 and h.sharding == cache.sharding
      # Stored as bf16: exactly the float32 hidden states rounded once.
      np.testing.assert_array_equal(h, direct[name].astype(jnp.bfloat16))
  assert cache.computes == 2 and cache.hits == 2 * (epochs - 1)
  assert cache.bytes_per_token(V) == {"cache/t0": 16 * 2, "cache/t1": 24 * 2, "logits": V * 4}

  out, row_ok = loss_batch(batch, cached, uniform_weights(B, T, 2))
  assert row_ok.all() and out["teacher_hidden"] is cached.hidden
  np.testing.assert_array_equal(out["teacher_weights"], np.full((B, T, 2), 0.5))
  assert set(out) == {"tokens", "targets", "mask", "loss_mask", "teacher_hidden",
                      "teacher_weights"}


def test_cache_dtype_is_configurable_and_checked():
  with pytest.raises(ValueError, match="dtype='int8' must be a floating dtype"):
    HiddenStateCache(lambda t, m: None, dtype="int8")
  with pytest.raises(ValueError, match="holds no batch"):
    HiddenStateCache(lambda t, m: None, dtype="float32").bytes_per_token(V)


def test_loss_batch_renormalises_after_skips_and_rejects_empty_weights():
  hidden = (jnp.ones((B, T, 4), jnp.bfloat16), jnp.ones((B, T, 6), jnp.bfloat16))
  cached = CachedBatch("k", ("a", "b"), hidden, np.array([[True, True], [False, True]]), {})
  batch = {"tokens": np.zeros((B, T), np.int32), "targets": np.zeros((B, T), np.int32),
           "mask": np.ones((B, T), bool), "loss_mask": np.ones((B, T), np.float32)}
  w = np.zeros((B, T, 2), np.float32)
  w[..., 0], w[..., 1] = 3.0, 1.0
  out, row_ok = loss_batch(batch, cached, w)
  np.testing.assert_allclose(out["teacher_weights"][0], np.broadcast_to([0.75, 0.25], (T, 2)))
  np.testing.assert_array_equal(out["teacher_weights"][1], np.broadcast_to([0.0, 1.0], (T, 2)))
  assert row_ok.all()
  w[1, 3] = 0.0
  with pytest.raises(ValueError, match=r"weights\[\(1, 3\)\] sum to 0.0"):
    loss_batch(batch, cached, w)


def test_a_cached_batch_keeps_its_fault_messages():
  """The cache used to keep the skip reasons only and drop the messages."""
  def down(tokens, mask):
    raise ConnectionError("t1's server refused the connection")

  def nan_row(tokens, mask):
    h = np.ones((B, T, 4), np.float32)
    h[1, 0, 2] = np.nan
    return h

  ft = FaultTolerantTeachers({"t0": nan_row, "t1": down}, {"t0": 4, "t1": 4}, deadline_s=5.0)
  cached = HiddenStateCache(ft).get("k", np.zeros((B, T), np.int32), np.ones((B, T), bool))
  assert cached.skipped == {"t1": "error"}
  assert cached.messages == {"t0": "non-finite hidden states in rows [1]",
                             "t1": "ConnectionError: t1's server refused the connection"}
  np.testing.assert_array_equal(cached.available, [[True, False], [False, False]])
