"""OPDSource with a teacher of another tokenizer (opd.distill.source + opd.distill.crosstok_pool).

* A BPE student (task BPE, V = 400) with a same-tokenizer BPE teacher
  (domain alpha) and a byte teacher (domain beta) in one routed pool: the
  batch routes each row to its domain's teacher, holds the byte teacher's
  hidden states on its own rows and the span keys that
  ``cross_tokenizer_rows`` computes from the batch's own rows, and the
  advantage-form loss trains on every row.
* A byte student whose samples are not UTF-8 text (random bytes) against a
  BPE teacher without single-byte tokens: ``next_batch`` refuses the batch naming the teacher and the
  example before any teacher runs (no cache compute, no call).
"""
import types

import jax
import numpy as np
import pytest

from opd.distill import crosstok
from opd.distill.crosstok_pool import CrossTokenizerPool, CrossTokenizerTeacher
from opd.distill.faults import FaultTolerantTeachers
from opd.distill.loss import OPDLossConfig, make_opd_loss
from opd.distill.source import OPDConfig, OPDSource
from opd.distill.teachers import Teacher, TeacherPool
from opd.distill.trainer import train_opd
from opd.models import ModelConfig, head_matrix, init_params
from opd.rollout.batches import RolloutConfig
from opd.training.loop_config import LoopConfig, Runtime
from opd.training.optim import OptimConfig

from test_distill_crosstok import BYTE, T_BYTE, _without_single_bytes, bpe  # noqa: F401
from test_distill_loss import _hidden
from test_distill_source import STUDENT as BYTE_STUDENT, mesh, prompts  # noqa: F401

BPE_STUDENT = ModelConfig(vocab_size=400, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                          d_ff=64, tokenizer="bpe:400")
BPE_TEACHER = ModelConfig(vocab_size=400, d_model=24, n_layers=1, n_heads=2, n_kv_heads=1,
                          d_ff=48, tokenizer="bpe:400")
OPD = OPDConfig(RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=8, seq_len=96,
                              length_bucket=0, temperature=0.9),
                loss=OPDLossConfig(form="advantage"), diag_every=0, cache_dtype="float32")


def _source(student_cfg, student_tok, same, cross_tok, cross_model, mesh):
  pool = TeacherPool([same], student_cfg.vocab_size, mesh)
  cfg, params = cross_model
  forward = jax.jit(lambda tok, m: _hidden(cfg, params, tok, m))
  calls = []

  def fn(tok, m):
    calls.append(tok.shape)
    return forward(tok, m)

  cross = CrossTokenizerPool([CrossTokenizerTeacher("tb", cross_tok, fn, cfg.d_model)],
                             student_tok, deadline_s=60.0, length_bucket=8)
  src = OPDSource(student_cfg, OPD, iter(prompts(8)),
                  teachers=FaultTolerantTeachers.from_pool(pool, deadline_s=60.0),
                  heads=pool.heads + (head_matrix(cfg, params),), domains=["alpha", "beta"],
                  total_steps=4, tokenizer=student_tok, mesh=mesh, cross=cross)
  return src, forward, calls


def test_a_routed_pool_of_two_tokenizers_gives_a_batch_the_advantage_form_trains_on(bpe, mesh):
  same = Teacher.random("ta", BPE_TEACHER, 1, domain="alpha")
  byte_teacher = (T_BYTE, init_params(T_BYTE, jax.random.key(2)))
  src, forward, calls = _source(BPE_STUDENT, bpe, same, BYTE, byte_teacher, mesh)
  student = init_params(BPE_STUDENT, jax.random.key(0))
  batch, metrics = src.next_batch(types.SimpleNamespace(params=student), 0)
  assert len(calls) == 1 and metrics["skips/tb/error"] == 0
  host = {k: np.asarray(batch[k]) for k in ("tokens", "targets", "mask", "loss_mask")}
  rows = crosstok.cross_tokenizer_rows(bpe, BYTE, host, teacher="tb", length_bucket=8)
  np.testing.assert_array_equal(np.asarray(batch["xtok_targets_1"]), rows.targets)
  np.testing.assert_array_equal(np.asarray(batch["xtok_span_1"]), rows.span)
  np.testing.assert_array_equal(np.asarray(batch["xtok_sspan_1"]), rows.student_span)
  np.testing.assert_array_equal(np.asarray(batch["teacher_hidden"][1]),
                                np.asarray(forward(rows.tokens, rows.mask)))
  # Routing: a row's weight is its prompt's domain teacher's (rows p*G+g hold prompt p,
  # prompts alternate alpha, beta).
  w = np.asarray(batch["teacher_weights"])[:, 0, :]
  want = np.repeat(np.asarray([[1, 0], [0, 1]] * 2, np.float32), OPD.rollout.group_size, axis=0)
  np.testing.assert_array_equal(w, want)
  loss_fn = make_opd_loss(BPE_STUDENT, src.heads, OPD.loss, teacher_names=src.names,
                          cross_tokenizer=[False, True],
                          sampling_temperature=OPD.rollout.temperature)
  loss, m = jax.jit(lambda p, b: loss_fn(p, b, None))(student, batch)
  assert np.isfinite(float(loss)) and float(m["opd_rows"]) == OPD.rollout.batch_size


