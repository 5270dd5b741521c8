"""experiments.gold_bias: the surrogate and span-exact terms and the batch
figures against float64 numpy (losses written out, gradients by central
differences), the equal-vocabulary control, and the alignment helper."""
import numpy as np
import pytest

from experiments import gold_bias


def _log_softmax(a):
  a = a - a.max(axis=-1, keepdims=True)
  return a - np.log(np.exp(a).sum(axis=-1, keepdims=True))


def _np_gold(z, x, s_ids, t_ids):
  """The surrogate of opd.distill.gold's docstring, one position, float64."""
  lp, lq = _log_softmax(z), _log_softmax(x)
  exact = np.sum(np.exp(lp[s_ids]) * (lp[s_ids] - lq[t_ids]))
  rest_s = np.sort(np.exp(np.delete(lp, s_ids)))[::-1]
  rest_t = np.sort(np.exp(np.delete(lq, t_ids)))[::-1]
  w = max(rest_s.size, rest_t.size)
  rest_s, rest_t = np.pad(rest_s, (0, w - rest_s.size)), np.pad(rest_t, (0, w - rest_t.size))
  return exact + np.abs(rest_s - rest_t).sum()


def _np_span(z, lq_span):
  lp = _log_softmax(z)
  return np.sum(np.exp(lp) * (lp - lq_span))


def _num_grad(f, z, eps=1e-6):
  g = np.zeros_like(z)
  for i in range(z.size):
    d = np.zeros_like(z)
    d[i] = eps
    g[i] = (f(z + d) - f(z - d)) / (2 * eps)
  return g


def _case(seed, n=5, v_s=7, v_t=6):
  rng = np.random.default_rng(seed)
  z, x = rng.normal(size=(n, v_s)) * 2, rng.normal(size=(n, v_t)) * 2
  s_ids, t_ids = np.array([0, 2, 3, 5]), np.array([1, 0, 4, 2])
  # q̃: log-probabilities of each student token's bytes, not normalised over V_s.
  lq_span = np.log(rng.uniform(0.01, 0.5, size=(n, v_s)))
  return z, x, s_ids, t_ids, lq_span


@pytest.mark.parametrize("seed", [0, 1])
def test_bias_terms_against_numpy(seed):
  z, x, s_ids, t_ids, lq = _case(seed)
  l_gold, g_gold, l_span, g_span = (np.asarray(a, np.float64) for a in gold_bias.bias_terms(
      z.astype(np.float32), x.astype(np.float32), lq, s_ids, t_ids))
  for i in range(z.shape[0]):
    # float32 losses of O(1) values: 1e-5 relative covers their rounding.
    assert l_gold[i] == pytest.approx(_np_gold(z[i], x[i], s_ids, t_ids), rel=1e-5, abs=1e-6)
    assert l_span[i] == pytest.approx(_np_span(z[i], lq[i]), rel=1e-5, abs=1e-6)
    # Central differences in float64 (error ~eps² · f''' ~ 1e-11) against float32 gradients.
    np.testing.assert_allclose(g_gold[i], _num_grad(lambda a: _np_gold(a, x[i], s_ids, t_ids),
                                                    z[i]), atol=2e-6)
    np.testing.assert_allclose(g_span[i], _num_grad(lambda a: _np_span(a, lq[i]), z[i]),
                               atol=2e-6)
  fig = gold_bias.batch_figures(l_gold, g_gold, l_span, g_span)
  want_cos = np.sum(g_gold * g_span) / (np.linalg.norm(g_gold) * np.linalg.norm(g_span))
  per = [g_gold[i] @ g_span[i] / (np.linalg.norm(g_gold[i]) * np.linalg.norm(g_span[i]))
         for i in range(z.shape[0])]
  assert fig["cos"] == pytest.approx(want_cos, rel=1e-12)
  assert fig["cos_per_position_mean"] == pytest.approx(np.mean(per), rel=1e-12)
  assert fig["loss_gap"] == pytest.approx((l_gold.mean() - l_span.mean()) / l_span.mean())
  assert fig["positions"] == z.shape[0]
  assert abs(fig["loss_gap"]) > 1e-3 and fig["cos"] < 1 - 1e-3  # a case with a bias to see


