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
EPS32 = float(np.finfo(np.float32).eps)


def _f32(x):
  """``x`` rounded to float32 and back: the values the jitted loss really sees."""
  return np.asarray(x, np.float32).astype(np.float64)


# ---------------------------------------------------------------------------
# The loss on log-probs.


def _loss_reference(logp, old, ref, adv, w, lo, hi, beta, agg, norm):
  """Token-by-token numpy GRPO loss and metrics (float64), and their tolerances.

  Returns:
    ``(want, tol)``: dicts keyed ``loss`` and the metric names; ``tol[k]`` is
    the absolute float32 error budget of output ``k``.
  """
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
  want = {"loss": agg_fn(pg + beta * kl), "policy_loss": agg_fn(pg), "kl": kl.sum() / n,
          "clip_frac_low": n_low / n, "clip_frac_high": n_high / n,
          "ratio_mean": np.mean(ratios), "ratio_max": np.max(ratios), "policy_tokens": float(n)}

  # Float32 error budget of each output against this float64 reference on the
  # same float32 inputs (docs/DEVELOPING.md, "Choosing tolerances"). Per token:
  # logp - old rounds by eps/2 |Delta|, exp adds <= 2 ulp (XLA's exp is not
  # correctly rounded) and so does the product with A, so pg and ratio are off
  # by <= (|Delta| + 3) eps relative; k3 = e^d - d - 1 cancels, so its error is
  # absolute, <= (e^d (|d| + 3) + |d| + 1) eps. An aggregate of n = B T such
  # terms adds ~4 sqrt(n) eps (4 standard deviations of random-walk rounding)
  # times the same aggregate of |terms|, and its division one eps.
  delta, d = np.where(w > 0, logp - old, 0.0), np.where(w > 0, ref - logp, 0.0)
  rel_tok = (np.abs(delta) + 3) * EPS32
  e_pg, e_kl = np.abs(pg) * rel_tok, (np.exp(d) * (np.abs(d) + 3) + np.abs(d) + 1) * EPS32
  sum_rel = 4 * np.sqrt(B * T) * EPS32
  on = w > 0
  mean_on = lambda x: x[on].mean()

  def budget(agg, terms, err):
    return agg(err) + sum_rel * agg(np.abs(terms)) + EPS32 * abs(agg(terms))

  ratio = np.where(on, np.exp(delta), 0.0)
  tol = {"loss": budget(agg_fn, pg + beta * kl, e_pg + beta * e_kl),
         "policy_loss": budget(agg_fn, pg, e_pg), "kl": budget(mean_on, kl, e_kl),
         "ratio_mean": budget(mean_on, ratio, ratio * rel_tok),
         "ratio_max": np.max(ratio * (1 + rel_tok)) - np.max(ratio)}
  # Counts divided by n: one rounding, provided no ratio sits so close to a
  # clip boundary that its rounding could move it across.
  for k in ("clip_frac_low", "clip_frac_high"):
    tol[k] = EPS32 * want[k]
  tol["policy_tokens"] = 0.0  # a float32 sum of n < 2^24 ones is exact
  margin = np.abs(ratio[on][:, None] - [1 - lo, 1 + hi]) / (ratio[on] * rel_tok[on])[:, None]
  assert margin.min() > 1, "a ratio within rounding of a clip boundary: pick another seed"
  return want, tol


def _global_norm(tree):
  return np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))


