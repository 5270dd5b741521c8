"""CrossTokenizerPool (opd.distill.crosstok_pool): two phases, the fault layer, the loss batch.

* A batch with a row the teacher cannot read is refused naming the teacher
  and the example before any teacher is called: no call, no skip counted.
* A mixed routed pool (a BPE teacher through the pool, a byte teacher as a
  plain same-tokenizer teacher) gives the loss batch whose loss equals the
  one built by hand from the teacher's forward on its transcoded rows.
* A teacher that raises is a skip: its rows lose its weight (the rows routed
  to it train on nothing), ``skips/<name>/error`` counts it.
"""
import jax
import numpy as np
import pytest

from opd.distill import crosstok
from opd.distill.crosstok_pool import CrossTokenizerPool, CrossTokenizerTeacher
from opd.models import head_matrix

from test_distill_crosstok import (BYTE, PROMPTS, RESPONSES, STUDENT, T_BPE, T_BYTE, _adv_cfg,
                                   _byte_host, _host, _loss_grad, bpe)  # noqa: F401
from test_distill_loss import _hidden, _model


def _counting(fn):
  calls = []

  def wrapped(tokens, mask):
    calls.append(tokens.shape)
    return fn(tokens, mask)

  return wrapped, calls


def test_a_refused_batch_calls_no_teacher_and_counts_nothing(bpe):
  fn, calls = _counting(lambda tok, m: np.zeros(tok.shape + (8,), np.float32))
  pool = CrossTokenizerPool([CrossTokenizerTeacher("bpe_t", bpe, fn, 8)], BYTE, deadline_s=30)
  with pytest.raises(ValueError, match="teacher 'bpe_t', example ex-1: .*spells the teacher's "
                                      "special token"):
    pool.answer(_byte_host([b"fine", b"say <|end|> now"]), example_ids=["ex-0", "ex-1"])
  assert calls == [] and sum(pool.metrics().values()) == 0
  pool.answer(_byte_host([b"fine", b"ok"]))  # the next good batch is answered
  assert len(calls) == 1


def test_the_pool_refuses_the_students_own_tokenizer_and_tokenizers_without_bytes():
  with pytest.raises(ValueError, match="teacher 'b' has the student's tokenizer"):
    CrossTokenizerPool([CrossTokenizerTeacher("b", BYTE, lambda t, m: t, 8)], BYTE,
                       deadline_s=1)
  with pytest.raises(ValueError, match="teacher 'x': tokenizer object is neither"):
    CrossTokenizerPool([CrossTokenizerTeacher("x", object(), lambda t, m: t, 8)], BYTE,
                       deadline_s=1)


@pytest.mark.parametrize("fail", [False, True])
def test_mixed_routed_pool_loss_batch(bpe, fail):
  host = _host(BYTE, list(zip(PROMPTS, RESPONSES)))
  b, t = host["tokens"].shape
  student, t_bpe, t_byte = _model(STUDENT, 0), _model(T_BPE, 1), _model(T_BYTE, 2)
  forward_bpe = jax.jit(lambda tok, m: _hidden(T_BPE, t_bpe, tok, m))

  def fn(tok, m):
    if fail:
      raise RuntimeError("teacher server down")
    return forward_bpe(tok, m)

  pool = CrossTokenizerPool([CrossTokenizerTeacher("bpe_t", bpe, fn, T_BPE.d_model)], BYTE,
                            deadline_s=60, length_bucket=8)
  answers = pool.answer(host)
  w_row = np.asarray([[1, 0], [1, 0], [0, 1], [0, 1]], np.float32)  # routing
  byte_hidden = _hidden(T_BYTE, t_byte, host["tokens"], host["mask"])
  base = {**host, "teacher_hidden": (np.zeros((b, t, T_BPE.d_model), np.float32), byte_hidden),
          "teacher_weights": np.repeat(w_row[:, None, :], t, axis=1),
          "old_logprobs": np.full((b, t), -3.0, np.float32)}
  batch = answers.loss_entries(base, ["bpe_t", "byte_t"])
  heads = (head_matrix(T_BPE, t_bpe), head_matrix(T_BYTE, t_byte))
  cfg = _adv_cfg(adv_gamma=1.0, is_cap=1.0)
  loss, metrics, _ = _loss_grad(student, batch, heads, cfg, (True, False))
  # By hand: the teacher's forward on its transcoded rows, the rows' span keys.
  rows = crosstok.cross_tokenizer_rows(BYTE, bpe, host, teacher="bpe_t", length_bucket=8)
  hand = {**base, **crosstok.batch_entries(0, rows),
          "teacher_hidden": (forward_bpe(rows.tokens, rows.mask), byte_hidden),
          "loss_mask": host["loss_mask"] * rows.trained}
  if fail:  # a skip: the teacher's weight leaves every row; rows 0, 1 had only it
    hand["teacher_weights"] = np.repeat((w_row * [0, 1])[:, None, :], t, axis=1)
    assert pool.metrics()["skips/bpe_t/error"] == 1
    assert float(metrics["opd_rows"]) == 2
  else:
    assert pool.metrics()["skips/bpe_t/error"] == 0
    assert float(metrics["opd_rows"]) == 4
  want, want_metrics, _ = _loss_grad(student, hand, heads, cfg, (True, False))
  assert float(loss) == float(want)
  assert float(metrics["adv/kl_estimate"]) == float(want_metrics["adv/kl_estimate"])
