"""Grain input pipelines: LM pre-training and SFT batches of static shape.

Both pipelines turn variable-length token sequences into ``[B, T]`` numpy
batches with the same keys:

  tokens       [B, T] int32    model input ids (``pad_id`` at padding)
  targets      [B, T] int32    next-token ids: ``targets[b, t]`` is the token
                               that follows ``tokens[b, t]`` in its document
  loss_mask    [B, T] float32  1.0 where ``targets`` is trained on
  mask         [B, T] bool     True at real (non-pad) input tokens; this is
                               the decoder's ``mask`` argument
  positions    [B, T] int32    position of each token inside its own
                               document (restarts at 0 per document, 0 at pad)
  segment_ids  [B, T] int32    1, 2, ... per document in the row, 0 at pad

Sequences are shifted per document *before* rows are built, so a target never
crosses from one document into the next.

Modes (the trade-off):
  ``"pad"``   one document per row, right-padded. Exact: attention only ever
              sees the document itself. Wastes ``1 - mean_len / T`` of compute.
  ``"pack"``  first-fit packing of several documents per row (grain's
              ``FirstFitPackIterDataset``), little padding. Feed packed rows
              to the decoder with ``positions`` and ``segment_ids`` (both
              restart per document): attention is then masked to each
              document, so a packed row computes exactly what the separate
              documents would (tested in tests/opd/models/test_decoder.py).
              Both modes are exact; packing wastes less compute.

Ordering and sharding: the document list is shuffled with a seed derived
from ``seed`` (a new permutation per epoch), repeated for ``num_epochs``
(``None`` = forever), then process ``p`` of ``P`` takes documents
``p, p + P, p + 2P, ...`` of that stream. Documents are first truncated to a
multiple of ``P`` so that every epoch splits evenly and all processes see the
same number of documents. ``batch_size`` is the per-process batch; the global
batch is ``batch_size * P``. With ``mode="pack"`` and a finite number of
epochs, processes can still end with different numbers of batches (packing
density differs between shards): multi-host training should use
``num_epochs=None`` and stop after a fixed number of steps.

Checkpointing: ``it = iter(ds)`` is a ``grain.DatasetIterator``;
``it.get_state()`` returns a JSON-serialisable dict and ``it.set_state(s)`` on
a fresh iterator of the same pipeline resumes with exactly the batches that
would have followed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from opd.config.fields import check_fields, check_int, set_field

MODES = ("pad", "pack")
LONG_POLICIES = ("split", "truncate", "error")
BATCH_KEYS = ("tokens", "targets", "loss_mask", "mask", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Shape, order and sharding of a pipeline's batches (``lm_dataset``, ``sft_dataset``).

  Attributes:
    seq_len: T, tokens per row.
    batch_size: B, rows per batch on this process.
    seed: shuffling seed; the same seed gives the same order.
    mode: ``"pad"`` (one document per row) or ``"pack"`` (first-fit packing);
      see the module docstring for the trade-off. None: the pipeline's
      default (``lm_dataset``: pack, ``sft_dataset``: pad).
    num_epochs: passes over the data; ``None`` repeats forever.
    shuffle: shuffle documents (a fresh permutation each epoch).
    drop_remainder: drop a final batch with fewer than B rows.
    process_index, process_count: this process's shard; None:
      ``jax.process_index()`` / ``jax.process_count()``.
    pad_id: id written at padding in ``tokens`` and ``targets``.
    too_long: a document with more than T + 1 tokens is ``"split"`` into
      consecutive pieces of T (no target is lost), ``"truncate"``d to its
      first T + 1 tokens, or raises (``"error"``). None: the pipeline's
      default (``lm_dataset``: split; ``sft_dataset``: error, since silently
      cutting an SFT example drops response tokens).
    num_packing_bins: rows packed at once (default B); more bins pack denser
      but mix documents from further apart in the stream.
    vocab_size: when given, ids outside ``[0, vocab_size)`` raise.
  """
  seq_len: int
  batch_size: int
  seed: int = 0
  mode: str | None = None
  num_epochs: int | None = 1
  shuffle: bool = True
  drop_remainder: bool = True
  process_index: int | None = None
  process_count: int | None = None
  pad_id: int = 0
  too_long: str | None = None
  num_packing_bins: int | None = None
  vocab_size: int | None = None

  def __post_init__(self):
    own = "DataConfig"
    check_fields(self, own, ints={"seq_len": 1, "batch_size": 1, "seed": 0, "pad_id": 0},
                 bools=("shuffle", "drop_remainder"))
    for name in ("num_epochs", "num_packing_bins", "vocab_size", "process_count"):
      set_field(self, name, check_int(own, name, getattr(self, name), min_value=1,
                                      allow_none=True))
    set_field(self, "process_index", check_int(own, "process_index", self.process_index,
                                               min_value=0, allow_none=True))
    for name, options in (("mode", MODES), ("too_long", LONG_POLICIES)):
      if getattr(self, name) is not None and getattr(self, name) not in options:
        raise ValueError(f"{own}.{name} must be one of {options}, got {getattr(self, name)!r}")
    if (self.process_index is not None and self.process_count is not None
        and self.process_index >= self.process_count):
      raise ValueError(f"{own}.process_index={self.process_index} must be in "
                       f"[0, process_count={self.process_count})")
    if self.vocab_size is not None and self.pad_id >= self.vocab_size:
      raise ValueError(f"{own}.pad_id={self.pad_id} is outside the vocabulary "
                       f"[0, {self.vocab_size})")

  def replace(self, **changes) -> "DataConfig":
    return dataclasses.replace(self, **changes)

  def _resolved(self, mode: str, too_long: str) -> "DataConfig":
    """A copy with ``mode``/``too_long`` defaulted and this process's shard filled in."""
    index, count = self.process_index, self.process_count
    if index is None or count is None:
      import jax  # deferred: building a pipeline should not require jax otherwise
      index = jax.process_index() if index is None else index
      count = jax.process_count() if count is None else count
    if index >= count:
      raise ValueError(f"DataConfig.process_index={index} must be in [0, process_count={count})")
    return self.replace(mode=self.mode or mode, too_long=self.too_long or too_long,
                        process_index=int(index), process_count=int(count))


