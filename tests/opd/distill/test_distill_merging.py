"""Weight merging (opd/distill/merging.py) against numpy on model pytrees."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.distill.merging import average_params, task_arithmetic, task_vectors
from opd.models import ModelConfig, init_params

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32)
EPS32 = float(np.finfo(np.float32).eps)


def _models(n):
  """A base and n "fine-tuned" models: the base plus a model-specific perturbation
  (norm scales included, so every leaf differs)."""
  base = init_params(CFG, jax.random.key(0))
  out = []
  for i in range(n):
    delta = init_params(CFG, jax.random.key(i + 1))
    out.append(jax.tree.map(lambda b, d, s=0.5 * (i + 1): b + s * d + 0.01 * s, base, delta))
  return base, out


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _paths(tree):
  return {"/".join(str(k.key) for k in p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_close(got, want, atol):
  got, want = _paths(got), _paths(want)
  assert got.keys() == want.keys()
  for path in want:
    assert got[path].dtype == np.float32, path
    np.testing.assert_allclose(np.asarray(got[path], np.float64), want[path], rtol=0,
                               atol=atol, err_msg=path)


def test_average_matches_numpy():
  _, models = _models(3)
  want = jax.tree.map(lambda *xs: sum(xs) / len(xs), *map(_np, models))
  # Sum of 3 float32 values and one division: at most ~4 roundings, each
  # <= eps/2 relative to the largest magnitude involved (Σ|θ_i| <= 3 max|θ|).
  scale = max(float(np.max(np.abs(x))) for m in models for x in jax.tree.leaves(m))
  _check_close(average_params(models), want, atol=4 * EPS32 * 3 * scale)
  single = average_params(models[:1])
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(single),
                                                  jax.tree.leaves(models[0])))


@pytest.mark.parametrize("scale", [0.3, 1.0])
def test_task_arithmetic_matches_numpy(scale):
  base, models = _models(3)
  b64, m64 = _np(base), list(map(_np, models))
  want = jax.tree.map(lambda b, *ms: b + scale * sum(m - b for m in ms), b64, *m64)
  # 3 differences, 2 additions, one product and the final addition: ~7
  # roundings, each relative to at most |b| + λ Σ_i (|θ_i| + |b|).
  mags = max(float(np.max(np.abs(x))) for m in [base] + models for x in jax.tree.leaves(m))
  _check_close(task_arithmetic(base, models, scale), want,
               atol=7 * EPS32 * (mags + scale * 6 * mags))
  vectors = task_vectors(base, models)
  for vec, m in zip(vectors, m64):
    _check_close(vec, jax.tree.map(lambda x, b: x - b, m, b64), atol=2 * EPS32 * mags)


def test_task_arithmetic_with_one_over_n_is_the_average():
  base, models = _models(2)
  # (θ1 + θ2)/2 and b + ½((θ1 − b) + (θ2 − b)) agree up to a few roundings.
  mags = max(float(np.max(np.abs(x))) for m in [base] + models for x in jax.tree.leaves(m))
  _check_close(task_arithmetic(base, models, 0.5), _np(average_params(models)),
               atol=10 * EPS32 * 3 * mags)


def test_bf16_leaves_keep_their_dtype():
  base, models = _models(2)
  to16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
  out = task_arithmetic(to16(base), [to16(m) for m in models], 0.5)
  assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.bfloat16)}


def test_mismatches_name_the_leaf():
  base, models = _models(2)
  wider = init_params(ModelConfig(**{**CFG.to_dict(), "d_ff": 48}), jax.random.key(5))
  with pytest.raises(ValueError, match=re.escape(
      "math['layers_0/mlp/down'].shape=(48, 16) differs from code['layers_0/mlp/down']"
      ".shape=(32, 16)")):
    average_params([models[0], wider], names=["code", "math"])
  deeper = init_params(ModelConfig(**{**CFG.to_dict(), "n_layers": 3}), jax.random.key(5))
  with pytest.raises(ValueError, match="layers_2"):
    task_arithmetic(base, [models[0], deeper], 0.5)
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), models[1])
  with pytest.raises(ValueError, match="dtype=bfloat16"):
    average_params([models[0], half])
  with pytest.raises(ValueError, match="not floating"):
    average_params([{"a": jnp.arange(3)}, {"a": jnp.arange(3)}])
  with pytest.raises(ValueError, match=r"params=\[\]"):
    average_params([])
  with pytest.raises(ValueError, match="names has 1 entries"):
    average_params(models, names=["x"])


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "1", True])
def test_bad_scale_is_refused(scale):
  base, models = _models(1)
  with pytest.raises(ValueError, match="scale="):
    task_arithmetic(base, models, scale)
