"""Teacher weighting: per-token weights ``w [B, T, K]`` (docs/DESIGN.md §3).

K is the number of teachers here. Three schedules:

* prompt routing (:func:`routing_weights`): the sample's domain picks its
  specialist, one-hot (split evenly if several teachers share the domain);
* confidence weighting (:func:`confidence_weights`): ``softmax_k(c_k / T_c)``
  of a per-teacher confidence ``c`` (:func:`confidence_scores`: mean
  log-prob of the student's tokens under the teacher, or the negative
  teacher entropy), per sequence (``c`` averaged over the response) or per
  token;
* uniform (:func:`uniform_weights`).

Then :func:`anneal` moves the weights linearly to uniform (or to the
confidence weights) over the final ``anneal_steps`` steps (exactly the target
at the last step), and
:func:`apply_availability` zeroes the weights of teachers skipped for a row
and renormalises each token over the teachers left; a row with none left is
masked out of the loss.

:class:`TeacherWeightingConfig` (``config.opd.weighting``) says which of these
OPD applies (``opd.distill.source.OPDSource``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fused_cross_entropy, stats_function
from opd.config import fields

SCORES = ("logprob", "neg_entropy")
GRANULARITIES = ("sequence", "token")
SCHEDULES = ("routing", "confidence", "uniform")
ANNEAL_TARGETS = ("uniform", "confidence")


@dataclasses.dataclass(frozen=True)
class TeacherWeightingConfig:
  """How OPD weighs its K teachers per token; hashable and JSON-ready.

  Attributes:
    schedule: ``"routing"`` (the example's domain picks its teacher,
      :func:`routing_weights`), ``"confidence"`` (:func:`confidence_weights`)
      or ``"uniform"``.
    confidence_by: ``"logprob"`` or ``"neg_entropy"`` (:func:`confidence_scores`;
      scored at the loss's temperature τ).
    confidence_temperature: T_c > 0, the softmax temperature over the
      teachers' confidence.
    confidence_per_token: one weight vector per token instead of per sequence.
    anneal_steps: the weights move linearly to ``anneal_to`` over this many
      final steps of the run (:func:`anneal`; 0: never).
    anneal_to: ``"uniform"`` or ``"confidence"`` (the confidence schedule's
      weights, scored by the three ``confidence_*`` fields); every teacher
      then answers every row while annealing.
  """
  schedule: str = "routing"
  confidence_by: str = "logprob"
  confidence_temperature: float = 1.0
  confidence_per_token: bool = False
  anneal_steps: int = 0
  anneal_to: str = "uniform"

  def __post_init__(self):
    fields.check_fields(self, "TeacherWeightingConfig", ints={"anneal_steps": 0},
                        positive=("confidence_temperature",), bools=("confidence_per_token",),
                        choices={"schedule": SCHEDULES, "anneal_to": ANNEAL_TARGETS,
                                 "confidence_by": SCORES})

  @property
  def granularity(self) -> str:
    """``"token"`` or ``"sequence"``: :func:`confidence_weights`' ``per``."""
    return "token" if self.confidence_per_token else "sequence"

  @property
  def needs_confidence(self) -> bool:
    """The confidence weights are computed at some step (the schedule, or the
    annealing target over a non-empty annealing window)."""
    return self.schedule == "confidence" or (self.anneal_to == "confidence"
                                             and self.anneal_steps > 0)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _check_bt(b: int, t: int) -> None:
  if not (isinstance(b, int) and isinstance(t, int) and b > 0 and t > 0):
    raise ValueError(f"B={b!r} and T={t!r} must be positive ints")


def uniform_weights(b: int, t: int, k: int) -> jax.Array:
  """``1/K`` everywhere: [B, T, K] float32."""
  _check_bt(b, t)
  if not isinstance(k, int) or k <= 0:
    raise ValueError(f"K={k!r} (number of teachers) must be a positive int")
  return jnp.full((b, t, k), 1.0 / k, jnp.float32)


def routing_weights(domains: Sequence[str], teacher_domains: Sequence[str | None],
                    t: int) -> jax.Array:
  """Prompt routing: each row's weight sits on its domain's teacher(s).

  Args:
    domains: [B] the task domain of each sample.
    teacher_domains: [K] each teacher's domain (None: a generalist, never
      routed to).
    t: T, the sequence length.

  Returns:
    [B, T, K] float32, one-hot per row (1/n over n teachers of one domain).

  Raises:
    ValueError: a sample's domain has no teacher (naming the domain and the
      teachers' domains).
  """
  _check_bt(len(domains), t)
  teacher_domains = list(teacher_domains)
  w = np.zeros((len(domains), len(teacher_domains)), np.float32)
  for b, dom in enumerate(domains):
    hits = [k for k, d in enumerate(teacher_domains) if d is not None and d == dom]
    if not hits:
      raise ValueError(f"domains[{b}]={dom!r} has no teacher; teacher domains: "
                       f"{teacher_domains}")
    w[b, hits] = 1.0 / len(hits)
  return jnp.broadcast_to(jnp.asarray(w)[:, None, :], (w.shape[0], t, w.shape[1]))


def confidence_scores(teacher_hidden: Sequence[jax.Array], teacher_heads: Sequence[jax.Array],
                      targets: jax.Array, *, score: str = "logprob", temperature: float = 1.0,
                      impl: str = "auto") -> jax.Array:
  """Per-token confidence of each teacher, computed from hidden states.

  Args:
    teacher_hidden: K arrays [B, T, D_k].
    teacher_heads: K arrays [D_k, V].
    targets: [B, T] the student's next tokens (response tokens where it
      matters; other positions are masked later).
    score: ``"logprob"`` (``log q_k(y_t)``) or ``"neg_entropy"``
      (``−H(q_k,t)``), both at ``temperature``.
    temperature: τ applied to the teachers' logits.
    impl: fused-kernel implementation (``pallas_kernels.stats_function``).

  Returns:
    [B, T, K] float32 (never materialises ``[T, V]`` logits).
  """
  if score not in SCORES:
    raise ValueError(f"score={score!r}: expected one of {SCORES}")
  if len(teacher_hidden) != len(teacher_heads) or not teacher_hidden:
    raise ValueError(f"teacher_hidden has {len(teacher_hidden)} arrays and teacher_heads "
                     f"{len(teacher_heads)}; need the same K >= 1")
  b, t = targets.shape
  out = []
  for h, w in zip(teacher_hidden, teacher_heads):
    flat = h.reshape(b * t, h.shape[-1])
    if score == "logprob":
      s = -fused_cross_entropy(flat, w, targets.reshape(b * t), temperature=temperature,
                               impl=impl)
    else:
      s = -stats_function(impl)(flat, w, [], [], float(temperature)).ent
    out.append(s.reshape(b, t))
  return jnp.stack(out, axis=-1)


def confidence_weights(scores: jax.Array, mask: jax.Array, *, temperature: float = 1.0,
                       per: str = "sequence") -> jax.Array:
  """``softmax_k(c / temperature)``.

  Args:
    scores: [B, T, K] per-token confidence (higher = more confident).
    mask: [B, T] the response tokens the confidence is read on.
    temperature: > 0; small → the most confident teacher, large → uniform.
    per: ``"sequence"`` (one weight vector per row from the mean score over
      its masked tokens) or ``"token"``.

  Returns:
    [B, T, K] float32 summing to 1 over K at every token.
  """
  if per not in GRANULARITIES:
    raise ValueError(f"per={per!r}: expected one of {GRANULARITIES}")
  temperature = float(temperature)
  if not (np.isfinite(temperature) and temperature > 0):
    raise ValueError(f"temperature={temperature} must be finite and > 0")
  if scores.ndim != 3 or mask.shape != scores.shape[:2]:
    raise ValueError(f"scores.shape={scores.shape} must be [B, T, K] and mask.shape="
                     f"{mask.shape} [B, T]")
  scores = scores.astype(jnp.float32)
  if per == "sequence":
    m = mask.astype(jnp.float32)[..., None]
    mean = jnp.sum(scores * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)  # [B, K]
    scores = jnp.broadcast_to(mean[:, None, :], scores.shape)
  return jax.nn.softmax(scores / temperature, axis=-1)


def anneal(weights: jax.Array, step: int, total_steps: int, anneal_steps: int,
           target: jax.Array | None = None) -> jax.Array:
  """Moves the weights linearly to ``target`` (uniform by default) over the
  last ``anneal_steps`` steps.

  With steps numbered ``0 .. total_steps − 1`` the mix is
  ``(1 − α) ŵ + α t̂`` with ``α = (step − (total_steps − anneal_steps) + 1) /
  anneal_steps`` clipped to [0, 1]; ``α = 1`` (exactly the target) at the
  last step. ``ŵ`` and ``t̂`` are ``weights`` and ``target`` renormalised per
  token; the uniform target is ``1 / K``.

  Args:
    weights: [B, T, K] >= 0, each token summing to a positive number.
    step, total_steps, anneal_steps: ints, ``0 <= anneal_steps <= total_steps``.
    target: None (uniform) or [B, T, K] like ``weights`` (e.g. the
      confidence weights, ``OPDConfig.anneal_to="confidence"``).
  """
  for name, v in (("step", step), ("total_steps", total_steps), ("anneal_steps", anneal_steps)):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
      raise ValueError(f"{name}={v!r} must be a non-negative int")
  if anneal_steps > total_steps:
    raise ValueError(f"anneal_steps={anneal_steps} exceeds total_steps={total_steps}")
  if target is not None and tuple(target.shape) != tuple(weights.shape):
    raise ValueError(f"anneal target shape {tuple(target.shape)} != weights shape "
                     f"{tuple(weights.shape)}")
  w = normalize(weights)
  alpha = anneal_alpha(step, total_steps, anneal_steps)
  if alpha == 0.0:
    return w
  goal = jnp.full_like(w, 1.0 / w.shape[-1]) if target is None else normalize(target)
  if alpha == 1.0:
    return goal
  return (1.0 - alpha) * w + alpha * goal


def anneal_alpha(step: int, total_steps: int, anneal_steps: int) -> float:
  """:func:`anneal`'s mixing fraction α at ``step`` (0 when not annealing)."""
  if anneal_steps == 0:
    return 0.0
  return min(max((step - (total_steps - anneal_steps) + 1) / anneal_steps, 0.0), 1.0)


def normalize(weights: jax.Array) -> jax.Array:
  """Per-token renormalisation over K.

  Raises:
    ValueError: (concrete inputs) a negative / non-finite weight, or a token
      whose weights do not sum to a positive number, naming its index.
  """
  w = jnp.asarray(weights, jnp.float32)
  if w.ndim != 3:
    raise ValueError(f"weights.shape={w.shape}: expected [B, T, K]")
  if not isinstance(w, jax.core.Tracer):
    wn = np.asarray(w)
    bad = ~np.isfinite(wn) | (wn < 0)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"weights[{idx}]={wn[idx]}: weights must be finite and >= 0")
    zero = wn.sum(-1) <= 0
    if zero.any():
      idx = tuple(int(i) for i in np.argwhere(zero)[0])
      raise ValueError(f"weights[{idx}] sum to {wn[idx].sum()}: weights must sum to a positive "
                       "number at every token")
  return w / jnp.sum(w, axis=-1, keepdims=True)


