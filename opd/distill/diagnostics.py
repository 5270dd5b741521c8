"""Per-teacher distillation diagnostics on a sample of response tokens (docs/DESIGN.md §3).

Analysis, not training: the logits of a few hundred sampled response tokens
are materialised (``[n, V]``). For each teacher:

* ``overlap@k`` (k = 1, 8): ``|top_k(p) ∩ top_k(q)| / k``;
* ``teacher_mass@8``: ``q`` mass on the student's top-8, and
  ``student_mass@8``: ``p`` mass on the teacher's top-8;
* ``rkl_first`` / ``rkl_middle`` / ``rkl_last``: ``KL(p ‖ q)`` over the tokens
  in the first 25%, middle 50% and last 25% of each response (relative
  position ``r = i / n_response``: ``r < 0.25``, ``0.25 <= r < 0.75``,
  ``r >= 0.75``);
* ``entropy_gap``: ``H(q) − H(p)``; ``student_entropy``: ``H(p)``;
* ``argmax_match``: fraction of tokens where ``argmax q`` is the sampled token.

All means are over the sampled tokens (``nan`` for an empty segment).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

OVERLAP_KS = (1, 8)
MASS_K = 8


def sample_response_positions(loss_mask, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Up to ``n`` response positions, uniformly without replacement.

  Args:
    loss_mask: [B, T] response (target) positions.
    n: how many to draw (all of them if fewer).
    seed: numpy seed.

  Returns:
    ``(flat_index [m], relative_position [m])`` with ``m = min(n, #response)``,
    the flat index into ``B * T`` and ``r = i / n_response`` of the token
    within its row's response.
  """
  lm = np.asarray(loss_mask) > 0
  if lm.ndim != 2:
    raise ValueError(f"loss_mask.shape={lm.shape}: expected [B, T]")
  if not isinstance(n, int) or n <= 0:
    raise ValueError(f"n={n!r} must be a positive int")
  order = np.cumsum(lm, axis=1) - 1  # index of each response token in its row
  rel = order / np.maximum(lm.sum(axis=1, keepdims=True), 1)
  flat = np.flatnonzero(lm.reshape(-1))
  pick = np.sort(np.random.default_rng(seed).choice(flat, min(n, flat.size), replace=False))
  return pick, rel.reshape(-1)[pick]


@jax.jit
def _token_stats(z, x, tokens):
  lp, lq = jax.nn.log_softmax(z, -1), jax.nn.log_softmax(x, -1)
  p, q = jnp.exp(lp), jnp.exp(lq)
  out = {"rkl": jnp.sum(p * (lp - lq), -1), "ent_s": -jnp.sum(p * lp, -1),
         "ent_t": -jnp.sum(q * lq, -1),
         "argmax_match": (jnp.argmax(x, -1) == tokens).astype(jnp.float32)}
  for k in OVERLAP_KS:
    top_s, top_t = jax.lax.top_k(z, k)[1], jax.lax.top_k(x, k)[1]
    out[f"overlap@{k}"] = jnp.sum(top_s[:, :, None] == top_t[:, None, :], (1, 2)) / k
  top_s, top_t = jax.lax.top_k(z, MASS_K)[1], jax.lax.top_k(x, MASS_K)[1]
  out[f"teacher_mass@{MASS_K}"] = jnp.sum(jnp.take_along_axis(q, top_s, -1), -1)
  out[f"student_mass@{MASS_K}"] = jnp.sum(jnp.take_along_axis(p, top_t, -1), -1)
  return out


def logit_diagnostics(student_logits, teacher_logits, tokens, rel_pos,
                      temperature: float = 1.0) -> dict[str, float]:
  """Diagnostics of one teacher from ``[n, V]`` logits (see module docstring).

  Args:
    student_logits, teacher_logits: [n, V].
    tokens: [n] the sampled tokens.
    rel_pos: [n] relative position of each token in its response, in [0, 1).
    temperature: τ > 0 dividing both logits.
  """
  z = jnp.asarray(student_logits, jnp.float32)
  x = jnp.asarray(teacher_logits, jnp.float32)
  if z.ndim != 2 or x.shape != z.shape:
    raise ValueError(f"student_logits.shape={z.shape} and teacher_logits.shape={x.shape} must "
                     "be the same [n, V]")
  tokens, rel_pos = np.asarray(tokens), np.asarray(rel_pos)
  if tokens.shape != z.shape[:1] or rel_pos.shape != z.shape[:1]:
    raise ValueError(f"tokens.shape={tokens.shape} and rel_pos.shape={rel_pos.shape}: expected "
                     f"[n]=({z.shape[0]},)")
  if z.shape[1] < MASS_K:
    raise ValueError(f"V={z.shape[1]} is below the top-{MASS_K} the diagnostics use")
  if not (temperature > 0):
    raise ValueError(f"temperature={temperature!r} must be > 0")
  s = {k: np.asarray(v, np.float64) for k, v in
       _token_stats(z / temperature, x / temperature, jnp.asarray(tokens)).items()}
  nan_mean = lambda a: float(a.mean()) if a.size else float("nan")
  out = {k: nan_mean(s[k]) for k in s if k not in ("rkl", "ent_s", "ent_t")}
  for name, sel in (("first", rel_pos < 0.25), ("middle", (rel_pos >= 0.25) & (rel_pos < 0.75)),
                    ("last", rel_pos >= 0.75)):
    out[f"rkl_{name}"] = nan_mean(s["rkl"][sel])
  out["rkl"] = nan_mean(s["rkl"])
  out["entropy_gap"] = nan_mean(s["ent_t"] - s["ent_s"])
  out["student_entropy"] = nan_mean(s["ent_s"])
  return out


def teacher_diagnostics(student_hidden, student_head, teacher_hidden: Sequence,
                        teacher_heads: Sequence, names: Sequence[str], targets, loss_mask, *,
                        n: int = 256, seed: int = 0, temperature: float = 1.0
                        ) -> dict[str, float]:
  """``{"diag/<name>/<metric>": value}`` for every teacher, from hidden states.

  Args:
    student_hidden: [B, T, Ds]; student_head: [Ds, V].
    teacher_hidden: K arrays [B, T, D_k]; teacher_heads: K arrays [D_k, V].
    names: K teacher names.
    targets: [B, T] the sampled next tokens; loss_mask: [B, T] response.
    n: response tokens sampled; seed: their numpy seed.
    temperature: τ.
  """
  if not (len(teacher_hidden) == len(teacher_heads) == len(names)):
    raise ValueError(f"teacher_hidden ({len(teacher_hidden)}), teacher_heads "
                     f"({len(teacher_heads)}) and names ({len(names)}) must have one entry per "
                     "teacher")
  idx, rel = sample_response_positions(loss_mask, n, seed)
  flat = lambda h: jnp.asarray(h).reshape(-1, h.shape[-1])[idx].astype(jnp.float32)
  z = flat(student_hidden) @ jnp.asarray(student_head, jnp.float32)
  tokens = np.asarray(targets).reshape(-1)[idx]
  out = {}
  for name, h, w in zip(names, teacher_hidden, teacher_heads):
    x = flat(h) @ jnp.asarray(w, jnp.float32)
    for k, v in logit_diagnostics(z, x, tokens, rel, temperature).items():
      out[f"diag/{name}/{k}"] = v
  return out
