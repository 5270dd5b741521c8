"""Chunked-XLA and materialised-reference reverse KL against the float64 oracle.

Values (loss, per-teacher KL, entropy) and gradients (of a random
cotangent-weighted objective over all three outputs) are compared with the
float64 numpy oracle of kl_problems.py (gradients: its analytic softmax
calculus, itself checked by finite differences in test_kl_properties.py).

Compilation dominates (one scan per shape), so the full product is taken
over the shape factors T ∈ {1, 7, 128, 300} × V ∈ {128, 1000, 4096} ×
K ∈ {1, 3} (24 cases), and the eight (τ, mask, dtype) combinations are
dealt out cyclically over them (each appears three times, with different
shapes). ``block_v=512`` gives V=1000 a remainder tile and V=4096 eight
scan steps; V=128 is a single short tile. One more case has peaked logits
(``kl_problems.PEAK``), where only a correct running max avoids
overflow.
"""
import itertools

import jax.numpy as jnp
import pytest

import kl_problems as kp
from pallas_kernels import ChunkSizes

SHAPES = list(itertools.product((1, 7, 128, 300), (128, 1000, 4096), (1, 3)))
COMBOS = list(itertools.product((1.0, 0.7), (False, True), (jnp.float32, jnp.bfloat16)))
CASES = [(*shape, *COMBOS[i % len(COMBOS)]) for i, shape in enumerate(SHAPES)]


def _id(case):
  t, v, k, tau, mask, dtype = case
  return f"{t=}_{v=}_{k=}_{tau=}_{mask=}_{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_chunked_matches_oracle(case):
  t, v, k, tau, with_mask, dtype = case
  p = kp.make_problem(t, v, k, dtype=dtype, with_mask=with_mask, seed=t + v + k)
  kp.check_against_oracle("chunked", ChunkSizes(block_v=512), p, tau, dtype)


def test_chunked_matches_oracle_on_peaked_logits():
  """Logits spanning over a hundred units (kl_problems.PEAK): exp
  overflows unless every tile is shifted by the running max, not a mean or a
  stale value. Several tiles (V=1000, block_v=256) so the max moves."""
  p = kp.make_problem(7, 1000, 3, with_mask=True, seed=11, peak=kp.PEAK)
  kp.check_against_oracle("chunked", ChunkSizes(block_v=256), p, 0.7, jnp.float32)


REFERENCE_CASES = [(7, 1000, 3, 0.7, True, jnp.float32), (300, 128, 1, 1.0, False, jnp.bfloat16)]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=[_id(c) for c in REFERENCE_CASES])
def test_reference_matches_oracle(case):
  t, v, k, tau, with_mask, dtype = case
  p = kp.make_problem(t, v, k, dtype=dtype, with_mask=with_mask, seed=1)
  kp.check_against_oracle("reference", None, p, tau, dtype)
