"""OPD's batch source (opd/distill/source.py): routing under annealing, and the
per-teacher diagnostics on the rows each teacher answered.

Checked through ``OPDSource.next_batch`` only (its batch and host metrics),
against references computed here from the rollout's own tokens: which
prompt a row holds is read back from its decoded text, the teachers' and the
student's logits come from plain ``forward`` calls. Tiny models: byte
vocabulary V=270, a student of D=32 x 2 layers, teachers of D=48 x 1 layer.
"""
import types

import jax
import numpy as np
import pytest

from opd.distill.faults import FaultTolerantTeachers
from opd.distill.source import OPDConfig, OPDSource
from opd.rollout.batches import RolloutConfig
from opd.distill.teachers import Teacher, TeacherPool
from opd.models import ModelConfig, forward, init_params
from opd.parallel import sharding
from opd.tasks import Example
from opd.text.tokenizers import ByteTokenizer

EPS32 = float(np.finfo(np.float32).eps)
TOK = ByteTokenizer()
V = TOK.vocab_size
STUDENT = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
WIDE = ModelConfig(vocab_size=V, d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=96)
DOMAINS = ("alpha", "beta")
# float32 cache: the references below see the teachers' hidden states as computed.
OPD = OPDConfig(RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=8, seq_len=64,
                              length_bucket=0), diag_every=0, cache_dtype="float32")


def prompts(n):
  return [Example(d, f"{d}-{i}", "train", 1, f"Say something {d} ({i}).",
                  (("assistant", "x"),), {}) for i in range(n) for d in DOMAINS]


def sharp_teacher(name, seed, domain):
  """A random teacher whose head is scaled up, so its distribution is far from
  uniform (a teacher that did not answer a row has zero hidden states there,
  i.e. uniform logits, which must then be told apart)."""
  p = init_params(WIDE, jax.random.key(seed))
  return Teacher(name, WIDE, {**p, "lm_head": p["lm_head"] * 30.0}, domain)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


@pytest.fixture(scope="module")
def student():
  return init_params(STUDENT, jax.random.key(0))


@pytest.fixture(scope="module")
def teachers():
  return [sharp_teacher("ta", 1, "alpha"), sharp_teacher("tb", 2, "beta")]


def make_source(teachers, mesh, cfg, total_steps):
  pool = TeacherPool(teachers, V, mesh)
  return OPDSource(STUDENT, cfg, iter(prompts(8)),
                   teachers=FaultTolerantTeachers.from_pool(pool, deadline_s=60.0),
                   heads=pool.heads, domains=[t.domain for t in teachers],
                   total_steps=total_steps, tokenizer=TOK, mesh=mesh)


def row_domains(batch):
  """[B] index into DOMAINS of the prompt each row holds, read from its text."""
  tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["mask"]) > 0
  out = []
  for row, m in zip(tokens, mask):
    text = TOK.decode(row[m])
    hits = [k for k, d in enumerate(DOMAINS) if f"Say something {d} (" in text]
    assert len(hits) == 1, text
    out.append(hits[0])
  return np.asarray(out)


def test_routing_annealed_to_the_end_runs_every_teacher_on_every_row(mesh, student, teachers):
  """Annealing over the whole run (2 steps): the weights are
  ``(1 - a) onehot(domain) + a / K`` with a = 1/2 at step 0 and a = 1 (uniform)
  at the last step, on every response token; mixing needs every teacher's
  answer on every row, so none may be run on its own rows only."""
  k = len(teachers)
  source = make_source(teachers, mesh, OPD.replace(weighting=dict(anneal_steps=2)),
                       total_steps=2)
  state = types.SimpleNamespace(params=student)  # next_batch reads .params
  for step, alpha in ((0, 0.5), (1, 1.0)):
    batch, metrics = source.next_batch(state, step)
    domains = row_domains(batch)
    assert set(domains) == {0, 1}  # both domains in the batch
    expected = (1 - alpha) * np.eye(k)[domains] + alpha / k  # [B, K]
    lm = np.asarray(batch["loss_mask"]) > 0
    assert lm.any(axis=1).all()
    w = np.asarray(batch["teacher_weights"])
    # Weights 1/2, 1/4, 3/4 are exact in float32; renormalising sums of two of
    # them divides by 1 up to an ulp.
    for b in range(w.shape[0]):
      np.testing.assert_allclose(w[b][lm[b]], np.broadcast_to(expected[b], (lm[b].sum(), k)),
                                 rtol=0, atol=4 * EPS32)
    # Each teacher answered every row: its hidden states are non-zero on every row.
    mask = np.asarray(batch["mask"]) > 0
    for h in batch["teacher_hidden"]:
      h = np.asarray(h)
      assert all(np.abs(h[b][mask[b]]).max() > 0 for b in range(h.shape[0]))
    assert metrics["opd/masked_rows"] == 0 and metrics["opd/skipped_step"] == 0
  for name in source.names:  # at the last step each teacher weighs 1/K
    assert metrics[f"weight/{name}"] == pytest.approx(1 / k, abs=4 * EPS32)