def _rel_diff(a, b):
  """||a - b|| / ||b|| over the whole pytree (global L2 norms, float64)."""
  return _global_norm(jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y),
                                   a, b)) / _global_norm(b)


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
  logp, old, ref, adv = (_f32(x) for x in (logp, old, ref, adv))
  loss, metrics = jax.jit(lambda *a: policy_loss(
      *a[:4], ref_logp=a[4], clip_eps_low=lo, clip_eps_high=hi, kl_coef=beta, aggregation=agg,
      norm_tokens=norm))(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, w, ref)))
  want, tol = _loss_reference(logp, old, ref, adv, w, lo, hi, beta, agg, norm)
  assert set(want) == {"loss", *metrics}
  for k, v in want.items():
    got = float(loss if k == "loss" else metrics[k])
    np.testing.assert_allclose(got, v, rtol=0, atol=tol[k], err_msg=k)
  # Both clipping sides are exercised by this case.
  assert want["clip_frac_low"] > 0.05 and want["clip_frac_high"] > 0.05


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_policy_loss_gradient_at_ratio_one(agg):
  """At ratio 1 without KL: d loss / d logp = -A w / normaliser."""
  logp, _, _, adv, w = _random_case(2)
  adv = _f32(adv)
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
  # ratio = exp(lp - lp) = 1 exactly, and the denominators are exact float32
  # sums of 0/1 weights, so each element is A (float32) times a few rounded
  # products and quotients (the normaliser, the row count, the mask): <= 4
  # roundings of eps/2 each. Masked tokens and A = 0 give exactly 0.
  np.testing.assert_allclose(got, want, rtol=2 * EPS32, atol=0)


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
  # Gradients by global norm (an element that cancels to ~0 has no stable
  # relative error; docs/DEVELOPING.md, "Choosing tolerances"). Each side's
  # backward pass is off from the exact gradient by the float32 rounding of
  # its sums: <= n = B L V terms (the LM head), ~sqrt(n) eps relative, chained
  # through ~8 sums per layer in quadrature: sqrt(8 n_layers) sqrt(n) eps
  # (~5e-5, as in tests/opd/training/test_train_step.py). The cotangents differ
  # by a few roundings of A w / normaliser (2 eps). A wrong normaliser, a lost
  # mask or a lost token is >= 1 / sum(w) ~ 3e-2 relative.
  B, L = w.shape
  grad_rtol = (np.sqrt(8 * CFG.n_layers) * np.sqrt(B * L * CFG.vocab_size) + 2) * EPS32
  assert _rel_diff(got, want) <= grad_rtol, (_rel_diff(got, want), grad_rtol)
  # The loss recomputes logp = z / T - lse(z / T) with the same model: the
  # logits' sums (D terms, ~8 per layer) move z = logits / T by
  # ~4 sqrt(8 n_layers D) eps max|z|, and the log-sum-exp over V terms by 4 sqrt(V) eps plus the
  # rounding of z / T - lse, 2 eps |log p|. So ratio = exp(logp - old) is 1
  # within dlogp + eps, and each token's k3 moves by |e^d - 1| dlogp.
  on = w > 0
  z = logits / T
  logq = z - z.max(-1, keepdims=True)
  logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
  dlogp = (4 * np.sqrt(8 * CFG.n_layers * CFG.d_model) * np.abs(z).max()
           + 4 * np.sqrt(CFG.vocab_size) + 2 * np.abs(logq).max()) * EPS32
  assert abs(float(metrics["ratio_max"]) - 1.0) <= dlogp + EPS32
  assert float(metrics["clip_frac_low"]) == float(metrics["clip_frac_high"]) == 0.0
  d = (batch["ref_logprobs"].astype(np.float64) - batch["old_logprobs"])[on]
  k3 = np.exp(d) - d - 1
  n = on.sum()
  kl_tol = (np.mean(np.abs(np.exp(d) - 1)) * dlogp  # logp recomputed
            + np.mean(np.exp(d) * (np.abs(d) + 3) + np.abs(d) + 1) * EPS32  # k3 cancels
            + 4 * np.sqrt(n) * EPS32 * k3.mean())  # the token mean
  np.testing.assert_allclose(float(metrics["kl"]), k3.mean(), rtol=0, atol=kl_tol)
  # Entropy H = -sum q log q: each log q is off by dlogp, which moves H by
  # <= dlogp sum q |1 + log q| <= dlogp (1 + H); its V products and the token
  # mean add 4 (sqrt(V) + sqrt(n)) eps H.
  entropy = -(np.exp(logq) * logq).sum(-1)
  h = entropy[on].mean()
  h_tol = dlogp * (1 + h) + 4 * (np.sqrt(CFG.vocab_size) + np.sqrt(n)) * EPS32 * h
  np.testing.assert_allclose(float(metrics["entropy"]), h, rtol=0, atol=h_tol)
  # kl_coef = 0: the loss aggregates pg + 0 * kl == pg through the very same
  # ops as the policy_loss metric, so the two are equal exactly.
  assert float(loss) == float(metrics["policy_loss"])


def test_make_grpo_loss_needs_reference_when_kl_is_on(model_case):
  params, batch, _, _ = model_case
  cfg = GRPOConfig(max_new_tokens=5, seq_len=12, kl_coef=0.05)
  no_ref = {k: v for k, v in batch.items() if k != "ref_logprobs"}
  with pytest.raises(ValueError, match="no 'ref_logprobs'"):
    make_grpo_loss(CFG, cfg)(params, no_ref, None)
  with pytest.raises(ValueError, match=r"advantages'\] must be \[B\]"):
    make_grpo_loss(CFG, cfg)(params, {**batch, "advantages": np.zeros(3, np.float32)}, None)
