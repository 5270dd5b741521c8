"""Teachers with another tokenizer (opd.distill.crosstok) against independent references.

* Alignment: the aligned spans of the byte tokenizer's and a task BPE's
  tokenizations of random chat text equal a brute-force union-find over
  bytes (every token glues its bytes together; the components are the
  spans), for hypothesis-drawn strings and random partitions.
* Transcoding: the teacher's ids of a student row are the teacher
  tokenizer's own encoding of the row's text.
* Same tokenizer: the cross-tokenizer path's loss and metrics (so its
  advantages) equal the same-tokenizer sampled-token path's bit for bit,
  its gradient to the reordering of the same sums.
* Mixed pool (byte student, a BPE teacher and a byte teacher, routed or
  uniform): each row's span log-ratios sum to ``Σ_k ŵ_k log π_k(response) −
  log π_S(response)``, each side from a float64 log-softmax of its own
  materialised logits on its own tokenization, and the γ = 1 loss is
  ``−Σ_t c_t Â_t`` of that reference.
* Bad input: named by teacher and example, refused before any teacher runs;
  the exact form refuses a cross-tokenizer teacher by name.
"""
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.distill import crosstok
from opd.distill import loss as loss_lib
from opd.models import ModelConfig, forward, head_matrix
from opd.tasks.tokenizer import bpe_corpus
from opd.text.bpe import BPEConfig, build_bpe
from opd.text.tokenizers import ASSISTANT, BOS, END, EOS, PAD, THINK_OPEN, USER, ByteTokenizer

from test_distill_loss import _hidden, _model

BYTE = ByteTokenizer()
# test_bpe's small corpus: a ~0.3 s build; V = 400 keeps the teacher tiny.
BPE_CFG = BPEConfig(vocab_size=400, corpus_size=500, seed=3)
STUDENT = ModelConfig(vocab_size=BYTE.vocab_size, d_model=32, n_layers=1, n_heads=4,
                      n_kv_heads=2, d_ff=64)
T_BYTE = ModelConfig(vocab_size=BYTE.vocab_size, d_model=24, n_layers=1, n_heads=2,
                     n_kv_heads=1, d_ff=48)
T_BPE = ModelConfig(vocab_size=400, d_model=40, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                    tokenizer="bpe:400")
S_BPE = ModelConfig(vocab_size=400, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64,
                    tokenizer="bpe:400")
