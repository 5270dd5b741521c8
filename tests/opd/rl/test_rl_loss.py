"""GRPO's jitted loss (opd/rl/loss.py) against independent numpy references.

The model-level gradient check runs eagerly (no jit): for a 2-layer model
that costs less than compiling six gradient programs.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.rl.config import LOSS_AGGREGATIONS, GRPOConfig
from opd.rl.loss import make_grpo_loss, policy_loss
from opd.models import ModelConfig, forward, init_params, token_logprobs

CFG = ModelConfig(vocab_size=270, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


# ---------------------------------------------------------------------------
# The loss on log-probs.


def _loss_reference(logp, old, ref, adv, w, lo, hi, beta, agg, norm):
  """Token-by-token numpy GRPO loss and metrics (float64)."""
  B, T = logp.shape
  pg = np.zeros((B, T))
  kl = np.zeros((B, T))
  n_low = n_high = 0
  ratios = []
  for b in range(B):
    for t in range(T):
      if w[b, t] == 0:
        continue
      r = np.exp(logp[b, t] - old[b, t])
      ratios.append(r)
      pg[b, t] = -min(r * adv[b], min(max(r, 1 - lo), 1 + hi) * adv[b])
      d = ref[b, t] - logp[b, t]
      kl[b, t] = np.exp(d) - d - 1
      n_low += r < 1 - lo and adv[b] < 0
      n_high += r > 1 + hi and adv[b] > 0

  def agg_fn(x):
    if agg == "token_mean":
      return (x * w).sum() / w.sum()
    if agg == "sequence_mean":
      rows = [(x[b] * w[b]).sum() / w[b].sum() for b in range(B) if w[b].sum() > 0]
      return sum(rows) / len(rows)
    return (x * w).sum() / (B * norm)

  n = len(ratios)
  return agg_fn(pg + beta * kl), {
      "policy_loss": agg_fn(pg), "kl": kl.sum() / n, "clip_frac_low": n_low / n,
      "clip_frac_high": n_high / n, "ratio_mean": np.mean(ratios), "ratio_max": np.max(ratios),
      "policy_tokens": float(n)}


def _random_case(seed, B=6, T=10):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, (B, T))
  old = logp + rng.normal(0.0, 0.4, (B, T))  # ratios well outside [0.8, 1.28]
  ref = logp + rng.normal(0.0, 0.5, (B, T))
  adv = rng.uniform(0.3, 1.5, B) * np.resize([1.0, -1.0], B)  # both signs
  adv[3] = 0.0
  w = (rng.random((B, T)) < 0.6).astype(np.float64)
  w[2] = 0.0  # a row without policy tokens
  return logp, old, ref, adv, w


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_policy_loss_matches_numpy(agg):
  logp, old, ref, adv, w = _random_case(1)
  lo, hi, beta, norm = 0.2, 0.28, 0.1, 7
  loss, metrics = jax.jit(lambda *a: policy_loss(
      *a[:4], ref_logp=a[4], clip_eps_low=lo, clip_eps_high=hi, kl_coef=beta, aggregation=agg,
      norm_tokens=norm))(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, w, ref)))
  want_loss, want = _loss_reference(logp, old, ref, adv, w, lo, hi, beta, agg, norm)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
  for k, v in want.items():
    np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
  # Both clipping sides are exercised by this case.
  assert want["clip_frac_low"] > 0.05 and want["clip_frac_high"] > 0.05


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_policy_loss_gradient_at_ratio_one(agg):
  """At ratio 1 without KL: d loss / d logp = -A w / normaliser."""
  logp, _, _, adv, w = _random_case(2)
  norm = 5
  f = lambda lp: policy_loss(lp, jax.lax.stop_gradient(lp), jnp.asarray(adv, jnp.float32),
                             jnp.asarray(w, jnp.float32), clip_eps_low=0.2, clip_eps_high=0.2,
                             kl_coef=0.0, aggregation=agg, norm_tokens=norm)[0]
  got = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(logp, jnp.float32)))
  if agg == "token_mean":
    denom = np.full_like(w, w.sum())
  elif agg == "sequence_mean":
    denom = w.sum(1, keepdims=True) * (w.sum(1) > 0).sum() + np.zeros_like(w)
  else:
    denom = np.full_like(w, w.shape[0] * norm)
  want = np.where(w > 0, -adv[:, None] * w / np.where(denom > 0, denom, 1), 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_policy_loss_rejects_bad_shapes_and_missing_reference():
  x = jnp.zeros((2, 3))
  common = dict(clip_eps_low=0.2, clip_eps_high=0.2, aggregation="token_mean")
  with pytest.raises(ValueError, match=r"advantages must have shape \(2,\)"):
    policy_loss(x, x, jnp.zeros((3,)), x, kl_coef=0.0, **common)
  with pytest.raises(ValueError, match="kl_coef=0.1 > 0 needs ref_logp"):
    policy_loss(x, x, jnp.zeros((2,)), x, kl_coef=0.1, **common)


# ---------------------------------------------------------------------------
# The model-level loss.


@pytest.fixture(scope="module")
def model_case():
  params = init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(3)
  B, L, T = 4, 12, 0.7
  tokens = rng.integers(0, 256, (B, L)).astype(np.int32)
  mask = np.ones((B, L), bool)
  mask[1, 9:] = False  # a right-padded row
  loss_mask = ((rng.random((B, L)) < 0.6) & mask).astype(np.float32)
  logits = forward(CFG, params, tokens, None, mask).logits
  targets = rng.integers(0, 256, (B, L)).astype(np.int32)
  logp = np.asarray(token_logprobs(logits, targets, T))
  batch = {"tokens": tokens, "targets": targets, "mask": mask, "loss_mask": loss_mask,
           "old_logprobs": logp,  # ratio = 1
           "advantages": rng.normal(size=B).astype(np.float32),
           "ref_logprobs": (logp + rng.normal(0, 0.3, (B, L))).astype(np.float32)}
  return params, batch, np.asarray(logits, np.float64), T


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_make_grpo_loss_gradient_is_policy_gradient(model_case, agg):
  """jax.grad of the GRPO loss at ratio 1 with kl_coef 0 equals the gradient
  of the plain policy-gradient expression -sum(A w logp) / normaliser; the
  kl and entropy metrics match numpy."""
  params, batch, logits, T = model_case
  cfg = GRPOConfig(group_size=2, prompts_per_step=2, max_new_tokens=5, seq_len=12, kl_coef=0.0,
                   temperature=T, loss_aggregation=agg)
  loss_fn = make_grpo_loss(CFG, cfg)
  w = batch["loss_mask"] * batch["mask"]
  B = w.shape[0]
  if agg == "token_mean":
    denom = np.full_like(w, w.sum())
  elif agg == "sequence_mean":
    denom = np.maximum(w.sum(1, keepdims=True), 1) * (w.sum(1) > 0).sum() + np.zeros_like(w)
  else:
    denom = np.full_like(w, B * cfg.max_new_tokens)
  coef = jnp.asarray(batch["advantages"][:, None] * w / denom, jnp.float32)

  def plain(p):
    out = forward(CFG, p, batch["tokens"], None, batch["mask"]).logits
    return -jnp.sum(coef * token_logprobs(out, batch["targets"], T))

  (loss, metrics), got = jax.value_and_grad(lambda p: loss_fn(p, batch, None), has_aux=True)(
      params)
  want = jax.grad(plain)(params)
  for (path, g), h in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=2e-4, atol=1e-7,
                               err_msg=jax.tree_util.keystr(path))
  assert float(metrics["ratio_max"]) == pytest.approx(1.0, abs=1e-5)
  assert float(metrics["clip_frac_low"]) == float(metrics["clip_frac_high"]) == 0.0
  on = w > 0
  d = (batch["ref_logprobs"] - batch["old_logprobs"])[on].astype(np.float64)
  np.testing.assert_allclose(float(metrics["kl"]), np.mean(np.exp(d) - d - 1), rtol=1e-4)
  z = logits / T
  logq = z - z.max(-1, keepdims=True)
  logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
  entropy = -(np.exp(logq) * logq).sum(-1)
  np.testing.assert_allclose(float(metrics["entropy"]), entropy[on].mean(), rtol=1e-4)
  assert float(loss) == pytest.approx(float(metrics["policy_loss"]), abs=1e-7)


def test_make_grpo_loss_needs_reference_when_kl_is_on(model_case):
  params, batch, _, _ = model_case
  cfg = GRPOConfig(max_new_tokens=5, seq_len=12, kl_coef=0.05)
  no_ref = {k: v for k, v in batch.items() if k != "ref_logprobs"}
  with pytest.raises(ValueError, match="no 'ref_logprobs'"):
    make_grpo_loss(CFG, cfg)(params, no_ref, None)
  with pytest.raises(ValueError, match=r"advantages'\] must be \[B\]"):
    make_grpo_loss(CFG, cfg)(params, {**batch, "advantages": np.zeros(3, np.float32)}, None)