def apply_availability(weights: jax.Array, available: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Drops skipped teachers and renormalises each token over those left.

  Args:
    weights: [B, T, K] >= 0.
    available: [B, K] bool, whether teacher k answered for row b.

  Returns:
    ``(w, row_ok)``: ``w`` [B, T, K] float32 summing to 1 at every token of a
    row with an available, positively weighted teacher and all-zero
    elsewhere; ``row_ok`` [B] bool, False for a row that no (weighted)
    teacher answered (its loss is masked).
  """
  w = jnp.asarray(weights, jnp.float32)
  available = jnp.asarray(available, bool)
  if w.ndim != 3 or available.shape != (w.shape[0], w.shape[2]):
    raise ValueError(f"weights.shape={w.shape} must be [B, T, K] and available.shape="
                     f"{available.shape} [B, K]")
  w = jnp.where(available[:, None, :], w, 0.0)
  total = jnp.sum(w, axis=-1, keepdims=True)
  ok = total > 0
  w = jnp.where(ok, w / jnp.where(ok, total, 1.0), 0.0)
  return w, jnp.any(ok[..., 0], axis=1)


def weight_metrics(weights: jax.Array, mask: jax.Array, names: Sequence[str]) -> dict[str, float]:
  """``{"weight/<name>": mean weight over the masked tokens}`` for logging."""
  m = np.asarray(mask, np.float32)[..., None]
  mean = (np.asarray(weights, np.float32) * m).sum((0, 1)) / max(m.sum(), 1.0)
  return {f"weight/{n}": float(v) for n, v in zip(names, mean)}