TAU = 0.8
PROMPTS = ["What is 12+7?", "Sort: b a c", "héllo wörld", "Count the ✓ marks"]
RESPONSES = ["The answer is 19.", "a b c", "Ça va, 42 ünïcode ✓", "2 marks ✓✓"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  return build_bpe(tmp_path_factory.mktemp("bpe"), BPE_CFG, bpe_corpus)


def _brute_spans(a_lengths, b_lengths):
  """Union-find over bytes: each token glues its bytes; components are spans."""
  n = sum(a_lengths)
  parent = list(range(n))

  def find(x):
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  owner = {}
  for side, lengths in (("a", a_lengths), ("b", b_lengths)):
    start = 0
    for i, length in enumerate(lengths):
      for byte in range(start, start + length):
        parent[find(byte)] = find(start)
        owner.setdefault(side, []).append(i)
      start += length
  comps = []  # components in byte order (a component is an interval: tokens are contiguous)
  for byte in range(n):
    if not comps or find(byte) != comps[-1][0]:
      comps.append((find(byte), byte))
  out = []
  for _, first in comps:
    root = find(first)
    span = []
    for side in ("a", "b"):
      idx = sorted({owner[side][x] for x in range(n) if find(x) == root})
      span += [idx[0], idx[-1] + 1]
    out.append(tuple(span))
  return out


_CHARS = st.sampled_from(list("ab 12+=.\n") + ["é", "✓", "ж", "🙂"])  # 1- to 4-byte UTF-8
_TEXT = st.lists(st.one_of(st.text(alphabet=_CHARS, max_size=12),
                           st.sampled_from([USER, ASSISTANT, END])), max_size=6).map("".join)


@hypothesis.given(text=_TEXT)
@hypothesis.settings(max_examples=60, deadline=None)
def test_alignment_of_byte_and_bpe_tokenizations_equals_brute_force(bpe, text):
  hypothesis.assume(text)
  a = crosstok.token_bytes(BYTE, BYTE.encode(text))
  b = crosstok.token_bytes(bpe, bpe.encode(text))
  # The byte pieces of either tokenization spell the text (special tokens as their strings).
  assert b"".join(a) == b"".join(b) == text.encode("utf-8")
  la, lb = [len(x) for x in a], [len(x) for x in b]
  assert crosstok.align_spans(la, lb) == _brute_spans(la, lb)
  assert crosstok.align_spans(lb, la) == _brute_spans(lb, la)


def test_alignment_of_random_partitions_equals_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(200):
    n = int(rng.integers(1, 30))
    cuts = [sorted(rng.choice(np.arange(1, n), size=rng.integers(0, n), replace=False))
            for _ in range(2)] if n > 1 else [[], []]
    la, lb = (np.diff([0, *c, n]).tolist() for c in cuts)
    assert crosstok.align_spans(la, lb) == _brute_spans(la, lb)


def test_align_spans_refuses_different_strings():
  with pytest.raises(ValueError, match="3 and 4 bytes"):
    crosstok.align_spans([1, 2], [4])
  with pytest.raises(ValueError, match="a_lengths"):
    crosstok.align_spans([0, 3], [3])


def _chat(prompt, response):
  return USER + prompt + END + ASSISTANT, response + END


def test_transcoding_is_the_teachers_own_encoding(bpe):
  for prompt, response in zip(PROMPTS, RESPONSES):
    text = "".join(_chat(prompt, response))
    assert crosstok.transcode(BYTE, bpe, BYTE.encode(text), teacher="t", example="e") == \
        bpe.encode(text)
    assert crosstok.transcode(bpe, BYTE, bpe.encode(text), teacher="t", example="e") == \
        BYTE.encode(text)


def _host(tok, pairs):
  """Right-padded student rows of ``tok``: tokens, targets, mask, loss_mask (response)."""
  seqs = [(tok.encode(p), tok.encode(r)) for p, r in (_chat(*x) for x in pairs)]
  t = max(len(p) + len(r) for p, r in seqs) - 1
  b = len(seqs)
  tokens = np.full((b, t), tok.pad_id, np.int32)
  targets, mask = tokens.copy(), np.zeros((b, t), bool)
  loss_mask = np.zeros((b, t), np.float32)
  for i, (p, r) in enumerate(seqs):
    full = p + r
    n = len(full) - 1
    tokens[i, :n], targets[i, :n], mask[i, :n] = full[:-1], full[1:], True
    loss_mask[i, len(p) - 1:n] = 1.0
  return {"tokens": tokens, "targets": targets, "mask": mask, "loss_mask": loss_mask}


@functools.partial(jax.jit, static_argnames=("cfg", "cross", "student_cfg"))
def _loss_grad(params, batch, heads, cfg, cross, student_cfg=STUDENT):
  fn = loss_lib.make_opd_loss(student_cfg, heads, cfg, cross_tokenizer=cross,
                              sampling_temperature=TAU)
  (loss, metrics), grads = jax.value_and_grad(fn, has_aux=True)(params, batch, None)
  return loss, metrics, grads


def _adv_cfg(**kw):
  return loss_lib.OPDLossConfig(form="advantage", impl="reference", **kw)


@pytest.mark.parametrize("gamma, is_cap", [(0.0, 0.0), (1.0, 2.0)])
def test_same_tokenizer_cross_path_equals_the_same_tokenizer_path_exactly(gamma, is_cap):
  host = _host(BYTE, list(zip(PROMPTS, RESPONSES)))
  b, t = host["tokens"].shape
  rows = crosstok.cross_tokenizer_rows(BYTE, BYTE, host, teacher="t")
  # One tokenizer: the teacher reads the student's ids, every span is one token.
  np.testing.assert_array_equal(rows.tokens, host["tokens"])
  np.testing.assert_array_equal(rows.trained, host["loss_mask"] > 0)
  assert rows.spans == int(host["loss_mask"].sum()) and rows.partial_tokens == 0
  student, teacher = _model(STUDENT, 0), _model(T_BYTE, 1)
  hidden = _hidden(T_BYTE, teacher, host["tokens"], host["mask"])
  rng = np.random.default_rng(1)
  base = {**host, "teacher_hidden": (hidden,), "teacher_weights": np.ones((b, t, 1), np.float32),
          "old_logprobs": (host["loss_mask"] * rng.normal(-3.0, 0.3, (b, t))).astype(np.float32)}
  cfg = _adv_cfg(adv_gamma=gamma, is_cap=is_cap)
  heads = (head_matrix(T_BYTE, teacher),)
  same = _loss_grad(student, base, heads, cfg, (False,))
  cross = _loss_grad(student, {**base, **crosstok.batch_entries(0, rows)}, heads, cfg, (True,))
  assert float(same[0]) == float(cross[0])
  assert {k: float(v) for k, v in same[1].items()} == {k: float(v) for k, v in cross[1].items()}
  assert float(jnp.abs(same[0])) > 0  # the loss is not trivially 0
  # The advantages are bit-equal (the loss and every metric above); the gradient
  # Σ_t c_t Â_t ∇log π_S(y_t) is the same sum, but the two jitted programs may order its
  # reductions differently: over B·T ~ 120 tokens and ~4 stages in quadrature,
  # ~2·sqrt(120)·eps ~ 3e-6 of the gradient's norm; 1e-5 bounds it.
  diff = jax.tree.map(lambda a, b: a - b, same[2], cross[2])
  assert _norm(same[2]) > 0 and _norm(diff) <= 1e-5 * _norm(same[2])


def _norm(tree) -> float:
  return float(np.sqrt(sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(tree))))


