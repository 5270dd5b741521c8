"""Teachers with another tokenizer: span log-ratios at common byte boundaries (docs/DESIGN.md §3).

A teacher whose tokenizer is not the student's cannot score the student's
token ids, but the advantage form (``opd.distill.advantage``) only needs
``log π(text)`` under each model, which is tokenizer-free. For every row:

1. **Transcoding.** The student's row (prompt + sampled response, ids of the
   student's tokenizer) is cut at its special tokens; each special token
   maps to the teacher's special token of the same string, and each plain
   run of bytes is re-encoded by the teacher's tokenizer (its canonical
   tokenization; the byte tokenizer takes the bytes as they are). Bytes
   that are not UTF-8 (a student sampling at T = 1 can end a response
   inside a multi-byte character, or put two such halves together) are
   spelled by a byte-level BPE's single-byte tokens, the valid text around
   them encoded as text: a tokenization of the same bytes, not necessarily
   the canonical one at those bytes (a run of a strong-world OPD stopped on
   such a sample within its first steps when they were refused). A teacher
   of the student's own tokenizer (same object, or same ``spec``) reads the
   student's ids unchanged: that is what the same-tokenizer path scores.
2. **Alignment.** Each token of either tokenization covers a byte span of
   the row's bytes; the common byte boundaries (offsets where both
   tokenizations start a token) cut the row into **aligned spans**, the
   smallest groups of consecutive tokens of both sides that end together
   (:func:`align_spans`).
3. **Span log-ratio.** For a span of student tokens ``y_i..y_e`` and teacher
   tokens ``u_j..u_f``::

       a_span = Σ_{j..f} log π_T(u | u_<) − Σ_{i..e} log π_S(y | y_<)

   every log-prob at the sampling temperature (the teacher's further divided
   by τ_T), the prefixes being the same bytes on both sides. The span's
   signal sits on its **last student token** ``e`` (0 on the others of the
   span); teacher k's signals are weighted by ``ŵ_{e,k}``
   (``opd.distill.teacher_weighting``: routing, confidence, uniform,
   annealing as today) and summed with the same-tokenizer teachers'
   ``ŵ_k (log π_k(y_t) − log π_S(y_t))``. The sum is the advantage form's
   ``a_t``; its discounted future sum ``Â_OPD`` follows unchanged. With
   γ = 1 the estimate is the sequence-level reverse KL's, exact: the sum of
   the span log-ratios of a row is ``log π_T(text) − log π_S(text)`` under
   each model's tokenization of it. With γ < 1 the earlier tokens of a
   span see its signal discounted as if the span's tokens were steps.
   When the tokenizers coincide every span is one token and the path
   equals the same-tokenizer sampled-token path bit for bit
   (``tests/opd/distill/test_distill_crosstok.py``).

A span is trained when it does not start the row (the row's first token is
never predicted) and every student token in it is a response token
(``loss_mask``); a span mixing response and non-response tokens (never with
the chat format, whose turns start and end at special tokens) is not
trained: its tokens leave ``loss_mask`` (counted in ``partial_tokens``).

Only the advantage form takes such a teacher: the exact form's
full-vocabulary reverse KL needs the student's vocabulary, and
``opd.distill.loss.make_opd_loss`` refuses it naming the teacher.

Bad input is refused before any teacher runs, naming the teacher and the
example: student bytes that are not UTF-8 text for a teacher without a
single-byte token for them, a plain run of text that the teacher's
tokenizer would read as a special token, a student special token the
teacher's tokenizer does not have, a tokenizer that is not byte-level.

Batch keys per cross-tokenizer teacher k (index in the teachers' K order):
``teacher_hidden[k]`` [B, T'_k, D_k] is the teacher's hidden states on its
own rows, plus ``xtok_targets_<k>`` [B, T'_k] (its next tokens),
``xtok_span_<k>`` [B, T'_k] and ``xtok_sspan_<k>`` [B, T] (for each teacher
/ student position the flat index ``b·T + e`` of its trained span's last
student token, ``B·T`` when in no trained span).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from opd.distill import advantage as advantage_lib
from opd.text.bytelevel import byte_decoder as _byte_decoder
from opd.text.bytelevel import is_byte_level as _is_byte_level
from opd.text.tokenizers import ByteTokenizer
from pallas_kernels.inputs import normalized_weights

__all__ = ["CrossTokenizerRows", "advantage_loss", "align_spans", "batch_entries", "check_batch",
           "check_tokenizer", "cross_tokenizer_rows", "same_tokenizer", "span_log_ratio",
           "token_bytes", "transcode"]


def same_tokenizer(a, b) -> bool:
  """The two tokenizers give the same ids to the same text (same object or spec)."""
  spec_a, spec_b = getattr(a, "spec", None), getattr(b, "spec", None)
  return a is b or (spec_a is not None and spec_a == spec_b)


def check_tokenizer(tokenizer, who: str) -> None:
  """Raises ValueError naming ``who`` unless ``tokenizer``'s tokens have byte spans."""
  if not (isinstance(tokenizer, ByteTokenizer) or _is_byte_level(tokenizer)):
    raise ValueError(f"{who}: tokenizer {type(tokenizer).__name__} is neither the byte tokenizer "
                     "nor a byte-level BPE: its tokens have no byte spans to align")