def _shuffle_seed(seed: int) -> int:
  # grain shuffles epoch e with seed + e, so seeds s and s + 1 would share
  # permutations one epoch apart; hashing the user seed decorrelates them.
  return int(np.random.SeedSequence(int(seed)).generate_state(1)[0])


def _check_ids(ids: np.ndarray, index: int, vocab_size: int | None, what: str):
  if ids.size and ids.min() < 0:
    raise ValueError(f"{what} {index}: negative token id {int(ids.min())}")
  if vocab_size is not None and ids.size and ids.max() >= vocab_size:
    raise ValueError(f"{what} {index}: token id {int(ids.max())} >= vocab_size={vocab_size}")


def _shift_and_cut(index: int, ids: np.ndarray, weights: np.ndarray, opts: DataConfig,
                   what: str) -> list[dict[str, np.ndarray]]:
  """One document of length n -> pieces of at most T (input, target) pairs."""
  if len(ids) < 2:
    return []  # nothing to predict
  tokens, targets, loss_mask = ids[:-1], ids[1:], weights[1:]
  T = opts.seq_len
  n = len(tokens)
  if n > T:
    if opts.too_long == "error":
      raise ValueError(
          f"{what} {index} has {n + 1} tokens, more than seq_len + 1 = {T + 1}; "
          f"pass too_long='split' or 'truncate'")
    if opts.too_long == "truncate":
      n = T
  return [{"tokens": tokens[s:min(s + T, n)], "targets": targets[s:min(s + T, n)],
           "loss_mask": loss_mask[s:min(s + T, n)]} for s in range(0, n, T)]


class _Flatten(grain.experimental.FlatMapTransform):
  """Each upstream element is already a list of pieces; emit them one by one."""
  max_fan_out = 1 << 20  # part of the FlatMap interface; the iterator version ignores it

  def flat_map(self, element):
    return element


def _pad_row(piece: Mapping[str, np.ndarray], T: int, pad_id: int) -> dict[str, np.ndarray]:
  n = len(piece["tokens"])
  out = {
      "tokens": np.full((T,), pad_id, np.int32),
      "targets": np.full((T,), pad_id, np.int32),
      "loss_mask": np.zeros((T,), np.float32),
      "positions": np.zeros((T,), np.int32),
      "segment_ids": np.zeros((T,), np.int32),
  }
  out["tokens"][:n] = piece["tokens"]
  out["targets"][:n] = piece["targets"]
  out["loss_mask"][:n] = piece["loss_mask"]
  out["positions"][:n] = np.arange(n)
  out["segment_ids"][:n] = 1
  out["mask"] = out["segment_ids"] > 0
  return out