def _logprobs64(cfg, params, tokens, targets, mask):
  z = np.asarray(forward(cfg, params, tokens, None, mask).logits, np.float64) / TAU
  z = z - z.max(-1, keepdims=True)
  lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return np.take_along_axis(lp, targets[..., None], -1)[..., 0]


def _response_logprob(tok, cfg, params, prompt, response):
  """log π(response | prompt) on ``tok``'s own encoding of the text (float64)."""
  p, r = tok.encode(prompt), tok.encode(response)
  full = np.asarray([p + r], np.int32)
  lp = _logprobs64(cfg, params, full[:, :-1], full[:, 1:], np.ones((1, full.shape[1] - 1), bool))
  return float(lp[0, len(p) - 1:].sum())


@pytest.mark.parametrize("student_kind, schedule",
                         [("byte", "routing"), ("byte", "uniform"), ("bpe", "routing")])
def test_mixed_pool_span_log_ratios_sum_to_the_response_log_ratio(bpe, student_kind, schedule):
  """Byte student: the BPE teacher is the cross one (a span = one BPE token, several bytes);
  BPE student: the byte teacher is (a span = one BPE token, several teacher bytes)."""
  pairs = list(zip(PROMPTS, RESPONSES))
  if student_kind == "byte":
    s_tok, x_tok, s_cfg, x_cfg, o_cfg = BYTE, bpe, STUDENT, T_BPE, T_BYTE
  else:
    s_tok, x_tok, s_cfg, x_cfg, o_cfg = bpe, BYTE, S_BPE, T_BYTE, T_BPE
  host = _host(s_tok, pairs)
  b, t = host["tokens"].shape
  rows = crosstok.cross_tokenizer_rows(s_tok, x_tok, host, teacher="x", length_bucket=8)
  assert rows.tokens.shape[1] % 8 == 0 and rows.partial_tokens == 0
  # Some spans hold several student bytes (byte student) or several teacher bytes (BPE one).
  side = rows.student_span if student_kind == "byte" else rows.span
  assert np.bincount(side[side < b * t]).max() > 1
  # A span's id is the flat index of its last student token (where its signal goes).
  ids, where = rows.student_span[rows.trained], (np.arange(b)[:, None] * t + np.arange(t))
  assert all(where[rows.trained][ids == i].max() == i for i in np.unique(ids))
  student, t_x, t_o = _model(s_cfg, 0), _model(x_cfg, 1), _model(o_cfg, 2)
  hidden = (_hidden(x_cfg, t_x, rows.tokens, rows.mask),
            _hidden(o_cfg, t_o, host["tokens"], host["mask"]))
  heads = (head_matrix(x_cfg, t_x), head_matrix(o_cfg, t_o))
  # routing: rows 0, 1 -> the cross teacher, rows 2, 3 -> the other; uniform: 1/2 each.
  w_row = (np.asarray([[1, 0], [1, 0], [0, 1], [0, 1]], np.float32) if schedule == "routing"
           else np.full((b, 2), 0.5, np.float32))
  lp_s = _logprobs64(s_cfg, student, host["tokens"], host["targets"], host["mask"])
  keep = host["loss_mask"] > 0
  batch = {**host, "teacher_hidden": hidden, **crosstok.batch_entries(0, rows),
           "teacher_weights": np.repeat(w_row[:, None, :], t, axis=1),
           "old_logprobs": np.where(keep, lp_s, 0.0).astype(np.float32)}
  cfg = _adv_cfg(adv_gamma=1.0, is_cap=1.0)
  loss, metrics, _ = _loss_grad(student, batch, heads, cfg, (True, False), s_cfg)
  # Reference: per row Σ_k ŵ_k log π_k(response) − log π_S(response), each model on its own
  # tokenizer's encoding of the text (independent of the alignment code).
  ref_rows = []
  for i, (prompt, response) in enumerate(pairs):
    p, r = _chat(prompt, response)
    lq = (w_row[i, 0] * _response_logprob(x_tok, x_cfg, t_x, p, r)
          + w_row[i, 1] * _response_logprob(s_tok, o_cfg, t_o, p, r))
    ref_rows.append(lq - _response_logprob(s_tok, s_cfg, student, p, r))
  n = keep.sum()
  # kl_estimate is −Σ_t a_t / n: the row sums of the span log-ratios, over n tokens.
  # float32 log-probs: each of ~n·(1 + K) terms off by ~|log p|·eps, summed: well under 1e-4.
  np.testing.assert_allclose(float(metrics["adv/kl_estimate"]), -np.sum(ref_rows) / n,
                             rtol=1e-4, atol=1e-4)
  # γ = 1 on-policy (r = 1, c = 1): loss = −Σ_t c_t Â_t, Â_t the future sum of the row's a.
  # With token_mean c_t = 1/n; Σ_t Â_t needs each a at its position: the cross teacher's on
  # each span's last student token, the other's per token; from float64 log-probs.
  a = np.zeros((b, t))
  lp_o = _logprobs64(o_cfg, t_o, host["tokens"], host["targets"], host["mask"])
  lp_x = _logprobs64(x_cfg, t_x, rows.tokens, rows.targets, rows.mask)
  for i in range(b):
    a[i] += w_row[i, 1] * np.where(keep[i], lp_o[i] - lp_s[i], 0.0)
    for e in np.flatnonzero(keep[i]):
      flat = i * t + e
      if rows.student_span[i, e] == flat:  # a span's last student token
        span_s = rows.student_span[i] == flat
        span_t = rows.span[i] == flat
        a[i, e] += w_row[i, 0] * (lp_x[i][span_t].sum() - lp_s[i][span_s].sum())
  np.testing.assert_allclose(a.sum(1), ref_rows, rtol=1e-4, atol=1e-4)
  adv = np.cumsum(a[:, ::-1], axis=1)[:, ::-1] * keep
  np.testing.assert_allclose(float(loss), -adv.sum() / n, rtol=1e-4, atol=1e-4)


