"""The sampler's KV cache with a mixture-of-experts model: the MoE block is per token, so
prefill + one-token decode steps must report the log-probs of one uncached forward over
prompt + response."""
import jax
import jax.numpy as jnp
import numpy as np

from opd.models import ModelConfig, MoEConfig, forward, init_params
from opd.rollout.sampler import SamplingConfig, generate

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  qk_norm=True,
                  moe=MoEConfig(n_routed_experts=8, experts_per_token=2, moe_d_ff=16,
                                router="sigmoid", n_group=2, topk_group=1, n_shared_experts=1,
                                routed_scaling_factor=2.0, first_k_dense=1))
EPS32 = float(np.finfo(np.float32).eps)
N = 6


def _params():
  """N(0, 1/fan_in) weights: routing and attention far from uniform."""
  rng = np.random.default_rng(0)

  def draw(x):
    if x.ndim < 2:
      return jnp.asarray(np.asarray(x) + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[-2]), x.dtype)

  return jax.tree.map(draw, init_params(CFG, jax.random.key(0)))


def test_moe_sampler_logprobs_match_full_forward():
  params = _params()
  rng = np.random.default_rng(1)
  P = 7
  prompts = rng.integers(0, CFG.vocab_size, (3, P)).astype(np.int32)
  pmask = np.ones((3, P), bool)
  pmask[1, :2] = False  # left-padded
  pmask[2, :4] = False
  out = generate(CFG, params, jnp.asarray(prompts), jnp.asarray(pmask), jax.random.key(3),
                 SamplingConfig(max_new_tokens=N, temperature=1.0))
  tokens = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
  mask = np.concatenate([pmask, np.asarray(out.mask)], axis=1)
  logits = np.asarray(forward(CFG, params, jnp.asarray(tokens), None, jnp.asarray(mask)).logits,
                      np.float64)[:, P - 1:-1]  # the positions that predicted the response
  logits = logits - logits.max(-1, keepdims=True)
  lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.take_along_axis(lsm, np.asarray(out.tokens)[..., None], -1)[..., 0]
  want = np.where(np.asarray(out.mask), want, 0.0)
  # Cached vs uncached: the same per-token MoE and attention over S vs T
  # slots, reductions reordered: ~16 rounded steps per layer, n <= 48 terms,
  # 4 sigma over the entries, both paths -> 2·4·sqrt(34)·sqrt(48)·eps relative
  # to the logits' largest magnitude (log-softmax inherits that scale).
  tol = 2 * 4 * np.sqrt(16 * 2 + 2) * np.sqrt(48) * EPS32 * float(np.abs(logits).max())
  np.testing.assert_allclose(np.asarray(out.logprobs), want, atol=tol, rtol=0)
  assert np.asarray(out.mask).sum() > 0