def token_bytes(tokenizer, ids: Sequence[int]) -> list[bytes]:
  """The bytes each token of ``ids`` stands for (special tokens: their string's UTF-8).

  Args:
    tokenizer: a ``ByteTokenizer`` or a byte-level BPE (``BPETokenizer``,
      ``HFTokenizer`` with a ``ByteLevel`` decoder).
    ids: token ids.
  """
  check_tokenizer(tokenizer, "token_bytes")
  decoder, out = _byte_decoder(), []
  for i in ids:
    i = int(i)
    if isinstance(tokenizer, ByteTokenizer) and i < 256:
      out.append(bytes([i]))
    elif i in tokenizer.special_ids:
      out.append(tokenizer.id_to_token(i).encode("utf-8"))
    else:
      out.append(bytes(decoder[c] for c in tokenizer.id_to_token(i)))
  return out


def align_spans(a_lengths: Sequence[int], b_lengths: Sequence[int]
                ) -> list[tuple[int, int, int, int]]:
  """The aligned spans of two tokenizations of one byte string.

  Args:
    a_lengths, b_lengths: each token's byte length (> 0), in order; both
      must cover the same number of bytes.

  Returns:
    ``[(a_start, a_end, b_start, b_end), ...]``: token index ranges
    ``[start, end)`` of each span, in order; a span ends at each byte offset
    where both tokenizations end a token, and nowhere else.

  Raises:
    ValueError: a token of length <= 0, or totals that differ.
  """
  a, b = np.asarray(a_lengths, np.int64), np.asarray(b_lengths, np.int64)
  for name, x in (("a_lengths", a), ("b_lengths", b)):
    if x.ndim != 1 or (x.size and x.min() <= 0):
      raise ValueError(f"{name}={x.tolist()} must be positive byte lengths")
  ends_a, ends_b = np.cumsum(a), np.cumsum(b)
  if int(ends_a[-1] if a.size else 0) != int(ends_b[-1] if b.size else 0):
    raise ValueError(f"the tokenizations cover {int(a.sum())} and {int(b.sum())} bytes: not the "
                     "same string")
  common = np.intersect1d(ends_a, ends_b)  # every span's end offset, increasing
  # A token belongs to the span of the first common end at or after its own end.
  cut_a = np.searchsorted(ends_a, common) + 1
  cut_b = np.searchsorted(ends_b, common) + 1
  starts_a, starts_b = np.concatenate([[0], cut_a[:-1]]), np.concatenate([[0], cut_b[:-1]])
  return [(int(w), int(x), int(y), int(z))
          for w, x, y, z in zip(starts_a, cut_a, starts_b, cut_b)]


def _where(teacher: str, example: str) -> str:
  return f"teacher {teacher!r}, example {example}"