def test_the_exact_form_refuses_a_cross_tokenizer_teacher_by_name():
  heads = (jnp.zeros((40, 400)),)
  with pytest.raises(ValueError, match="teacher 'bpe_teacher' has another tokenizer"):
    loss_lib.make_opd_loss(STUDENT, heads, loss_lib.OPDLossConfig(),
                           teacher_names=["bpe_teacher"], cross_tokenizer=[True])
  with pytest.raises(ValueError, match="expected \\[D_k, V=270\\]"):  # not flagged: refused
    loss_lib.make_opd_loss(STUDENT, heads, _adv_cfg())


def _byte_host(responses):
  """Byte-tokenizer rows whose responses are raw bytes or ids (what a byte student can
  sample)."""
  pairs = [(USER + "hi" + END + ASSISTANT, r) for r in responses]
  seqs = [(BYTE.encode(p), list(r) + [BYTE.token_to_id(END)]) for p, r in pairs]
  t = max(len(p) + len(r) for p, r in seqs) - 1
  host = {"tokens": np.full((len(seqs), t), BYTE.pad_id, np.int32)}
  host["targets"] = host["tokens"].copy()
  host["mask"], host["loss_mask"] = np.zeros((len(seqs), t), bool), np.zeros((len(seqs), t))
  for i, (p, r) in enumerate(seqs):
    full = p + r
    host["tokens"][i, :len(full) - 1], host["targets"][i, :len(full) - 1] = full[:-1], full[1:]
    host["mask"][i, :len(full) - 1] = True
    host["loss_mask"][i, len(p) - 1:len(full) - 1] = 1.0
  return host


