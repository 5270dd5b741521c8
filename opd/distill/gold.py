"""A full-vocabulary surrogate for teachers with another vocabulary (GOLD-style; docs/DESIGN.md §3).

The exact form's per-token reverse KL ``KL(p_s ‖ q_k)`` needs one
vocabulary. Across tokenizers this module gives the surrogate of TRL's GOLD
trainer (universal logit distillation): at a position where student and
teacher condition on the same text (the first token of an aligned span,
``opd.distill.crosstok``), with ``S`` the pairs of tokens that spell the
same bytes in both vocabularies (:func:`shared_vocab`)::

    L = Σ_{(v, u) ∈ S} p_s(v) (log p_s(v) − log q(u))             exact part
      + Σ_i | sort↓(p_s[V_s \\ S])_i − sort↓(q[V_t \\ S])_i |       sorted matching

(the shorter sorted list padded with zeros). It is an **approximation**:
the first sum is the reverse KL's terms over the shared tokens only (not
renormalised), and the second matches the two distributions' remaining
probability mass as sorted lists, blind to which token carries which
probability; with one vocabulary (every token shared) it is exactly the
reverse KL, and it is 0 when the distributions agree on ``S`` and hold the
same sorted rest. Logits are materialised (``[N, V]``): a tool for the toy
vocabularies, not wired into ``opd.distill.loss`` (whose exact form refuses
a cross-tokenizer teacher).

Its bias against the span-exact form, measured (``experiments.gold_bias``,
docs/DESIGN.md §3): at aligned positions the span-exact objective is
``Σ_v p(v) (log p(v) − log q̃(v))`` with ``q̃(v)`` the teacher's probability
of the student token's bytes (the expected gradient of the γ = 0 advantage
form). On the strong world's pair (the bpe:1024 student's cold start
sampling code prompts, the bpe:512 code specialist; 512 shared pairs;
6 batches × 16 positions) the surrogate's loss differs by −1.3% ± 5.7% from
the span-exact one (batch mean of the relative gaps ± SE), the cosine of
the batch gradients w.r.t. the student logits is 0.82 ± 0.11 (one batch of
six at 0.29) and the mean per-position cosine 0.87 ± 0.01; with the
student's own tokenizer (control) the gap is ~1e-8 and both cosines 1.0
to 1e-7.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from opd.distill import crosstok

__all__ = ["gold_surrogate", "shared_vocab"]


def shared_vocab(student_tok, teacher_tok) -> tuple[np.ndarray, np.ndarray]:
  """``(student_ids, teacher_ids)`` [S] int32: the pairs spelling the same bytes.

  Special tokens pair by their string; a byte string held by several ids of
  one side pairs its lowest id.
  """
  def by_bytes(tok):
    out = {}
    for i, piece in enumerate(crosstok.token_bytes(tok, range(tok.vocab_size))):
      out.setdefault((i in tok.special_ids, piece), i)
    return out

  s, t = by_bytes(student_tok), by_bytes(teacher_tok)
  common = sorted(set(s) & set(t), key=lambda key: s[key])
  return (np.asarray([s[key] for key in common], np.int32),
          np.asarray([t[key] for key in common], np.int32))


def gold_surrogate(student_logits: jax.Array, teacher_logits: jax.Array, student_ids,
                   teacher_ids, *, temperature: float = 1.0) -> jax.Array:
  """The surrogate ``L`` per position (module docstring): [N] float32.

  Args:
    student_logits: [N, V_s] (differentiated).
    teacher_logits: [N, V_t] (never differentiated).
    student_ids, teacher_ids: [S] the shared pairs (:func:`shared_vocab`).
    temperature: τ > 0 dividing both.

  Raises:
    ValueError: shapes that disagree, or ids outside a vocabulary, naming them.
  """
  s_ids, t_ids = np.asarray(student_ids), np.asarray(teacher_ids)
  n, v_s = student_logits.shape
  if teacher_logits.ndim != 2 or teacher_logits.shape[0] != n:
    raise ValueError(f"teacher_logits.shape={teacher_logits.shape}: expected [N={n}, V_t]")
  v_t = teacher_logits.shape[1]
  if s_ids.shape != t_ids.shape or s_ids.ndim != 1:
    raise ValueError(f"student_ids.shape={s_ids.shape} and teacher_ids.shape={t_ids.shape} "
                     "must be the same [S]")
  for name, ids, v in (("student_ids", s_ids, v_s), ("teacher_ids", t_ids, v_t)):
    if ids.size and (ids.min() < 0 or ids.max() >= v or len(set(ids.tolist())) != ids.size):
      raise ValueError(f"{name} must be distinct ids in [0, {v})")
  if not temperature > 0:
    raise ValueError(f"temperature={temperature} must be > 0")
  lp = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  lq = jax.lax.stop_gradient(
      jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1))
  exact = jnp.sum(jnp.exp(lp[:, s_ids]) * (lp[:, s_ids] - lq[:, t_ids]), axis=-1)
  rest_s = np.setdiff1d(np.arange(v_s), s_ids)
  rest_t = np.setdiff1d(np.arange(v_t), t_ids)
  width = max(rest_s.size, rest_t.size)

  def sorted_rest(logp, rest):
    p = -jnp.sort(-jnp.exp(logp[:, rest]), axis=-1)  # descending
    return jnp.pad(p, ((0, 0), (0, width - rest.size)))

  matched = jnp.sum(jnp.abs(sorted_rest(lp, rest_s) - sorted_rest(lq, rest_t)), axis=-1)
  return exact + matched