def transcode(student_tok, teacher_tok, ids: Sequence[int], *, teacher: str, example: str
              ) -> list[int]:
  """The teacher's ids for the student's row ``ids`` (module docstring, step 1).

  Args:
    student_tok, teacher_tok: the two tokenizers.
    ids: the student's ids of one row.
    teacher, example: named in errors.

  Raises:
    ValueError: naming ``teacher`` and ``example``: a student special token
      the teacher lacks, student bytes that are not UTF-8 text (the teacher
      encodes strings), text the teacher would read as a special token, or
      a teacher encoding that does not spell the same bytes.
  """
  ids = [int(i) for i in ids]
  if same_tokenizer(student_tok, teacher_tok):
    return ids
  out, run = [], []
  pieces = token_bytes(student_tok, ids)

  def flush():
    if run:
      out.extend(_encode_plain(teacher_tok, b"".join(run), teacher=teacher, example=example))
      run.clear()

  for i, piece in zip(ids, pieces):
    if i not in student_tok.special_ids:
      run.append(piece)
      continue
    flush()
    token = piece.decode("utf-8")
    try:
      j = teacher_tok.token_to_id(token)
    except ValueError:
      j = None
    if j is None or j not in teacher_tok.special_ids:
      raise ValueError(f"{_where(teacher, example)}: the student's special token {token!r} "
                       f"(id {i}) is not a special token of the teacher's tokenizer")
    out.append(j)
  flush()
  return out


def _encode_plain(teacher_tok, data: bytes, *, teacher: str, example: str) -> list[int]:
  """The teacher's ids for a run of plain (non-special) bytes."""
  if isinstance(teacher_tok, ByteTokenizer):
    return list(data)  # the byte tokenizer reads any bytes, special strings as plain bytes
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    # The valid text before, the bad bytes as single-byte tokens, the rest likewise.
    ids = _encode_plain(teacher_tok, data[:e.start], teacher=teacher, example=example)
    for b in data[e.start:e.end]:
      ids.append(_single_byte_id(teacher_tok, b, teacher=teacher, example=example, offset=e.start))
    return ids + _encode_plain(teacher_tok, data[e.end:], teacher=teacher, example=example)
  ids = teacher_tok.encode(text) if text else []
  special = [i for i in ids if i in teacher_tok.special_ids]
  if special:
    raise ValueError(f"{_where(teacher, example)}: the student's plain text spells the "
                     f"teacher's special token {teacher_tok.id_to_token(special[0])!r}; the "
                     "teacher would read a role marker the student did not sample")
  if b"".join(token_bytes(teacher_tok, ids)) != data:
    raise ValueError(f"{_where(teacher, example)}: the teacher's tokenizer cannot encode the "
                     f"student's text {text[:40]!r}: its tokens spell other bytes")
  return ids


def _single_byte_id(teacher_tok, b: int, *, teacher: str, example: str, offset: int) -> int:
  """A byte-level BPE's token for the one byte ``b`` (its alphabet's character)."""
  char = {v: k for k, v in _byte_decoder().items()}[b]
  try:
    j = teacher_tok.token_to_id(char) if _is_byte_level(teacher_tok) else None
  except ValueError:  # not in its vocabulary
    j = None
  if j is None:
    raise ValueError(f"{_where(teacher, example)}: the teacher's tokenizer cannot encode the "
                     f"student's text: byte {bytes([b])!r} at offset {offset} of a plain run is "
                     "not UTF-8 and the teacher has no single-byte token for it")
  return j


@dataclasses.dataclass(frozen=True)
class CrossTokenizerRows:
  """One cross-tokenizer teacher's rows for a student batch (host arrays).

  Attributes:
    tokens, targets: [B, T'] int32 the teacher's input ids and next ids.
    mask: [B, T'] bool real teacher tokens.
    span: [B, T'] int32 per teacher position, the flat student index
      ``b·T + e`` of the trained span its target lies in (``B·T``: none).
    student_span: [B, T] int32, the same for student positions.
    trained: [B, T] bool, student positions in trained spans.
    partial_tokens: student response tokens in spans that mix response and
      other tokens (not trained).
    spans: trained spans in the batch.
  """
  tokens: np.ndarray
  targets: np.ndarray
  mask: np.ndarray
  span: np.ndarray
  student_span: np.ndarray
  trained: np.ndarray
  partial_tokens: int
  spans: int


