"""Batched autoregressive sampling with the decoder's explicit KV cache.

``generate`` runs one jitted program per (shapes, model config, static sampling
fields): temperature, top-k, top-p and ``max_new_tokens`` are traced, so sweeps
over them reuse one program (the decode width is the static
``max_new_tokens_cap``). The program is a prefill over the prompt batch, once
per distinct prompt (``opd.rollout.prefill``), then a ``lax.while_loop`` of
one-token decode steps that exits after N steps or as soon as every row has
ended. Prompts may be left- or right-padded (or have holes); rows are first
compacted to left padding so that all rows decode in lockstep and share the
cache write index, and RoPE positions are ``cumsum(mask) - 1`` so padding
never shifts them.

Sampling follows the usual order (as ``transformers``' logits warpers):
temperature, then top-k, then top-p on the top-k-renormalised distribution.
``temperature == 0`` is greedy (argmax).

Reported log-probabilities are those of the *untruncated* tempered
distribution, ``log_softmax(logits / T)[token]`` (``T = 1`` for greedy); see
``generate`` for why. Constrained decoding (``opd.rollout.constraint``) masks
the logits to the tokens a finite-state automaton allows before anything
else, and the log-probs are then the masked distribution's.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from opd.config.fields import check_fields, check_int, set_field
from opd.parallel import sharding as shd
from opd.models import ModelConfig, forward, head_matrix
from opd.rollout.constraint import DEAD, Constraint, check_constraint
from opd.rollout.prefill import PrefillRows, distinct_rows, prefill

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to sample. Temperature, top-k, top-p and ``max_new_tokens`` are traced
  arguments of the jitted sampler; the other fields (and the cap) are static.

  Attributes:
    max_new_tokens: N, decode steps at most (also the width of every output).
    max_new_tokens_cap: static decode width C >= N: the KV cache and the
      output buffers hold C steps and the loop stops at the traced N, so
      configs that differ only in N <= C share one compiled program. None
      means C = N (the program is then exactly today's N-step one).
    temperature: T >= 0; 0 means greedy (argmax).
    top_k: keep the k most likely tokens (0 = off). Ignored when greedy.
    top_p: nucleus mass in (0, 1]; keep the smallest set of most likely
      tokens whose probability reaches ``top_p`` (1.0 = off). Ignored when
      greedy.
    eos_ids: token ids that end a row (kept in the output, mask True).
    stop_ids: further ids that end a row exactly as EOS does (e.g. the chat
      template's ``<|end|>``); kept separate so configs can name both.
    pad_id: written into ``tokens`` after a row has ended.
    return_hidden: also return the last hidden state each token was sampled
      from (``SampleOutput.hidden``).
    share_prefill: prefill each distinct prompt of a concrete batch once and
      copy its cache to the rows repeating it (``opd.rollout.prefill``); the
      samples are the same. False prefills every row (a benchmark baseline).
  """
  max_new_tokens: int = 64
  max_new_tokens_cap: int | None = None
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  eos_ids: tuple[int, ...] = ()
  stop_ids: tuple[int, ...] = ()
  pad_id: int = 0
  return_hidden: bool = False
  share_prefill: bool = True

  def __post_init__(self):
    own = "SamplingConfig"
    check_fields(self, own, ints={"max_new_tokens": 1, "top_k": 0, "pad_id": 0},
                 non_negative=("temperature",),  # 0 = greedy
                 floats={"top_p": dict(min_value=0, min_exclusive=True, max_value=1)})  # 1 = off
    for name in ("eos_ids", "stop_ids"):
      value = getattr(self, name)
      if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"SamplingConfig.{name} must be a sequence of token ids, got {value!r}")
      set_field(self, name, tuple(check_int(own, f"{name}[{i}]", v, min_value=0)
                                  for i, v in enumerate(value)))
    check_fields(self, own, bools=("return_hidden", "share_prefill"))
    if self.max_new_tokens_cap is not None:
      set_field(self, "max_new_tokens_cap", check_int(own, "max_new_tokens_cap",
                                                      self.max_new_tokens_cap, min_value=1))
      if self.max_new_tokens_cap < self.max_new_tokens:
        raise ValueError(f"SamplingConfig.max_new_tokens_cap={self.max_new_tokens_cap} < "
                         f"max_new_tokens={self.max_new_tokens}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def end_ids(self) -> tuple[int, ...]:
    """EOS and stop ids together: any of them ends a row."""
    return tuple(sorted(set(self.eos_ids) | set(self.stop_ids)))

  @property
  def cap(self) -> int:
    """The static decode width C (``max_new_tokens_cap``, default N)."""
    return self.max_new_tokens if self.max_new_tokens_cap is None else self.max_new_tokens_cap

  def static_part(self) -> "SamplingConfig":
    """This config with its traced and host-side (``share_prefill``) fields fixed: the jit key."""
    return dataclasses.replace(self, max_new_tokens=self.cap, max_new_tokens_cap=None,
                               temperature=1.0, top_k=0, top_p=1.0, share_prefill=True)

  def replace(self, **changes) -> "SamplingConfig":
    return dataclasses.replace(self, **changes)


class SampleOutput(NamedTuple):
  """What ``generate`` returns (N = ``max_new_tokens``).

  tokens: ``[B, N]`` int32 sampled ids, ``pad_id`` after a row's end.
  mask: ``[B, N]`` bool, True for generated tokens, including the EOS/stop
    token that ended the row.
  logprobs: ``[B, N]`` fp32 ``log_softmax(logits / T)[token]`` of the
    untruncated distribution (``T = 1`` when greedy); 0 where ``mask`` is
    False.
  lengths: ``[B]`` int32, ``mask.sum(-1)``.
  finished: ``[B]`` bool, True when the row ended with an EOS/stop token,
    False when ``max_new_tokens`` cut it off.
  hidden: ``[B, N, D]`` (compute dtype) last hidden state the token was
    sampled from, i.e. the state at the preceding position; zeros where
    ``mask`` is False. None unless ``return_hidden``.
  steps: int32 scalar, decode steps actually run (``max(lengths)``; fewer
    than N when every row ended early).
  """
  tokens: Array
  mask: Array
  logprobs: Array
  lengths: Array
  finished: Array
  hidden: Array | None
  steps: Array


def left_align(tokens: Array, mask: Array, pad_id: int = 0) -> tuple[Array, Array]:
  """Moves each row's real tokens to the right end, keeping their order.

  A stable sort of the mask puts pads first, so left-, right- and
  hole-padded rows all come out left-padded. ``[B, P], [B, P] -> [B, P], [B, P]``.
  """
  mask = mask.astype(bool)
  order = jnp.argsort(mask.astype(jnp.int32), axis=1, stable=True)
  aligned_mask = jnp.take_along_axis(mask, order, axis=1)
  aligned = jnp.where(aligned_mask, jnp.take_along_axis(tokens, order, axis=1), pad_id)
  return aligned.astype(jnp.int32), aligned_mask


def filter_logits(logits: Array, temperature: float | Array, top_k: int | Array = 0,
                  top_p: float | Array = 1.0) -> Array:
  """Tempered logits with -inf outside the top-k / top-p set. [..., V] -> [..., V] fp32.

  Temperature first, then top-k, then top-p on the distribution renormalised
  over the top-k survivors (the ``transformers`` warper order). Tokens tied
  with the last kept value are kept too. The most likely token always
  survives. ``temperature``, ``top_k`` and ``top_p`` may be traced scalars.
  """
  if not isinstance(temperature, jax.core.Tracer) and not np.all(np.asarray(temperature) > 0):
    raise ValueError(f"filter_logits needs temperature > 0, got {temperature!r}")
  return _truncate(logits.astype(jnp.float32) / temperature, top_k, top_p)


def _truncate(logits: Array, top_k, top_p) -> Array:
  """Top-k then top-p masking of tempered fp32 logits with traced k and p.

  One static-size sort of V serves every k: the k-th largest value is the
  top-k threshold, and the nucleus is taken over the first k sorted values
  (the rest masked to -inf before the softmax, i.e. renormalised over the
  top-k survivors). [..., V] -> [..., V].
  """
  V = logits.shape[-1]
  top_k = jnp.asarray(top_k, jnp.int32)
  top_p = jnp.asarray(top_p, jnp.float32)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  sorted_vals = jax.lax.top_k(logits, V)[0]  # [..., V] descending
  rank = jnp.arange(V)
  last = jnp.broadcast_to(k - 1, logits.shape[:-1])[..., None]
  threshold = jnp.take_along_axis(sorted_vals, last, axis=-1)  # smallest top-k value
  probs = jax.nn.softmax(jnp.where(rank < k, sorted_vals, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  # The nucleus is the shortest prefix whose mass reaches top_p: keep a token
  # while the mass strictly before it is still short of top_p (and within k).
  n_keep = jnp.sum((mass_before < top_p) & (rank < k), axis=-1, keepdims=True)  # >= 1
  nucleus = jnp.take_along_axis(sorted_vals, n_keep - 1, axis=-1)
  # top_p = 1 is off: rounding can push the cumulative mass to 1 early.
  threshold = jnp.where(top_p < 1.0, nucleus, threshold)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


class _Knobs(NamedTuple):
  """The traced sampling fields, as device scalars."""
  temperature: Array  # fp32, 0 = greedy
  top_k: Array  # int32, 0 = off
  top_p: Array  # fp32, 1 = off
  max_new_tokens: Array  # int32, <= the static cap

  @classmethod
  def of(cls, sampling: SamplingConfig) -> "_Knobs":
    return cls(jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
               jnp.float32(sampling.top_p), jnp.int32(sampling.max_new_tokens))


def _sample(logits: Array, key: Array, knobs: _Knobs) -> tuple[Array, Array]:
  """One token per row and its untruncated log-prob. [B, V] -> [B], [B].

  Greedy (T = 0) is an exact argmax chosen by ``jnp.where``; it reports
  ``log_softmax(logits)`` (T = 1). The top-k/top-p sort only runs when a
  filter is on and the row is not greedy.
  """
  greedy = knobs.temperature == 0.0
  temperature = jnp.where(greedy, 1.0, knobs.temperature)
  tempered = logits.astype(jnp.float32) / temperature
  filtering = ~greedy & ((knobs.top_k > 0) | (knobs.top_p < 1.0))
  filtered = jax.lax.cond(filtering, lambda x: _truncate(x, knobs.top_k, knobs.top_p),
                          lambda x: x, tempered)
  drawn = jax.random.categorical(key, filtered, axis=-1)
  token = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  logp = jax.nn.log_softmax(tempered, axis=-1)
  return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _head_logits(cfg: ModelConfig, params, hidden: Array) -> Array:
  """``hidden @ head`` as the decoder computes it. [B, D] -> [B, V] fp32."""
  head = head_matrix(cfg, params).astype(cfg.compute_dtype)
  logits = jnp.einsum("BD,DV->BV", hidden, head, preferred_element_type=jnp.float32)
  return nn.with_logical_constraint(logits, ("batch", "vocab"))


def _generate(params, prompt_tokens, prompt_mask, rng, knobs: _Knobs, rows: PrefillRows | None,
              constraint: Constraint | None, *, model_cfg: ModelConfig,
              sampling: SamplingConfig, rules, mesh):
  del mesh  # static only so that each mesh gets its own compiled program
  with nn.logical_axis_rules(rules or ()):
    return _generate_body(params, prompt_tokens, prompt_mask, rng, knobs, rows, constraint,
                          model_cfg, sampling)


def _generate_body(params, prompt_tokens, prompt_mask, rng, knobs: _Knobs,
                   rows: PrefillRows | None, constraint: Constraint | None, cfg: ModelConfig,
                   sampling: SamplingConfig) -> SampleOutput:
  """``sampling``: the static part (``max_new_tokens`` is the cap N); ``rows``: see prefill;
  ``constraint``: a traced table and start states (the row's state is carried in the loop)."""
  B, N, D = prompt_tokens.shape[0], sampling.max_new_tokens, cfg.d_model
  constrain = nn.with_logical_constraint
  tokens, mask = left_align(prompt_tokens, prompt_mask, sampling.pad_id)
  positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
  prompt_len = mask.sum(axis=1).astype(jnp.int32)  # [B]

  # Hidden states only: the head is applied at the last column (every row's
  # last real token after left alignment) instead of over [B, P, V].
  cache, hidden = prefill(cfg, params, tokens, positions, mask, N, rows)  # hidden [B, D]
  logits = _head_logits(cfg, params, hidden)

  end_ids = jnp.asarray(sampling.end_ids or (-1,), jnp.int32)
  state = dict(
      step=jnp.zeros((), jnp.int32),
      cache=cache,
      logits=logits,
      hidden=hidden,
      done=jnp.zeros((B,), bool),
      ended=jnp.zeros((B,), bool),
      out_tokens=constrain(jnp.full((B, N), sampling.pad_id, jnp.int32), ("batch", None)),
      out_mask=constrain(jnp.zeros((B, N), bool), ("batch", None)),
      out_logprobs=constrain(jnp.zeros((B, N), jnp.float32), ("batch", None)),
  )
  if sampling.return_hidden:
    state["out_hidden"] = constrain(jnp.zeros((B, N, D), cfg.compute_dtype),
                                    ("batch", None, "embed"))
  if constraint is not None:
    state["fsm"] = constraint.start.astype(jnp.int32)  # [B] automaton state per row

  def cond(s):
    return (s["step"] < knobs.max_new_tokens) & ~jnp.all(s["done"])

  def body(s):
    t = s["step"]
    logits = s["logits"]
    if constraint is not None:
      # Mask first: temperature, top-k/top-p, the draw and the reported
      # log-prob all see only the tokens the automaton allows.
      nxt = constraint.table[s["fsm"]]  # [B, V] next state per token
      logits = jnp.where(nxt != DEAD, logits, -jnp.inf)
    token, logp = _sample(logits, jax.random.fold_in(rng, t), knobs)
    live = ~s["done"]
    token = jnp.where(live, token, sampling.pad_id)
    hit_end = live & jnp.isin(token, end_ids)
    new = dict(s)
    new["out_tokens"] = s["out_tokens"].at[:, t].set(token)
    new["out_mask"] = s["out_mask"].at[:, t].set(live)
    new["out_logprobs"] = s["out_logprobs"].at[:, t].set(jnp.where(live, logp, 0.0))
    if sampling.return_hidden:
      h = jnp.where(live[:, None], s["hidden"], 0).astype(cfg.compute_dtype)
      new["out_hidden"] = s["out_hidden"].at[:, t].set(h)
    if constraint is not None:
      new["fsm"] = jnp.where(live, jnp.take_along_axis(nxt, token[:, None], axis=1)[:, 0],
                             s["fsm"])
    new["ended"] = s["ended"] | hit_end
    new["done"] = s["done"] | hit_end
    # Finished rows keep stepping in lockstep; their outputs are discarded.
    step_out = forward(cfg, params, token[:, None], (prompt_len + t)[:, None],
                       jnp.ones((B, 1), bool), s["cache"], return_logits=False,
                       return_hidden=True)
    new["hidden"] = step_out.hidden[:, 0]
    new["logits"] = _head_logits(cfg, params, new["hidden"])
    new["cache"] = step_out.cache
    new["step"] = t + 1
    return new

  state = jax.lax.while_loop(cond, body, state)
  return SampleOutput(
      tokens=state["out_tokens"], mask=state["out_mask"], logprobs=state["out_logprobs"],
      lengths=state["out_mask"].sum(axis=1).astype(jnp.int32), finished=state["ended"],
      hidden=state.get("out_hidden"), steps=state["step"])


_generate_jit = jax.jit(_generate, static_argnames=("model_cfg", "sampling", "rules", "mesh"))


def compiled_programs() -> int:
  """Sampler programs compiled so far in this process (one per static key)."""
  return _generate_jit._cache_size()


def _check_inputs(model_cfg: ModelConfig, prompt_tokens, prompt_mask,
                  sampling: SamplingConfig, mesh: Mesh | None, rules) -> int:
  """Raises ValueError on bad inputs; returns the number of devices sharding 'batch'."""
  if not isinstance(model_cfg, ModelConfig):
    raise ValueError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
  if not isinstance(sampling, SamplingConfig):
    raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
  tok_shape, mask_shape = np.shape(prompt_tokens), np.shape(prompt_mask)
  if len(tok_shape) != 2 or 0 in tok_shape:
    raise ValueError(f"prompt_tokens must be a non-empty [B, P] array, got shape {tok_shape}")
  if mask_shape != tok_shape:
    raise ValueError(f"prompt_mask shape {mask_shape} != prompt_tokens shape {tok_shape}")
  if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise ValueError(f"prompt_tokens must hold integer ids, got dtype {prompt_tokens.dtype}")
  if not (prompt_mask.dtype == bool or jnp.issubdtype(prompt_mask.dtype, jnp.integer)):
    raise ValueError(f"prompt_mask must be bool (or 0/1 ints), got dtype {prompt_mask.dtype}")
  V = model_cfg.vocab_size
  for name in ("eos_ids", "stop_ids", "pad_id"):
    value = getattr(sampling, name)
    bad = [v for v in (value if isinstance(value, tuple) else (value,)) if v >= V]
    if bad:
      raise ValueError(f"SamplingConfig.{name}={value} has ids {bad} >= vocab_size={V}")
  if not isinstance(prompt_tokens, jax.core.Tracer) and not isinstance(prompt_mask, jax.core.Tracer):
    # Concrete inputs: catch what jit would otherwise clamp or sample garbage from.
    toks, msk = np.asarray(prompt_tokens), np.asarray(prompt_mask).astype(bool)
    empty = np.flatnonzero(~msk.any(axis=1))
    if empty.size:
      raise ValueError(f"prompt_mask rows {empty.tolist()} have no real tokens; every row "
                       "needs at least one prompt token to condition on")
    real = toks[msk]
    if real.size and (real.min() < 0 or real.max() >= V):
      raise ValueError(f"prompt_tokens ids must lie in [0, vocab_size={V}), got "
                       f"min {real.min()} max {real.max()} at masked-in positions")
  if mesh is None:
    return 1
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  spec = shd.batch_sharding(mesh, rules, 2).spec
  axes = () if spec[0] is None else (spec[0],) if isinstance(spec[0], str) else spec[0]
  n = shd.batch_shards(mesh, rules)
  if tok_shape[0] % n:
    raise ValueError(f"prompt_tokens batch B={tok_shape[0]} is not divisible by the "
                     f"{n} devices of mesh axes {axes} that shard 'batch'")
  return n


def generate(model_cfg: ModelConfig, params, prompt_tokens: Array, prompt_mask: Array,
             rng: Array | int, sampling: SamplingConfig, *, mesh: Mesh | None = None,
             rules=None, constraint: Constraint | None = None) -> SampleOutput:
  """Samples up to ``sampling.max_new_tokens`` tokens per prompt.

  One compiled program per (B, P, model config, static sampling fields,
  mesh, rules, prefill bucket U): a prefill over the prompts (the U distinct
  ones when ``sampling.share_prefill``), then a ``lax.while_loop`` of
  one-token decode steps against a cache of P + C slots (C =
  ``sampling.cap``), exiting after N steps or when every row has ended.
  Temperature, top-k, top-p and N <= C are traced, so a sweep over them
  compiles once. Rows are compacted to left padding internally, so left-, right- and
  hole-padded prompts give the same samples for the same real tokens.

  Reported log-probs are taken from the untruncated tempered distribution
  ``log_softmax(logits / T)`` even when top-k/top-p shaped the sampling.
  This is what a learner recomputes with ``opd.models.token_logprobs(logits,
  tokens, T)`` over prompt+response, so the GRPO importance ratio
  ``exp(logp_new - logp_old)`` is 1 (up to float rounding, ~1e-6 in fp32)
  before the first update and the clipping range means what it says. The
  truncated log-prob is not a smooth function of the parameters (the kept
  set changes with them, and dropped tokens would get -inf), so the learner
  cannot use it as ``logp_new``; reporting it as ``logp_old`` would instead
  scale every ratio by the kept mass, ``Z = p(kept set) <= 1``, and shift the
  clipping window. Greedy reports ``T = 1``.

  With a ``constraint`` the logits are first set to -inf wherever the row's
  automaton state allows no step (``table[state, v] == -1``), so the reported
  log-prob is ``log_softmax(masked logits / T)[token]``: the distribution the
  token was drawn from, renormalised over the allowed tokens. A learner
  scoring a constrained sample must apply the same mask (the allowed set is
  a function of the text, not of the parameters, so it is smooth in them).

  Randomness: step t draws with ``fold_in(rng, t)``; with jax's
  partitionable threefry (default) samples do not depend on sharding.

  Args:
    model_cfg: the decoder's config.
    params: its parameters; may be placed with NamedShardings on ``mesh``.
    prompt_tokens: ``[B, P]`` int token ids; those at real positions must lie
      in ``[0, V)``. Concrete prompts are checked (ValueError naming the
      min/max id and V); a traced batch is the caller's contract
      (``opd.models.check_token_ids``).
    prompt_mask: ``[B, P]`` bool, True for real tokens; every row needs one.
    rng: a ``jax.random.key`` (or an int seed).
    sampling: a ``SamplingConfig``.
    mesh: an ``opd.parallel.sharding.make_mesh`` mesh. When given, the prompts are
      placed batch-sharded over the axes ``rules`` give ``batch`` (B must be a
      multiple of ``opd.parallel.sharding.batch_shards``; ``rollout.sample``
      pads its batch to one) and the decoder's logical constraints apply.
    rules: logical→mesh rule table; defaults to ``opd.parallel.sharding.DEFAULT_RULES``
      when ``mesh`` is given.
    constraint: optional ``opd.rollout.constraint.Constraint(table [S, V],
      start [B])`` (``TokenAutomaton.rows``); traced, so tables of one shape
      share one compiled program.

  Returns:
    A ``SampleOutput``.
  """
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    rng = jax.random.key(int(rng))
  if mesh is not None and rules is None:
    rules = shd.DEFAULT_RULES
  if rules is not None:
    rules = shd.validate_rules(rules)
  if not isinstance(prompt_tokens, jax.Array):
    prompt_tokens = jnp.asarray(np.asarray(prompt_tokens))
  if not isinstance(prompt_mask, jax.Array):
    prompt_mask = jnp.asarray(np.asarray(prompt_mask))
  shards = _check_inputs(model_cfg, prompt_tokens, prompt_mask, sampling, mesh, rules)
  rows = None
  if sampling.share_prefill and not any(isinstance(x, jax.core.Tracer)
                                        for x in (prompt_tokens, prompt_mask)):
    rows = distinct_rows(np.asarray(prompt_tokens), np.asarray(prompt_mask), multiple_of=shards)
  if constraint is not None:
    constraint = check_constraint(constraint, prompt_tokens.shape[0], model_cfg.vocab_size)
  knobs = _Knobs.of(sampling)
  static = dict(model_cfg=model_cfg, sampling=sampling.static_part(), rules=rules, mesh=mesh)
  if mesh is None:
    out = _generate_jit(params, prompt_tokens, prompt_mask, rng, knobs, rows, constraint,
                        **static)
  else:
    batch = shd.batch_sharding(mesh, rules, 2)
    prompt_tokens = jax.device_put(prompt_tokens, batch)
    prompt_mask = jax.device_put(prompt_mask, batch)
    rng, knobs, rows, constraint = jax.device_put((rng, knobs, rows, constraint),
                                                  shd.replicated(mesh))
    with jax.set_mesh(mesh):
      out = _generate_jit(params, prompt_tokens, prompt_mask, rng, knobs, rows, constraint,
                          **static)
  n = sampling.max_new_tokens
  if n == sampling.cap:
    return out
  # The loop ran at most N of the C columns; the rest hold pads and zeros.
  width = lambda x: None if x is None else x[:, :n]
  return out._replace(tokens=width(out.tokens), mask=width(out.mask),
                      logprobs=width(out.logprobs), hidden=width(out.hidden))