def test_a_batch_the_teacher_cannot_read_is_refused_before_any_teacher_runs(bpe, mesh,
                                                                            monkeypatch):
  # The random student's bytes are not UTF-8; a teacher without single-byte
  # tokens cannot spell them (a byte-level BPE with them would).
  _without_single_bytes(monkeypatch, bpe)
  same = Teacher.random("ta", BYTE_STUDENT, 1, domain="alpha")
  bpe_teacher = ModelConfig(vocab_size=400, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                            d_ff=32, tokenizer="bpe:400")
  src, _, calls = _source(BYTE_STUDENT, BYTE, same, bpe,
                          (bpe_teacher, init_params(bpe_teacher, jax.random.key(3))), mesh)
  student = init_params(BYTE_STUDENT, jax.random.key(0))
  with pytest.raises(ValueError, match=r"teacher 'tb', example (alpha|beta)-\d+: .*cannot encode"):
    src.next_batch(types.SimpleNamespace(params=student), 0)
  assert calls == [] and src.cache.computes == 0 and src.teachers.counter.skipped_steps == 0


def test_the_source_refuses_a_cross_teacher_with_the_exact_form(bpe, mesh):
  same = Teacher.random("ta", BPE_TEACHER, 1, domain="alpha")
  with pytest.raises(ValueError, match="loss.form='advantage' \\(got 'exact'\\)"):
    pool = TeacherPool([same], 400, mesh)
    cross = CrossTokenizerPool([CrossTokenizerTeacher("tb", BYTE, lambda t, m: t, 8)], bpe,
                               deadline_s=1.0)
    OPDSource(BPE_STUDENT, OPD.replace(loss=dict(form="exact")), iter(prompts(2)),
              teachers=FaultTolerantTeachers.from_pool(pool, deadline_s=1.0),
              heads=pool.heads + (np.zeros((8, 270), np.float32),), domains=["alpha", "beta"],
              total_steps=1, tokenizer=bpe, mesh=mesh, cross=cross)


@pytest.mark.parametrize("with_plain", [True, False])
def test_train_opd_runs_a_pool_with_a_teacher_of_another_tokenizer(bpe, mesh, with_plain):
  """``Teacher(tokenizer=...)`` of another tokenizer: train_opd asks it through the
  cross-tokenizer pool, after the plain teacher (or alone), and the advantage form trains."""
  plain = [Teacher.random("ta", BPE_TEACHER, 1, domain="alpha")] if with_plain else []
  cross = Teacher("tb", T_BYTE, init_params(T_BYTE, jax.random.key(2)), domain="beta",
                  tokenizer=BYTE)
  cfg = OPD.replace(weighting=dict(schedule="routing" if with_plain else "uniform"))
  run = train_opd(BPE_STUDENT, init_params(BPE_STUDENT, jax.random.key(0)), plain + [cross],
                  prompts(4), cfg, OptimConfig(lr=1e-2), LoopConfig(2, progress=False),
                  runtime=Runtime(mesh, tokenizer=bpe))
  assert len(run.history) == 2
  for m in run.history:
    assert np.isfinite(m["train/loss"]) and m["skips/tb/error"] == 0
    # Every row has its teacher: routed rows of both domains, or the lone cross teacher.
    assert m["train/opd_rows"] == cfg.rollout.batch_size and m["opd/skipped_step"] == 0
    assert m["weight/tb"] > 0 and (m.get("weight/ta", 0.0) > 0) == with_plain


def test_teacher_tokenizer_must_fit_its_model():
  with pytest.raises(ValueError, match="Teacher 'tb': tokenizer: .*exceeds the model's"):
    Teacher("tb", T_BYTE, init_params(T_BYTE, jax.random.key(2)), tokenizer=types.SimpleNamespace(
        vocab_size=400, spec=None))
