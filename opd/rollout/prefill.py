"""The sampler's prefill, run once per distinct prompt (docs/DESIGN.md §2).

GRPO and OPD batches repeat every prompt G times (one row per sample of the
group). The prefill of equal prompts is equal, so ``generate`` runs the
decoder over one row per distinct prompt and copies that row's KV cache and
last hidden state to every row that shares it; decoding then runs over all B
rows exactly as before, with the same per-step keys, so the samples do not
change (the prefill of a row does not depend on the other rows).

Shapes stay static: the distinct rows are padded to a bucket U (the next
power of two, a multiple of the devices that shard the batch), so a batch of
P prompts x G samples compiles one program whatever its prompts. Batches
where the bucket exceeds B / 2 take the plain path (U = B, no copies).
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opd.models import KVCache, ModelConfig, forward, init_cache
from opd.models.v4.cache import V4Cache
from opd.models.v4.model import grow_v4_cache

Array = jax.Array


class PrefillRows(NamedTuple):
  """Which rows to prefill, and where each row reads its prefill from.

  rows: ``[U]`` int32 batch rows whose prompts are prefilled: the first row
    of each distinct prompt, then copies of ``rows[0]`` up to the bucket U.
  source: ``[B]`` int32, row b's prompt is that of ``rows[source[b]]``.
  """
  rows: Array
  source: Array


def prefill_bucket(distinct: int, multiple_of: int = 1) -> int:
  """U: the next power of two >= ``distinct``, rounded up to ``multiple_of``."""
  if distinct < 1 or multiple_of < 1:
    raise ValueError(f"prefill_bucket needs distinct >= 1 and multiple_of >= 1, got "
                     f"distinct={distinct} multiple_of={multiple_of}")
  u = 1 << (distinct - 1).bit_length()
  return multiple_of * -(-u // multiple_of)


def distinct_rows(tokens: np.ndarray, mask: np.ndarray, *,
                  multiple_of: int = 1) -> PrefillRows | None:
  """Groups the rows of a concrete ``[B, P]`` prompt batch by their real tokens.

  Two rows are one prompt when their masked-in tokens are equal in order,
  whatever their padding (the sampler left-aligns rows before the prefill).
  Returns None when the bucket U (``prefill_bucket``) is more than B / 2:
  sharing would then save under half the prefill and cost the copies.
  """
  tokens, mask = np.asarray(tokens), np.asarray(mask).astype(bool)
  if tokens.ndim != 2 or tokens.shape != mask.shape:
    raise ValueError(f"distinct_rows needs [B, P] tokens and mask of one shape, got "
                     f"{tokens.shape} and {mask.shape}")
  B = tokens.shape[0]
  index: dict[bytes, int] = {}
  first, source = [], np.empty(B, np.int32)
  for b in range(B):
    key = np.ascontiguousarray(tokens[b][mask[b]], np.int64).tobytes()
    if key not in index:
      index[key] = len(first)
      first.append(b)
    source[b] = index[key]
  U = prefill_bucket(len(first), multiple_of)
  if 2 * U > B:
    return None
  rows = np.asarray(first + [first[0]] * (U - len(first)), np.int32)
  return PrefillRows(rows, source)


def append_slots(cache: KVCache, n: int) -> KVCache:
  """``n`` empty (zero, masked-out) slots after the last. [B, K, S, Dh] -> [B, K, S + n, Dh]."""
  pad = lambda x, axes: nn.with_logical_constraint(
      jnp.pad(x, [(0, n if a == "cache_length" else 0) for a in axes]), axes)
  axes = ("batch", "kv_heads", "cache_length", "head_dim")
  return cache._replace(k=tuple(pad(x, axes) for x in cache.k),
                        v=tuple(pad(x, axes) for x in cache.v),
                        mask=pad(cache.mask, ("batch", "cache_length")))


def prefill(cfg: ModelConfig, params, tokens: Array, positions: Array, mask: Array,
            decode_slots: int, rows: PrefillRows | None = None) -> tuple[KVCache, Array]:
  """The prompt batch's cache and each row's last hidden state.

  ``tokens``, ``positions``, ``mask``: ``[B, P]`` left-aligned prompts (every
  row's last real token in column P - 1). With ``rows``, the decoder runs
  over the U rows ``rows.rows`` only and row b gets the cache and hidden
  state of ``rows.source[b]``. The cache holds the P prompt slots while the
  prompt attends (P keys rather than P + N), then ``decode_slots`` empty
  slots are appended. Returns the cache ``[B, K, P + decode_slots, Dh]`` per
  layer (a DeepSeek-V4 ``V4Cache`` gains room for ``decode_slots`` positions
  instead) and the hidden state ``[B, D]`` the first token is sampled from.
  """
  B, P = tokens.shape
  if rows is not None:
    tokens, positions, mask = (x[rows.rows] for x in (tokens, positions, mask))
  out = forward(cfg, params, tokens, positions, mask, init_cache(cfg, tokens.shape[0], P),
                return_logits=False, return_hidden=True)
  cache, hidden = out.cache, out.hidden[:, -1]  # hidden [U, D]
  take = lambda x: jnp.take(x, rows.source, axis=0)  # [U, ...] -> [B, ...]
  if isinstance(cache, V4Cache):  # DeepSeek-V4: every leaf is per row (rings, entries)
    if rows is not None:
      cache, hidden = jax.tree.map(take, cache), take(hidden)
    return grow_v4_cache(cfg, cache, decode_slots), hidden
  if rows is not None:
    cache = cache._replace(k=tuple(map(take, cache.k)), v=tuple(map(take, cache.v)),
                           mask=take(cache.mask))
    hidden = take(hidden)
  return append_slots(cache, decode_slots), hidden
