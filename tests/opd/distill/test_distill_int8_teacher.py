"""An int8 teacher in the TeacherPool: stored quantised, dequantised in its forward."""
import dataclasses

import jax
import numpy as np
import pytest

from opd.distill.teachers import Teacher, TeacherPool
from opd.models import ModelConfig, forward, head_matrix
from opd.models.quant import dequantize, param_bytes, quantize_int8
from opd.parallel.sharding import make_mesh

V = 256
CFG = ModelConfig(vocab_size=V, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                  d_ff=256)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2)])
def test_int8_teacher_hidden_states_and_bytes(mesh_shape):
  devices = jax.devices()[:int(np.prod(mesh_shape))]
  mesh = make_mesh(mesh_shape, devices)
  float_t = Teacher.random("f", CFG, seed=0)
  int8_t = dataclasses.replace(float_t, name="q", int8=True)
  pool = TeacherPool([float_t, int8_t], V, mesh)
  tokens = np.random.default_rng(0).integers(0, V, (4, 12))
  mask = np.ones((4, 12), bool)
  # Reference: the same quantisation on the host, then the float forward.
  deq = dequantize(quantize_int8(float_t.params))
  ref = forward(CFG, deq, tokens, mask=mask, return_logits=False, return_hidden=True).hidden
  got = pool.hidden("q", tokens, mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
  exact = pool.hidden("f", tokens, mask)
  assert np.abs(np.asarray(exact) - np.asarray(got)).max() > 1e-4  # int8 really used
  np.testing.assert_array_equal(np.asarray(pool.heads[1]), np.asarray(head_matrix(CFG, deq)))
  # Resident bytes: a quarter of fp32 plus scales and norms.
  assert param_bytes(pool._params["q"]) == param_bytes(quantize_int8(float_t.params))
  assert param_bytes(pool._params["q"]) < 0.3 * param_bytes(pool._params["f"])


def test_int8_must_be_bool():
  t = Teacher.random("f", CFG, seed=0)
  with pytest.raises(ValueError, match="int8='yes' must be True or False"):
    dataclasses.replace(t, int8="yes")