def _rekey_packed(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  segment_ids = row["tokens_segment_ids"].astype(np.int32)
  return {
      "tokens": row["tokens"].astype(np.int32),
      "targets": row["targets"].astype(np.int32),
      # Packing pads loss_mask with 0, so padded targets are never trained on.
      "loss_mask": row["loss_mask"].astype(np.float32),
      "mask": segment_ids > 0,
      "positions": row["tokens_positions"].astype(np.int32),
      "segment_ids": segment_ids,
  }


def _build(source: Sequence[Any], to_ids: Callable[[int, Any], tuple[np.ndarray, np.ndarray]],
           opts: DataConfig, what: str) -> grain.IterDataset:
  """Shared pipeline: order, shard, tokenize, shift, cut, pad/pack, batch."""
  if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
    raise ValueError(f"{what}s must be a random-access sequence (list, tuple, grain data "
                     f"source), got {type(source).__name__}")
  n_docs = len(source) - len(source) % opts.process_count
  if n_docs == 0:
    raise ValueError(
        f"{len(source)} {what}s cannot be split over process_count={opts.process_count}")
  ds = grain.MapDataset.source(source)[:n_docs]
  # Carry the source index along so errors name the offending document.
  ds = ds.map_with_index(lambda i, x: (i, x))
  if opts.shuffle:
    ds = ds.shuffle(seed=_shuffle_seed(opts.seed))
  ds = ds.repeat(opts.num_epochs)
  ds = ds[opts.process_index::opts.process_count]

  def to_pieces(item):
    index, raw = item
    ids, weights = to_ids(index, raw)
    _check_ids(ids, index, opts.vocab_size, what)
    return _shift_and_cut(index, ids, weights, opts, what)

  ds = ds.map(to_pieces)
  # num_threads=0: elements are produced in the calling thread (data already
  # sits in memory and tokenizing is Python, so threads would only fight over
  # the GIL); errors then surface with their own message.
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  it = grain.experimental.FlatMapIterDataset(it, _Flatten())
  T = opts.seq_len
  if opts.mode == "pad":
    it = it.map(lambda piece: _pad_row(piece, T, opts.pad_id))
  else:
    it = grain.experimental.FirstFitPackIterDataset(
        it, length_struct={"tokens": T, "targets": T, "loss_mask": T},
        num_packing_bins=opts.num_packing_bins or opts.batch_size,
        shuffle_bins=False,
        padding_struct={"tokens": opts.pad_id, "targets": opts.pad_id, "loss_mask": 0})
    it = it.map(_rekey_packed)
  return it.batch(opts.batch_size, drop_remainder=opts.drop_remainder)


def lm_dataset(texts: Sequence[str], encode: Callable[[str], Sequence[int]], data: DataConfig,
               *, bos_id: int | None = None, eos_id: int | None = None) -> grain.IterDataset:
  """LM pre-training batches from raw texts.

  Each text becomes ``[bos] + encode(text) + [eos]`` (bos/eos only when given)
  and every next-token target is trained on (``loss_mask`` 1 at real tokens).

  Args:
    texts: the documents; held in memory.
    encode: any ``str -> list[int]`` tokenizer.
    data: the batches' shape, order and shard (``DataConfig``; ``mode``
      defaults to ``"pack"``, ``too_long`` to ``"split"``).
    bos_id, eos_id: ids prepended / appended to every document.

  Returns:
    A ``grain.IterDataset`` of dicts with the keys in ``BATCH_KEYS``, each
    ``[B, T]``.
  """
  if isinstance(texts, (str, bytes)):
    raise ValueError("texts must be a sequence of strings, got a single string")
  if not callable(encode):
    raise ValueError(f"encode must be callable, got {encode!r}")
  if not isinstance(data, DataConfig):
    raise ValueError(f"data must be a DataConfig, got {type(data).__name__}")
  opts = data._resolved(mode="pack", too_long="split")
  prefix = [] if bos_id is None else [int(bos_id)]
  suffix = [] if eos_id is None else [int(eos_id)]

  def to_ids(index, text):
    if not isinstance(text, str):
      raise ValueError(f"text {index} is {type(text).__name__}, not str")
    ids = np.asarray(prefix + list(encode(text)) + suffix, np.int64)
    return ids, np.ones(ids.shape, np.float32)

  return _build(texts, to_ids, opts, "text")


def sft_dataset(examples: Sequence[Any], data: DataConfig) -> grain.IterDataset:
  """SFT batches from token ids with a per-token loss mask.

  Args:
    examples: each a pair ``(ids [n], loss_mask [n])`` or a mapping with keys
      ``"tokens"`` and ``"loss_mask"``. ``loss_mask[i]`` is 1 when token ``i``
      should be *predicted* (typically the response tokens). After the shift,
      the batch's ``loss_mask[t]`` refers to ``targets[t] = ids[t + 1]``, so
      the first token of an example is never a target.
    data: the batches' shape, order and shard (``DataConfig``). ``too_long``
      defaults to ``"error"``: silently cutting an SFT example drops response
      tokens; choose ``"split"`` or ``"truncate"`` knowingly. ``mode``
      defaults to ``"pad"``; ``"pack"`` is exact too when the model gets
      ``segment_ids``.

  Returns:
    A ``grain.IterDataset`` of dicts with the keys in ``BATCH_KEYS``, each
    ``[B, T]``.
  """
  if not isinstance(data, DataConfig):
    raise ValueError(f"data must be a DataConfig, got {type(data).__name__}")
  opts = data._resolved(mode="pad", too_long="error")

  def to_ids(index, example):
    if isinstance(example, Mapping):
      if "tokens" not in example or "loss_mask" not in example:
        raise ValueError(
            f"example {index} needs keys 'tokens' and 'loss_mask', has {sorted(example)}")
      ids, weights = example["tokens"], example["loss_mask"]
    elif isinstance(example, (tuple, list)) and len(example) == 2:
      ids, weights = example
    else:
      raise ValueError(
          f"example {index} must be (ids, loss_mask) or a mapping, got {type(example).__name__}")
    ids = np.asarray(ids)
    weights = np.asarray(weights, np.float32)
    if ids.ndim != 1 or weights.shape != ids.shape:
      raise ValueError(
          f"example {index}: ids and loss_mask must be 1-D of equal length, got "
          f"{ids.shape=} {weights.shape=}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"example {index}: ids must be integers, got dtype {ids.dtype}")
    return ids.astype(np.int64), weights

  return _build(examples, to_ids, opts, "example")