def cross_tokenizer_rows(student_tok, teacher_tok, host, *, teacher: str,
                         example_ids: Sequence[str] | None = None,
                         length_bucket: int = 0) -> CrossTokenizerRows:
  """Transcodes and aligns every row of a student batch (module docstring).

  Args:
    student_tok, teacher_tok: the student's and the teacher's tokenizers.
    host: ``tokens, targets, mask, loss_mask`` [B, T] (right-padded rows,
      ``opd.rollout.episodes.batch_episodes``).
    teacher: the teacher's name (errors).
    example_ids: B example ids for errors (default: the row index).
    length_bucket: T' is the longest teacher row rounded up to a multiple
      of this (0: not rounded).

  Raises:
    ValueError: any row the teacher cannot read (:func:`transcode`), naming
      the teacher and the example; raised before anything is returned.
  """
  for who, tok in (("the student", student_tok), (f"teacher {teacher!r}", teacher_tok)):
    check_tokenizer(tok, who)
  tokens, targets = np.asarray(host["tokens"]), np.asarray(host["targets"])
  mask, resp = np.asarray(host["mask"], bool), np.asarray(host["loss_mask"]) > 0
  b, t = tokens.shape
  if example_ids is not None and len(example_ids) != b:
    raise ValueError(f"example_ids has {len(example_ids)} ids for B={b} rows")
  names = list(example_ids) if example_ids is not None else [f"row {i}" for i in range(b)]
  rows, student_span = [], np.full((b, t), b * t, np.int32)
  trained, partial, n_spans = np.zeros((b, t), bool), 0, 0
  for r in range(b):
    n = int(mask[r].sum())
    if not mask[r, :n].all():
      raise ValueError(f"host['mask'] row {r} is not right-padded")
    if n == 0:
      rows.append(([], []))
      continue
    full = [int(tokens[r, 0])] + [int(x) for x in targets[r, :n]]
    u = transcode(student_tok, teacher_tok, full, teacher=teacher, example=names[r])
    s_len = [len(p) for p in token_bytes(student_tok, full)]
    u_len = [len(p) for p in token_bytes(teacher_tok, u)]
    t_span = []
    for i0, i1, j0, j1 in align_spans(s_len, u_len):
      pos = np.arange(max(i0, 1) - 1, i1 - 1)  # student positions predicting full[i0..i1)
      ok = i0 > 0 and resp[r, pos].all()
      if not ok:
        partial += int(resp[r, pos].sum()) if i0 > 0 else 0
        t_span.extend([b * t] * (j1 - max(j0, 1)))
        continue
      flat = r * t + int(pos[-1])
      student_span[r, pos], trained[r, pos] = flat, True
      t_span.extend([flat] * (j1 - j0))
      n_spans += 1
    rows.append((u, t_span))
  longest = max((len(u) - 1 for u, _ in rows), default=0)
  t2 = max(longest, 1)
  if length_bucket:
    t2 = -(-t2 // length_bucket) * length_bucket
  out_tok = np.full((b, t2), teacher_tok.pad_id, np.int32)
  out_tgt, out_mask = out_tok.copy(), np.zeros((b, t2), bool)
  out_span = np.full((b, t2), b * t, np.int32)
  for r, (u, t_span) in enumerate(rows):
    m = len(u) - 1
    if m > 0:
      out_tok[r, :m], out_tgt[r, :m], out_mask[r, :m] = u[:-1], u[1:], True
      out_span[r, :m] = t_span
  return CrossTokenizerRows(out_tok, out_tgt, out_mask, out_span, student_span, trained,
                            partial, n_spans)


def batch_entries(k: int, rows: CrossTokenizerRows) -> dict[str, np.ndarray]:
  """The loss batch's keys of cross-tokenizer teacher ``k`` (module docstring)."""
  return {f"xtok_targets_{k}": rows.targets, f"xtok_span_{k}": rows.span,
          f"xtok_sspan_{k}": rows.student_span}


def check_batch(batch, cross: Sequence[int], widths: Sequence[int]) -> None:
  """The cross-tokenizer teachers' batch keys and shapes (module docstring).

  Raises:
    ValueError: a missing key or a shape that is not ``[B, T'_k]`` /
      ``[B, T]`` / ``[B, T'_k, D_k]``, naming the key.
  """
  bt = tuple(batch["tokens"].shape)
  for k in cross:
    keys = (f"xtok_targets_{k}", f"xtok_span_{k}", f"xtok_sspan_{k}")
    missing = [key for key in keys if key not in batch]
    if missing:
      raise ValueError(f"batch is missing {missing} of cross-tokenizer teacher {k}; it has "
                       f"{sorted(batch)}")
    t2 = tuple(batch[keys[0]].shape)
    want = {keys[0]: t2, keys[1]: t2, keys[2]: bt}
    for key, shape in want.items():
      if tuple(batch[key].shape) != shape or len(shape) != 2 or shape[0] != bt[0]:
        raise ValueError(f"batch[{key!r}].shape={tuple(batch[key].shape)}: expected "
                         f"{'[B, T]' if key == keys[2] else '[B, T_k]'} with B={bt[0]}")
    h = batch["teacher_hidden"][k]
    if tuple(h.shape) != t2 + (widths[k],):
      raise ValueError(f"batch['teacher_hidden'][{k}].shape={tuple(h.shape)}: expected "
                       f"[B, T'_k, D_k]={t2 + (widths[k],)} (the teacher's own rows)")


def span_log_ratio(logp: jax.Array, teacher_logp: jax.Array, student_span: jax.Array,
                   teacher_span: jax.Array) -> jax.Array:
  """``a_span`` on each trained span's last student token, 0 elsewhere: [B, T].

  Args:
    logp: [B, T] ``log π_S(y_t)`` (only trained positions are read).
    teacher_logp: [B, T'] the teacher's log-prob of its own next tokens.
    student_span, teacher_span: [B, T], [B, T'] flat span-end indices
      (``B·T``: in no trained span).
  """
  b, t = logp.shape
  n = b * t
  # A one-token span sums one term onto 0: exactly that term.
  s = jax.ops.segment_sum(logp.reshape(n), student_span.reshape(n), n + 1)[:n]
  q = jax.ops.segment_sum(teacher_logp.reshape(-1), teacher_span.reshape(-1), n + 1)[:n]
  end = student_span.reshape(n) == jnp.arange(n, dtype=student_span.dtype)
  return jnp.where(end, q - s, 0.0).reshape(b, t)


def advantage_loss(config: Any, h_s: jax.Array, w_s: jax.Array, teacher_hidden, heads, batch,
                   keep: jax.Array, coef: jax.Array, cross: Sequence[int], *,
                   temperature: float) -> tuple[jax.Array, dict]:
  """The advantage form with cross-tokenizer teachers ``cross`` (module docstring).

  Args:
    config, h_s, w_s, batch, keep, coef, temperature: as
      ``opd.distill.advantage.advantage_loss``.
    teacher_hidden: K arrays: ``[B·T, D_k]`` for a same-tokenizer teacher,
      ``[B·T'_k, D_k]`` (its own rows) for a cross-tokenizer one; divided
      by τ_T already.
    heads: K arrays ``[D_k, V_k]``.
    cross: the indices of the cross-tokenizer teachers.
  """
  b, t = keep.shape
  tau, impl = float(temperature), config.impl
  targets = batch["targets"].reshape(b * t)
  logp = -pallas_kernels.fused_cross_entropy(
      h_s, w_s, targets, mask=keep.reshape(b * t), temperature=tau, impl=impl).reshape(b, t)
  if not config.adv_beta:
    return advantage_lib.policy_gradient_loss(config, logp, None, batch, keep, coef)
  w_hat = normalized_weights(batch["teacher_weights"].reshape(b * t, -1), keep.reshape(b * t))
  same = [k for k in range(len(heads)) if k not in cross]
  parts = []
  if same:
    lq = advantage_lib.teacher_token_logprobs(
        [teacher_hidden[k] for k in same], [heads[k] for k in same], w_hat[:, same], targets,
        temperature=tau, impl=impl).reshape(b, t)
    parts.append(lq - jnp.sum(w_hat[:, same], axis=1).reshape(b, t) * logp)
  sg_logp = jax.lax.stop_gradient(jnp.where(keep, logp, 0.0))
  for k in cross:
    t_span = batch[f"xtok_span_{k}"]
    on = t_span.reshape(-1) < b * t
    lq_k = advantage_lib.teacher_token_logprobs(
        [teacher_hidden[k]], [heads[k]], on[:, None].astype(jnp.float32),
        batch[f"xtok_targets_{k}"].reshape(-1), temperature=tau, impl=impl).reshape(t_span.shape)
    a_k = span_log_ratio(sg_logp, lq_k, batch[f"xtok_sspan_{k}"], t_span)
    parts.append(w_hat[:, k].reshape(b, t) * a_k)
  signal = functools.reduce(jnp.add, parts)
  return advantage_lib.policy_gradient_loss(config, logp, None, batch, keep, coef, signal=signal)
