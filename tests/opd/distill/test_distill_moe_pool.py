"""An MoE teacher and a dense teacher in one OPD teacher pool.

The pool ships last hidden states, so the loss never sees a teacher's
architecture: here a DeepSeek-style MoE teacher (experts sharded over the
mesh's ``expert`` axis) and a dense teacher of another width serve one
student. Each teacher's hidden states equal its unsharded forward, and the
loss's per-teacher reverse KL equals a float64 numpy reverse KL computed
from the student's and that teacher's full logits.
"""
import jax
import jax.numpy as jnp
import numpy as np

from opd.distill.loss import OPDLossConfig, make_opd_loss
from opd.distill.teachers import Teacher, TeacherPool
from opd.models import ModelConfig, MoEConfig, forward, head_matrix, init_params, moe_balance
from opd.parallel import sharding

V = 64
EPS32 = float(np.finfo(np.float32).eps)
STUDENT = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48)
MOE = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  moe=MoEConfig(n_routed_experts=4, experts_per_token=2, moe_d_ff=16,
                                router="sigmoid", n_group=2, topk_group=1, n_shared_experts=1,
                                first_k_dense=1))
DENSE = ModelConfig(vocab_size=V, d_model=48, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=64)


def _scaled(cfg, seed):
  """N(0, 1/fan_in) weights so the teachers' distributions are far from uniform."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: x if x.ndim < 2 else jnp.asarray(
      rng.standard_normal(x.shape) / np.sqrt(x.shape[-2]), x.dtype),
                      init_params(cfg, jax.random.key(seed)))


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_moe_and_dense_teachers_share_one_pool():
  teachers = [Teacher("moe", MOE, _scaled(MOE, 1)), Teacher("dense", DENSE, _scaled(DENSE, 2))]
  mesh = sharding.make_mesh((4, 1, 2, 1))  # data x expert over the 8 fake devices
  pool = TeacherPool(teachers, V, mesh)
  rng = np.random.default_rng(0)
  B, T = 4, 8
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[1, :3] = False  # left padding
  hidden = pool.hidden_states(tokens, mask)
  for t in teachers:
    ref = forward(t.cfg, t.params, jnp.asarray(tokens), None, jnp.asarray(mask),
                  return_logits=False, return_hidden=True).hidden
    assert hidden[t.name].shape == (B, T, t.cfg.d_model)
    # Sharded vs unsharded: reductions over <= 64 terms reordered, ~16 rounded
    # steps per layer, 4 sigma: 4·sqrt(34)·sqrt(64)·eps of the RMS-normed scale.
    tol = 4 * np.sqrt(34) * 8 * EPS32 * float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(hidden[t.name])[mask], np.asarray(ref)[mask],
                               atol=tol, rtol=0)

  # Rows 0-1 learn from the MoE teacher, rows 2-3 from the dense one.
  weights = np.zeros((B, T, 2), np.float32)
  weights[:2, :, 0] = 1
  weights[2:, :, 1] = 1
  batch = {"tokens": tokens, "targets": tokens, "mask": mask, "loss_mask": mask,
           "teacher_hidden": tuple(hidden[n] for n in pool.names), "teacher_weights": weights}
  student = _scaled(STUDENT, 3)
  loss_fn = make_opd_loss(STUDENT, pool.heads, OPDLossConfig(gradient_in_forward=False,
                                                             impl="reference"),
                          teacher_names=pool.names)
  loss, metrics = jax.jit(loss_fn)(student, batch, None)
  assert np.isfinite(float(loss))
  ls = _log_softmax(forward(STUDENT, student, jnp.asarray(tokens), None,
                            jnp.asarray(mask)).logits)
  for k, t in enumerate(teachers):
    lt = _log_softmax(np.asarray(hidden[t.name], np.float64) @ np.asarray(
        head_matrix(t.cfg, t.params), np.float64))
    kl = (np.exp(ls) * (ls - lt)).sum(-1)  # KL(p_student || p_teacher) per token
    uses = mask & (weights[..., k] > 0)
    want = kl[uses].mean()
    # The fp32 logits (D <= 48-term head matmul, V = 64 log-sum-exp) carry
    # ~sqrt(64)·eps ≈ 1e-6 of their scale (a few units); the KL, a mean of
    # log-prob differences of order 1, moves by ~1e-5 of itself: 10x margin.
    np.testing.assert_allclose(float(metrics[f"kl/{t.name}"]), want, rtol=1e-4, atol=1e-6)
    assert want > 0.05  # far from uniform: the comparison has power


def test_opd_loss_of_an_moe_student_adds_its_balance_terms():
  student_cfg = MOE.replace(moe=MoEConfig(**{**MOE.moe.__dict__, "seq_aux_loss_coef": 0.1,
                                             "aux_loss_coef": 0.2}))
  teacher = Teacher("dense", DENSE, _scaled(DENSE, 2))
  rng = np.random.default_rng(1)
  B, T = 2, 6
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  hidden = forward(DENSE, teacher.params, jnp.asarray(tokens), None, jnp.asarray(mask),
                   return_logits=False, return_hidden=True).hidden
  batch = {"tokens": tokens, "targets": tokens, "mask": mask, "loss_mask": mask,
           "teacher_hidden": (hidden,), "teacher_weights": np.ones((B, T, 1), np.float32)}
  params = _scaled(student_cfg, 4)
  cfg = OPDLossConfig(gradient_in_forward=False, impl="reference")
  heads = (head_matrix(DENSE, teacher.params),)
  loss, metrics = make_opd_loss(student_cfg, heads, cfg)(params, batch, None)
  plain, _ = make_opd_loss(MOE, heads, cfg)(params, batch, None)  # coefficients 0
  want = moe_balance.aux_loss(student_cfg.moe, forward(student_cfg, params, jnp.asarray(tokens),
                                                       None, jnp.asarray(mask)).moe)
  assert float(want) > 0
  np.testing.assert_allclose(float(loss - plain), float(want), atol=8 * EPS32 * float(loss))
  np.testing.assert_allclose(float(metrics["moe/aux_loss"]), float(want), rtol=1e-6)
  assert moe_balance.COUNTS_KEY not in metrics  # MOE's bias_update_rate is 0
