"""Pallas reverse-KL kernels in interpret mode, and their TPU / GPU lowering.

Factor grid of the issue: T ∈ {1, 7, 128, 300}, V ∈ {128, 1000, 4096},
K ∈ {1, 3}, τ ∈ {1.0, 0.7}, mask on/off, float32/bfloat16, plus the kernel
layout (tiled = TPU, looped = GPU). The full product is 384 interpret-mode
compilations (several seconds each), so the grid is covered by a pairwise
(strength-2) covering array: every pair of levels of any two factors occurs
in at least one of the 12 rows of ``DESIGN`` (checked by
``test_design_covers_all_pairs``). The chunked path runs the full product
over the cheap factors (test_kl_chunked.py).

Block sizes are small so that every case has several tiles, overhanging last
tiles in T and V (300 % 64, 1000 % 256, 7 < 8) and, for the looped layout,
padded hidden widths (40, 24 with block_d 16) and a padded vocabulary split.
Interpret mode fills the overhang of a block with NaN, so these cases also
check that no garbage reaches a sum or a matmul. Values and gradients are
compared with the float64 oracle (``kl_problems.check_against_oracle``).
One extra case has peaked logits (``kl_problems.PEAK``), where only
a correct running max avoids overflow.
"""
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax import export

import kl_problems as kp
from pallas_kernels import BlockSizes, pallas_kl_tiled, vocab_stats_pallas

T_LEVELS, V_LEVELS, K_LEVELS = (1, 7, 128, 300), (128, 1000, 4096), (1, 3)
TAU_LEVELS, MASK_LEVELS = (1.0, 0.7), (False, True)
DTYPE_LEVELS, LAYOUT_LEVELS = (jnp.float32, jnp.bfloat16), ("tiled", "looped")
LEVELS = (T_LEVELS, V_LEVELS, K_LEVELS, TAU_LEVELS, MASK_LEVELS, DTYPE_LEVELS, LAYOUT_LEVELS)

# Level indices per factor (T, V, K, tau, mask, dtype, layout).
DESIGN = [
    (0, 0, 1, 0, 1, 1, 0), (0, 1, 0, 1, 0, 1, 1), (0, 2, 1, 0, 1, 0, 1),
    (1, 0, 1, 1, 0, 0, 1), (1, 1, 1, 0, 1, 0, 0), (1, 2, 0, 1, 1, 1, 0),
    (2, 0, 0, 0, 1, 0, 1), (2, 1, 1, 1, 0, 0, 1), (2, 2, 0, 0, 0, 1, 0),
    (3, 0, 0, 0, 1, 0, 1), (3, 1, 1, 1, 0, 1, 1), (3, 2, 0, 1, 1, 1, 0),
]

BLOCKS = {
    "tiled": BlockSizes(block_t=64, block_v=256, layout="tiled"),
    "looped": BlockSizes(block_t=32, block_v=128, layout="looped", block_d=16, v_splits=3),
}


def _case(row):
  return tuple(levels[i] for levels, i in zip(LEVELS, row))


def _id(row):
  t, v, k, tau, mask, dtype, layout = _case(row)
  return f"{t=}_{v=}_{k=}_{tau=}_{mask=}_{jnp.dtype(dtype).name}_{layout}"


def test_design_covers_all_pairs():
  for a, b in itertools.combinations(range(len(LEVELS)), 2):
    seen = {(row[a], row[b]) for row in DESIGN}
    want = set(itertools.product(range(len(LEVELS[a])), range(len(LEVELS[b]))))
    assert seen == want, (a, b, want - seen)


@pytest.mark.parametrize("row", DESIGN, ids=[_id(r) for r in DESIGN])
def test_pallas_matches_oracle(row):
  t, v, k, tau, with_mask, dtype, layout = _case(row)
  p = kp.make_problem(t, v, k, dtype=dtype, with_mask=with_mask, seed=sum(row))
  kp.check_against_oracle("pallas", BLOCKS[layout], p, tau, dtype)


def test_pallas_matches_oracle_on_peaked_logits():
  """Logits spanning over a hundred units (kl_problems.PEAK): exp
  overflows unless every tile is shifted by the running max. One small
  tiled case (4 vocabulary tiles of 256, one T tile) keeps interpret mode cheap."""
  p = kp.make_problem(7, 1000, 1, with_mask=True, seed=11, peak=kp.PEAK)
  kp.check_against_oracle("pallas", BLOCKS["tiled"], p, 0.7, jnp.float32)


# --- Lowering for real hardware, checked on this CPU machine ------------------
# jax.export lowers the kernels for a platform without its hardware. For TPU
# this runs the Pallas→Mosaic lowering, which enforces Mosaic's block-shape
# rules (last two block dims divisible by 8 / 128 or full); for CUDA it runs
# the Pallas→Triton lowering. Neither compiles to machine code (that happens
# in libtpu / XLA:GPU), so register or VMEM pressure is not checked here.

def _export(platform, block_sizes, dtype, t=300, v=1000):
  p = kp.make_problem(t, v, 2, dtype=dtype, with_mask=False)

  def value_and_grads(h_s, w_s, h_k, w_k):
    def obj(h_s, w_s):
      st = vocab_stats_pallas(h_s, w_s, h_k, w_k, 0.7, block_sizes, interpret=False)
      return jnp.sum(st.lse) + jnp.sum(st.ent) + jnp.sum(st.e_k)
    return jax.value_and_grad(obj, argnums=(0, 1))(h_s, w_s)

  args = (p.h_s, p.w_s, tuple(p.h_k), tuple(p.w_k))
  disabled = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  exported = export.export(jax.jit(value_and_grads), platforms=[platform],
                           disabled_checks=disabled)(*args)
  return exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_tiled_kernels_lower_for_tpu(dtype):
  module = _export("tpu", BlockSizes(block_t=128, block_v=512, layout="tiled"), dtype)
  assert module.count("tpu_custom_call") == 3  # forward, dh_s, dW_s


def test_looped_kernels_lower_for_cuda():
  bs = BlockSizes(block_t=64, block_v=128, layout="looped", block_d=16, v_splits=4)
  module = _export("cuda", bs, jnp.bfloat16)
  assert module.count("xla.gpu.triton") == 3


def test_tpu_lowering_rejects_bad_blocks():
  """The export check has teeth: a block violating Mosaic's (8, 128) rule fails."""
  p = kp.make_problem(300, 1000, 1, with_mask=False)
  fn = lambda h_s, w_s: pallas_kl_tiled.forward(h_s, w_s, p.h_k, p.w_k, inv_tau=1.0, bt=12, bv=256,
                                                 vmem_cap=2**26, interpret=False)
  with pytest.raises(Exception, match="divisible by 8 and 128"):
    export.export(jax.jit(fn), platforms=["tpu"])(p.h_s, p.w_s)


def test_block_sizes_defaults_and_validation():
  assert BlockSizes.get_default("tpu").layout == "tiled"
  assert BlockSizes.get_default("gpu").layout == "looped"
  assert BlockSizes.get_default("cpu").layout == "tiled"
  with pytest.raises(ValueError, match="block_v"):
    BlockSizes(block_t=64, block_v=100, layout="tiled")
  with pytest.raises(ValueError, match="power"):
    BlockSizes(block_t=48, block_v=128, layout="looped")
  with pytest.raises(ValueError, match="layout"):
    BlockSizes(block_t=64, block_v=128, layout="mosaic")