def _without_single_bytes(monkeypatch, tok):
  """``tok`` with no single-byte token (``token_to_id`` of a one-character
  string fails as for a token outside its vocabulary); special tokens kept."""
  real = tok.token_to_id

  def token_to_id(token):
    if len(token) == 1:
      raise ValueError(f"{token!r} is not a token of this tokenizer")
    return real(token)

  monkeypatch.setattr(tok, "token_to_id", token_to_id)


@pytest.mark.parametrize("response, teacher_kind, match", [
    # Bytes that are not UTF-8 are refused only by a teacher without single-byte tokens.
    (b"ok \xff\xfe", "bpe_without_single_bytes",
     "cannot encode the student's text: byte b'\\\\xff' at offset 3 .* no single-byte token"),
    ("say <|end|> now".encode(), "bpe", "spells the teacher's special token '<\\|end\\|>'"),
    ([*b"ok", BYTE.token_to_id(THINK_OPEN)], "few_specials",
     "special token '<think>' \\(id 264\\) is not a special"),
])
def test_bad_rows_are_refused_naming_teacher_and_example(bpe, response, teacher_kind, match,
                                                         monkeypatch):
  teacher_tok = bpe if teacher_kind.startswith("bpe") else ByteTokenizer(
      special_tokens=(BOS, EOS, PAD, USER, ASSISTANT, END))
  if teacher_kind == "bpe_without_single_bytes":
    _without_single_bytes(monkeypatch, teacher_tok)
  host = _byte_host([b"good", response])
  snapshot = {k: v.copy() for k, v in host.items()}
  with pytest.raises(ValueError, match=f"teacher 'math_t', example ex-1: .*{match}"):
    crosstok.cross_tokenizer_rows(BYTE, teacher_tok, host, teacher="math_t",
                                  example_ids=["ex-0", "ex-1"])
  for k, v in snapshot.items():  # the batch is left as it was
    np.testing.assert_array_equal(host[k], v)


def test_bytes_that_are_not_utf8_get_the_byte_level_teachers_single_byte_tokens(bpe):
  """A T = 1 sample can end inside a multi-byte character: the valid text
  around such bytes is the teacher's encoding of that text, each bad byte its
  one-byte token (GPT-2's alphabet: 0xff is 'ÿ', 0xfe 'þ', 0x80 'Ģ')."""
  data = b"ok \xff\xfe end \xe2\x80"  # \xe2\x80: the first two bytes of a 3-byte character
  want = (bpe.encode("ok ") + [bpe.token_to_id("ÿ"), bpe.token_to_id("þ")] + bpe.encode(" end ")
          + [bpe.token_to_id("â"), bpe.token_to_id("Ģ")])
  got = crosstok.transcode(BYTE, bpe, list(data), teacher="math_t", example="ex-0")
  assert got == want
  assert b"".join(crosstok.token_bytes(bpe, got)) == data
  # A whole row with such a response aligns and trains like any other.
  rows = crosstok.cross_tokenizer_rows(BYTE, bpe, _byte_host([b"good", b"ok \xff\xfe"]),
                                       teacher="math_t", example_ids=["ex-0", "ex-1"])
  assert rows.trained[1].sum() > 0


def test_a_tokenizer_without_byte_spans_is_refused(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
  from opd.text.tokenizers import HFTokenizer
  word = Tokenizer(models.WordLevel({"[UNK]": 0, "<|pad|>": 1, "hi": 2}, unk_token="[UNK]"))
  word.pre_tokenizer = pre_tokenizers.Whitespace()
  word.save(str(tmp_path / "tokenizer.json"))
  tok = HFTokenizer(str(tmp_path / "tokenizer.json"), pad_token="<|pad|>")
  with pytest.raises(ValueError, match="teacher 'w'.*neither the byte tokenizer nor a byte-level"):
    crosstok.cross_tokenizer_rows(BYTE, tok, _byte_host([b"hi"]), teacher="w")
