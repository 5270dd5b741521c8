"""Constrained decoding: a token-level automaton compiled once into a dense table (docs/DESIGN.md §6).

A pattern is a regular expression over the *text* a row writes. ``outlines-core``
builds a deterministic automaton over the tokenizer's vocabulary from it
(``Vocabulary(eos_id, {piece: [ids]})`` with byte-string pieces, UTF-8
matched byte by byte; ``Index(regex, vocab).get_transitions()``). The
pieces are ``opd.text.bytelevel.vocabulary_bytes``: the byte tokenizer's
ids 0..255 are one byte each; a byte-level BPE's token is the byte string
its byte-level decoder writes, so one token may cover several bytes of the
pattern, across its groups and alternatives, and a token that would write
past the end of a match is not allowed. ``compile_patterns`` turns one or
more such automata into one dense table::

  table[s, v] = the state after token v in state s, or -1 (v not allowed)

with the patterns' states side by side (pattern i starts at ``starts[i]``),
only the states reachable from a start kept. In an accepting state the end
ids (EOS and the chat template's stop tokens) are allowed and lead back to
the same state, and only there: a row that ends has written a full match.
States are padded with all-(-1) rows to a multiple of ``state_bucket``, so
different pattern sets of one padded size give one table shape.

The sampler (``opd.rollout.sampler.generate(..., constraint=...)``) takes
``Constraint(table [S, V], start [B])`` as a *traced* argument: each decode
step gathers ``table[state]`` to mask the logits and ``table[state, token]``
to advance, so a new pattern of the same table shape never recompiles.
``TokenAutomaton.rows`` picks each row's pattern.

Special tokens other than the end ids are never allowed inside a pattern
(``outlines-core`` sees only the byte pieces), nor ids at or above the
tokenizer's vocabulary (a model's V may exceed it), nor a token whose bytes
hold NUL. A table is ``S x V`` int32, ~1 KB per state at the byte
tokenizer's V = 270, 4 KB at a BPE's V = 1024.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd.text.bytelevel import vocabulary_bytes

Array = jax.Array
DEAD = -1  # table entry of a token not allowed
# Each pattern is compiled followed by a NUL byte; a state is accepting iff
# NUL leads from it to outlines-core's final state. needed as of
# outlines-core 0.2.14: its final states drop some continuations (``0(\.5)?``
# accepts "0" but not "0.5"; ``(a|ab)`` not "ab"). NUL is never allowed: the
# sentinel is its own id, V (outside every table), and no token holding a NUL
# byte enters the vocabulary.
_SENTINEL_BYTES, _SENTINEL_RE = b"\x00", r"\x00"


class Constraint(NamedTuple):
  """The sampler's traced constraint.

  table: ``[S, V]`` int32 next state per (state, token), ``DEAD`` = not allowed.
  start: ``[B]`` int32 each row's initial state.
  """
  table: Array | np.ndarray
  start: Array | np.ndarray


def check_constraint(constraint, B: int, V: int) -> Constraint:
  """``constraint`` as int32 arrays for a batch of B rows over V ids (the sampler's check);
  ValueError naming the field on a bad table or start."""
  if not isinstance(constraint, Constraint):
    raise ValueError(f"constraint must be an opd.rollout.constraint.Constraint, got "
                     f"{type(constraint).__name__}")
  table, start = constraint
  if np.ndim(table) != 2 or np.shape(table)[1] != V or np.shape(table)[0] < 1:
    raise ValueError(f"constraint.table shape {np.shape(table)} must be [S, V={V}]")
  if np.shape(start) != (B,):
    raise ValueError(f"constraint.start shape {np.shape(start)} must be [B={B}]")
  for name, x in (("table", table), ("start", start)):
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
      raise ValueError(f"constraint.{name} must hold integers, got {jnp.asarray(x).dtype}")
  if not isinstance(start, jax.core.Tracer):
    st = np.asarray(start)
    if st.min() < 0 or st.max() >= np.shape(table)[0]:
      raise ValueError(f"constraint.start values must lie in [0, S={np.shape(table)[0]}), got "
                       f"min {st.min()} max {st.max()}")
  return Constraint(jnp.asarray(table, jnp.int32), jnp.asarray(start, jnp.int32))


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
  """Patterns compiled over one vocabulary.

  Attributes:
    table: ``[S, V]`` int32, ``DEAD`` where a token is not allowed.
    starts: the initial state of each pattern, in the given order.
    final: ``[S]`` bool, states where the text so far is a full match.
    patterns: the regular expressions, in order.
    end_ids: the ids allowed in final states (they end a row).
  """
  table: np.ndarray
  starts: tuple[int, ...]
  final: np.ndarray
  patterns: tuple[str, ...]
  end_ids: tuple[int, ...]

  @property
  def num_states(self) -> int:
    return int(self.table.shape[0])

  def rows(self, pattern_ids: Sequence[int]) -> Constraint:
    """The sampler's ``Constraint`` with row b following pattern ``pattern_ids[b]``."""
    ids = np.asarray(pattern_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) \
        or ids.min() < 0 or ids.max() >= len(self.starts):
      raise ValueError(f"pattern_ids={ids.tolist()!r:.80} must be a non-empty 1-D sequence of "
                       f"ints in [0, {len(self.starts)})")
    return Constraint(self.table, np.asarray(self.starts, np.int32)[ids])

  def walk(self, ids: Sequence[int], pattern: int = 0) -> int:
    """The state after ``ids`` from pattern ``pattern``'s start (``DEAD`` once disallowed)."""
    s = self.starts[pattern]
    for t in ids:
      if s == DEAD:
        return DEAD
      s = int(self.table[s, int(t)])
    return s


def _vocabulary(tokenizer, vocab_size: int, end: tuple[int, ...]):
  """outlines-core's ``Vocabulary``: every id below ``vocab_size`` that is not a
  special token nor an end id, as the bytes it writes
  (``opd.text.bytelevel.vocabulary_bytes``), ids with a NUL byte left out, and
  the sentinel NUL as id ``vocab_size``; ``end[0]`` is its EOS.

  The end ids are added per final state by ``compile_patterns``.
  """
  from outlines_core import Vocabulary  # noqa: PLC0415  (only constrained callers need it)
  try:
    pieces = vocabulary_bytes(tokenizer)
  except ValueError as e:
    raise ValueError(f"constrained decoding takes the byte tokenizer or a byte-level BPE: "
                     f"{e} (docs/DESIGN.md §6)") from e
  by_piece: dict[bytes, list[int]] = {_SENTINEL_BYTES: [vocab_size]}
  for i, piece in pieces.items():
    if i < vocab_size and i not in end and piece and _SENTINEL_BYTES not in piece:
      by_piece.setdefault(piece, []).append(i)
  return Vocabulary(end[0], by_piece)


def compile_patterns(patterns: Sequence[str], tokenizer, *, end_ids: Sequence[int],
                     vocab_size: int | None = None, state_bucket: int = 64) -> TokenAutomaton:
  """One table for ``patterns`` over ``tokenizer``'s vocabulary (module docstring).

  Args:
    patterns: regular expressions (``outlines-core``'s syntax, anchored at
      both ends), one per row kind.
    tokenizer: an ``opd.text.tokenizers`` tokenizer.
    end_ids: ids that end a row (``SamplingConfig.end_ids``); non-empty.
    vocab_size: V of the table (default the tokenizer's; the model's V).
    state_bucket: pad the state count to a multiple of this.

  Returns:
    A ``TokenAutomaton``.
  """
  from outlines_core import Index  # noqa: PLC0415
  if isinstance(patterns, str) or not patterns or not all(isinstance(p, str) for p in patterns):
    raise ValueError(f"patterns must be a non-empty sequence of str, got {patterns!r:.80}")
  V = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
  end = tuple(sorted({int(e) for e in end_ids}))
  if not end or min(end) < 0 or max(end) >= V:
    raise ValueError(f"end_ids={tuple(end_ids)} must be non-empty ids in [0, {V})")
  if isinstance(state_bucket, bool) or not isinstance(state_bucket, int) or state_bucket < 1:
    raise ValueError(f"state_bucket={state_bucket!r} must be an int >= 1")
  vocab = _vocabulary(tokenizer, V, end)
  sentinel = V
  rows, finals, starts = [], [], []
  for p, pattern in enumerate(patterns):
    try:  # outlines-core raises its own error types
      index = Index(f"(?:{pattern}){_SENTINEL_RE}", vocab)
    except Exception as e:
      raise ValueError(f"patterns[{p}]={pattern!r} does not compile: {e}") from e
    trans = index.get_transitions()
    final = set(index.get_final_states())
    # Reachable states over text bytes (not the sentinel, not EOS), in BFS order.
    start = index.get_initial_state()
    order, seen = [start], {start}
    for s in order:
      for tok, nxt in sorted(trans.get(s, {}).items()):
        if tok not in (sentinel, end[0]) and nxt not in seen:
          seen.add(nxt)
          order.append(nxt)
    ids = {s: len(rows) + i for i, s in enumerate(order)}
    starts.append(ids[start])
    for s in order:
      row = np.full(V, DEAD, np.int32)
      for tok, nxt in trans.get(s, {}).items():
        if tok not in (sentinel, end[0]):
          row[tok] = ids[nxt]
      accepting = trans.get(s, {}).get(sentinel) in final
      if accepting:
        row[list(end)] = ids[s]
      if (row == DEAD).all():
        raise ValueError(f"patterns[{p}]={pattern!r}: a reachable state allows no token")
      rows.append(row)
      finals.append(accepting)
  S = state_bucket * -(-len(rows) // state_bucket)
  table = np.full((S, V), DEAD, np.int32)
  table[:len(rows)] = rows
  final = np.zeros(S, bool)
  final[:len(finals)] = finals
  return TokenAutomaton(table=table, starts=tuple(starts), final=final,
                        patterns=tuple(patterns), end_ids=end)
