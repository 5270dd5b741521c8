"""The GOLD-style surrogate (opd.distill.gold) against a float64 numpy reference.

* Random logits over two vocabularies (V_s = 7, V_t = 9, 4 shared pairs):
  value equals a loop over the definition, gradient equals central finite
  differences of that reference.
* One vocabulary (every token shared): the surrogate is the reverse KL.
* ``shared_vocab(byte, task BPE)``: the 256 bytes and the 14 special tokens,
  each pair spelling the same bytes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.distill import crosstok, gold
from opd.text.tokenizers import SPECIAL_TOKENS

from test_distill_crosstok import BYTE, bpe  # noqa: F401

TAU = 0.7


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _reference(zs, zt, s_ids, t_ids):
  out = []
  for a, b in zip(_log_softmax(zs / TAU), _log_softmax(zt / TAU)):
    exact = sum(np.exp(a[v]) * (a[v] - b[u]) for v, u in zip(s_ids, t_ids))
    rest_s = sorted((np.exp(a[v]) for v in range(len(a)) if v not in s_ids), reverse=True)
    rest_t = sorted((np.exp(b[u]) for u in range(len(b)) if u not in t_ids), reverse=True)
    width = max(len(rest_s), len(rest_t))
    rest_s += [0.0] * (width - len(rest_s))
    rest_t += [0.0] * (width - len(rest_t))
    out.append(exact + sum(abs(x - y) for x, y in zip(rest_s, rest_t)))
  return np.asarray(out)


def test_surrogate_value_and_gradient_match_numpy():
  rng = np.random.default_rng(0)
  zs, zt = rng.normal(0, 2, (5, 7)), rng.normal(0, 2, (5, 9))
  s_ids, t_ids = np.asarray([0, 3, 4, 6]), np.asarray([8, 1, 2, 5])
  got = gold.gold_surrogate(jnp.asarray(zs, jnp.float32), jnp.asarray(zt, jnp.float32), s_ids,
                            t_ids, temperature=TAU)
  want = _reference(zs, zt, s_ids, t_ids)
  # float32 log-softmax over <= 9 terms of |z/τ| <= ~10: each term ~10·eps off, ~20 terms
  # per row summed: ~1e-5 absolute.
  np.testing.assert_allclose(np.asarray(got), want, atol=3e-5)
  grad = jax.grad(lambda z: jnp.sum(gold.gold_surrogate(z, jnp.asarray(zt, jnp.float32), s_ids,
                                                        t_ids, temperature=TAU)))(
      jnp.asarray(zs, jnp.float32))
  h, num = 1e-6, np.zeros_like(zs)
  for idx in np.ndindex(zs.shape):
    up, down = zs.copy(), zs.copy()
    up[idx] += h
    down[idx] -= h
    num[idx] = (_reference(up, zt, s_ids, t_ids).sum()
                - _reference(down, zt, s_ids, t_ids).sum()) / (2 * h)
  # Central differences in float64: error ~h² + eps/h ~ 1e-10; the float32 gradient ~1e-5.
  np.testing.assert_allclose(np.asarray(grad), num, atol=1e-4)


def test_with_one_vocabulary_the_surrogate_is_the_reverse_kl():
  rng = np.random.default_rng(1)
  zs, zt = rng.normal(0, 2, (4, 6)), rng.normal(0, 2, (4, 6))
  ids = np.arange(6)
  got = gold.gold_surrogate(jnp.asarray(zs, jnp.float32), jnp.asarray(zt, jnp.float32), ids,
                            ids, temperature=TAU)
  lp, lq = _log_softmax(zs / TAU), _log_softmax(zt / TAU)
  np.testing.assert_allclose(np.asarray(got), (np.exp(lp) * (lp - lq)).sum(-1), atol=3e-5)


def test_shared_vocab_of_byte_and_bpe_pairs_bytes_and_special_tokens(bpe):
  s_ids, t_ids = gold.shared_vocab(BYTE, bpe)
  np.testing.assert_array_equal(s_ids, np.arange(BYTE.vocab_size))  # every byte-tokenizer id
  assert crosstok.token_bytes(BYTE, s_ids) == crosstok.token_bytes(bpe, t_ids)
  for ch in "az09+ ":  # printable ASCII is its own byte-level character
    assert t_ids[ord(ch)] == (bpe.token_to_id(ch) if ch != " " else bpe.token_to_id("Ġ"))
  for tok in SPECIAL_TOKENS:
    assert t_ids[BYTE.token_to_id(tok)] == bpe.token_to_id(tok)


def test_bad_inputs_are_refused_by_name():
  z = jnp.zeros((2, 4))
  with pytest.raises(ValueError, match="teacher_logits.shape"):
    gold.gold_surrogate(z, jnp.zeros((3, 4)), [0], [0])
  with pytest.raises(ValueError, match="student_ids must be distinct ids in \\[0, 4\\)"):
    gold.gold_surrogate(z, z, [0, 4], [0, 1])
  with pytest.raises(ValueError, match="temperature=0"):
    gold.gold_surrogate(z, z, [0], [0], temperature=0)