def _np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_each_teachers_diagnostics_cover_only_the_rows_it_answered(mesh, student, teachers):
  """Routing without annealing: each teacher runs on its own domain's rows
  only. Its ``diag/<teacher>/...`` figures (every response token sampled)
  equal a float64 numpy reference over those rows alone."""
  cfg = OPD.replace(diag_every=1, diag_tokens=100_000)
  source = make_source(teachers, mesh, cfg, total_steps=1)
  batch, metrics = source.next_batch(types.SimpleNamespace(params=student), 0)
  domains = row_domains(batch)
  assert set(domains) == {0, 1}
  tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["mask"]) > 0
  lm = np.asarray(batch["loss_mask"]) > 0
  z = np.asarray(forward(STUDENT, student, tokens, None, mask).logits, np.float64)
  for k, t in enumerate(teachers):
    x = np.asarray(forward(t.cfg, t.params, tokens, None, mask).logits, np.float64)
    own = lm & (domains == k)[:, None]  # response tokens of the rows routed to teacher k
    assert 0 < own.sum() < lm.sum()
    zs, xs = z[own], x[own]
    lp, lq = _np_log_softmax(zs), _np_log_softmax(xs)
    p, q = np.exp(lp), np.exp(lq)
    ref = {"rkl": np.mean(np.sum(p * (lp - lq), -1)),
           "student_entropy": np.mean(-np.sum(p * lp, -1)),
           "entropy_gap": np.mean(-np.sum(q * lq, -1) + np.sum(p * lp, -1))}
    # Bound: the source's float32 logits (hidden @ head, another jitted program)
    # differ from these by at most δ = 48 · eps · max|logit| (a D <= 48 dot
    # product, worst-case rounding). Per token the L1 norms of the gradients
    # w.r.t. the logits are: KL(p‖q) <= 2 E_p|lp - lq| (student) and 2
    # (teacher); H(p) <= 2 E_p|lp|; H(q) <= 2 E_q|lq|. So every figure moves by
    # at most 2 δ · span, span = max over tokens of 1 + E_p|lp - lq| + E_p|lp| +
    # E_q|lq|, plus the float32 sums over V = 270 terms (270 · eps · span).
    scale = max(np.abs(zs).max(), np.abs(xs).max())
    span = np.max(1 + np.sum(p * np.abs(lp - lq), -1) + np.sum(p * np.abs(lp), -1)
                  + np.sum(q * np.abs(lq), -1))
    tol = 2 * 48 * EPS32 * scale * span + 270 * EPS32 * span
    for key, want in ref.items():
      got = metrics[f"diag/{t.name}/{key}"]
      assert abs(got - want) <= tol, (t.name, key, got, want, tol)


def _np_confidence(batch, heads):
  """[B, K] float64 numpy: softmax over teachers of each row's mean log-prob
  of the sampled response tokens (the confidence schedule, per sequence, τ = 1)."""
  lm = np.asarray(batch["loss_mask"]) > 0
  targets = np.asarray(batch["targets"])
  means = []
  for h, w in zip(batch["teacher_hidden"], heads):
    lp = _np_log_softmax(np.asarray(h, np.float64) @ np.asarray(w, np.float64))
    tok = np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    means.append((tok * lm).sum(1) / lm.sum(1))
  c = np.stack(means, -1)
  e = np.exp(c - c.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_routing_annealed_to_confidence_ends_at_the_confidence_weights(mesh, student, teachers):
  """``anneal_to="confidence"`` over the whole run (2 steps): the weights are
  ``(1 - a) onehot(domain) + a c`` with a = 1/2, then 1, where ``c`` is the
  confidence schedule's per-row softmax of mean log-probs, here recomputed in
  float64 numpy from the batch's own teacher hidden states and heads; every
  teacher answers every row (no routed rows)."""
  k = len(teachers)
  cfg = OPD.replace(weighting=dict(anneal_steps=2, anneal_to="confidence"))
  source = make_source(teachers, mesh, cfg, total_steps=2)
  heads = [t.params["lm_head"] for t in teachers]
  state = types.SimpleNamespace(params=student)
  for step, alpha in ((0, 0.5), (1, 1.0)):
    batch, metrics = source.next_batch(state, step)
    domains = row_domains(batch)
    lm = np.asarray(batch["loss_mask"]) > 0
    expected = (1 - alpha) * np.eye(k)[domains] + alpha * _np_confidence(batch, heads)
    assert np.abs(expected - np.eye(k)[domains]).max() > 1e-3  # the target is not routing
    w = np.asarray(batch["teacher_weights"])
    # Log-probs of sharp teachers (|logit| up to ~100) in float32 against
    # float64: ~1e-5 absolute, a weight moves by at most that.
    for b in range(w.shape[0]):
      np.testing.assert_allclose(w[b][lm[b]], np.broadcast_to(expected[b], (lm[b].sum(), k)),
                                 rtol=0, atol=1e-4)
    mask = np.asarray(batch["mask"]) > 0
    for h in batch["teacher_hidden"]:
      h = np.asarray(h)
      assert all(np.abs(h[b][mask[b]]).max() > 0 for b in range(h.shape[0]))
    assert metrics["opd/skipped_step"] == 0


def test_anneal_to_must_be_a_known_target():
  with pytest.raises(ValueError, match="anneal_to"):
    OPD.replace(weighting=dict(anneal_to="routing"))