def test_one_vocabulary_gives_no_gap_and_cosine_one():
  rng = np.random.default_rng(3)
  z, x = rng.normal(size=(4, 9)) * 2, rng.normal(size=(4, 9)) * 2
  ids = np.arange(9)
  lq = _log_softmax(x)  # with one tokenizer q̃ is the teacher's next-token distribution
  fig = gold_bias.batch_figures(*gold_bias.bias_terms(
      z.astype(np.float32), x.astype(np.float32), lq, ids, ids))
  assert abs(fig["loss_gap"]) < 1e-5 and fig["cos"] == pytest.approx(1.0, abs=1e-6)
  assert fig["cos_per_position_mean"] == pytest.approx(1.0, abs=1e-6)


def test_bad_span_logq_is_refused():
  z, x, s_ids, t_ids, lq = _case(0)
  with pytest.raises(ValueError, match="span_logq.shape"):
    gold_bias.bias_terms(z, x, lq[:, :3], s_ids, t_ids)
  lq[1, 2] = -np.inf
  with pytest.raises(ValueError, match="span_logq must be finite"):
    gold_bias.bias_terms(z, x, lq, s_ids, t_ids)


def test_aligned_positions_against_brute_force():
  rng = np.random.default_rng(4)
  for _ in range(50):
    data = rng.integers(0, 256, size=rng.integers(1, 30)).astype(np.uint8).tobytes()

    def cut(d):
      out, i = [], 0
      while i < len(d):
        k = int(rng.integers(1, 4))
        out.append(d[i:i + k])
        i += k
      return out

    s, t = cut(data), cut(data)
    got = gold_bias._aligned(s, t)
    # brute force: prefix of s through i equals prefix of t through j, as byte counts
    want = {i: j for i in range(len(s)) for j in range(len(t))
            if len(b"".join(s[:i + 1])) == len(b"".join(t[:j + 1]))}
    assert got == want


def test_summarize_means_and_se():
  batches = [{"loss_gap": 0.1, "cos": 0.5, "positions": 4},
             {"loss_gap": 0.3, "cos": 0.7, "positions": 6}]
  s = gold_bias.summarize(batches)
  assert s["loss_gap"] == pytest.approx(0.2) and s["positions"] == 5
  assert s["cos_se"] == pytest.approx(np.std([0.5, 0.7], ddof=1) / np.sqrt(2))


def test_span_logq_at_equals_unpadded_forwards():
  """Padding the candidate rows to a bucket and chunking them changes no
  log-prob: each candidate scored alone (its own unpadded forward) gives the
  same sum, and the next-token logits are the prefix's own last position's."""
  import jax  # noqa: PLC0415

  from opd.models import ModelConfig, forward, init_params  # noqa: PLC0415
  cfg = ModelConfig(vocab_size=29, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
  params = init_params(cfg, jax.random.key(0))
  prefix = [3, 17, 5, 9, 1]
  cands = [[4], [7, 2], [0, 28, 13], [11]] * 3  # 12 rows: chunks of 5 leave a padded tail
  got, x = gold_bias.span_logq_at(cfg, params, prefix, cands, chunk=5, bucket=16)
  for r, c in enumerate(cands):
    logits = np.asarray(forward(cfg, params, np.asarray([prefix + c], np.int32)).logits[0],
                        np.float64)
    lq = _log_softmax(logits)
    want = sum(lq[len(prefix) - 1 + k, c[k]] for k in range(len(c)))
    # float32 forwards of different shapes: rounding only (|log-prob| ~ 3, 1e-5 relative).
    assert got[r] == pytest.approx(want, rel=1e-5, abs=1e-5)
  np.testing.assert_allclose(x, logits[len(prefix) - 1], rtol=1e-5, atol=1e-5)
