"""Tests for opd/data.py: LM and SFT grain pipelines.

Expected values come from a plain-Python reference: the documents are
tokenized, given bos/eos, cut into pieces of at most T + 1 tokens and
shifted here, independently of the pipeline; batches are decoded back into
pieces via ``segment_ids``.
"""
import collections
import json

import numpy as np
import pytest

from opd.training import data

BOS, EOS, PAD = 257, 256, 258
T = 16


def encode(text):
  return list(text.encode())


def _texts(n, seed=0, max_len=40):
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghij klmnop"))
  # A numbered prefix makes every document distinct.
  return [f"{i}:" + "".join(rng.choice(letters, size=rng.integers(0, max_len)))
          for i in range(n)]


def _reference_pieces(texts, T):
  pieces = []
  for text in texts:
    ids = [BOS] + encode(text) + [EOS]
    pieces += [tuple(ids[s:s + T + 1]) for s in range(0, len(ids) - 1, T)]
  return pieces


def _decode(batches, pad_id=PAD):
  """Checks per-row invariants and returns each segment as (ids, loss weights)."""
  out = []
  for b in batches:
    assert set(b) == set(data.BATCH_KEYS)
    B, width = b["tokens"].shape
    assert width == T
    for key in data.BATCH_KEYS:
      assert b[key].shape == (B, T), key
    assert b["tokens"].dtype == np.int32 and b["loss_mask"].dtype == np.float32
    assert b["mask"].dtype == bool
    for row in range(B):
      seg = b["segment_ids"][row]
      np.testing.assert_array_equal(b["mask"][row], seg > 0)
      pad = seg == 0
      assert np.all(b["tokens"][row][pad] == pad_id) and np.all(b["loss_mask"][row][pad] == 0)
      assert np.all(b["positions"][row][pad] == 0)
      for k in range(1, seg.max() + 1):
        idx = np.flatnonzero(seg == k)
        assert len(idx) and np.all(np.diff(idx) == 1), "a segment is contiguous"
        tok, tgt = b["tokens"][row][idx], b["targets"][row][idx]
        np.testing.assert_array_equal(b["positions"][row][idx], np.arange(len(idx)))
        np.testing.assert_array_equal(tgt[:-1], tok[1:])  # shifted within the document
        out.append((tuple(int(t) for t in tok) + (int(tgt[-1]),),
                    tuple(float(x) for x in b["loss_mask"][row][idx])))
  return out


def _lm(texts, **kw):
  kw = {"seq_len": T, "batch_size": 4, "pad_id": PAD, "process_index": 0, "process_count": 1,
        **kw}
  return data.lm_dataset(texts, encode, data.DataConfig(**kw), bos_id=BOS, eos_id=EOS)


def _doc_order(batches):
  return [bytes(p[0][1:-1]).decode() for p in _decode(batches)]


@pytest.mark.parametrize("mode", data.MODES)
def test_lm_preserves_every_piece(mode):
  texts = _texts(30) + ["", "x", "y" * 50]  # empty, one char, and one to split
  batches = list(_lm(texts, mode=mode, drop_remainder=False))
  got = _decode(batches)
  expected = _reference_pieces(texts, T)
  assert collections.Counter(p for p, _ in got) == collections.Counter(expected)
  assert all(all(w == 1.0 for w in weights) for _, weights in got)
  assert all(b["tokens"].shape[0] == 4 for b in batches[:-1])
  rows = sum(b["tokens"].shape[0] for b in batches)
  if mode == "pad":
    assert rows == len(expected)
  else:
    assert rows < len(expected)  # some rows hold several documents
    real = sum(b["mask"].sum() for b in batches)
    assert real == sum(len(p) - 1 for p in expected)


def test_lm_drop_remainder_and_truncate():
  texts = _texts(10)
  n_pieces = len(_reference_pieces(texts, T))
  batches = list(_lm(texts, mode="pad", batch_size=3))
  assert len(batches) == n_pieces // 3 and all(b["tokens"].shape == (3, T) for b in batches)
  long = ["z" * 40]
  (batch,) = list(_lm(long, mode="pad", batch_size=1, too_long="truncate"))
  (piece, _), = _decode([batch])
  assert piece == tuple([BOS] + encode("z" * (T - 1)) + [ord("z")])[:T + 1]


@pytest.mark.parametrize("count", [2, 3])
def test_process_shards_are_disjoint_and_cover(count):
  texts = _texts(10, max_len=10)
  shards = [_doc_order(_lm(texts, mode="pad", drop_remainder=False, process_index=p,
                           process_count=count)) for p in range(count)]
  kept = 10 - 10 % count  # truncated to a multiple of process_count
  assert all(len(s) == kept // count for s in shards)
  assert sorted(sum(shards, [])) == sorted(texts[:kept])


def test_seed_determines_order_and_epochs_reshuffle():
  texts = _texts(12, max_len=10)
  run = lambda seed, **kw: _doc_order(_lm(texts, mode="pad", seed=seed, **kw))
  first = run(0)
  assert sorted(first) == sorted(texts)
  assert run(0) == first
  assert run(1) != first and sorted(run(1)) == sorted(texts)
  assert run(0, shuffle=False) == texts
  two = run(0, num_epochs=2)
  assert two[:12] == first and sorted(two[12:]) == sorted(texts) and two[12:] != first


def test_infinite_repeat():
  texts = _texts(8, max_len=10)
  it = iter(_lm(texts, mode="pad", num_epochs=None))
  docs = _doc_order([next(it) for _ in range(3 * 8 // 4)])
  assert collections.Counter(docs) == collections.Counter(texts * 3)


@pytest.mark.parametrize("mode", data.MODES)
def test_checkpoint_resumes_exactly(mode):
  texts = _texts(12)
  build = lambda: _lm(texts, mode=mode, batch_size=2, num_epochs=None, seed=3)
  it = iter(build())
  for _ in range(5):  # stop mid-epoch
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # must survive serialisation
  expected = [next(it) for _ in range(12)]  # runs past the epoch boundary
  resumed = iter(build())
  resumed.set_state(state)
  for want, got in zip(expected, [next(resumed) for _ in range(12)]):
    for key in data.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], want[key])
  # The restored stream is not simply the start of a fresh one.
  fresh = next(iter(build()))
  assert not np.array_equal(fresh["tokens"], expected[0]["tokens"])


def _sft_examples(n, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = rng.integers(0, 256, size=rng.integers(1, 8))
    response = rng.integers(0, 256, size=rng.integers(1, 9))  # <= T + 1 in all
    ids = np.concatenate([[BOS], prompt, response, [EOS]])
    mask = np.concatenate([np.zeros(1 + len(prompt)), np.ones(len(response) + 1)])
    out.append((ids, mask))
  return out


@pytest.mark.parametrize("mode", data.MODES)
def test_sft_loss_mask_is_shifted_with_targets(mode):
  examples = _sft_examples(20)
  # Half as pairs, half as mappings: both input forms are accepted.
  mixed = [e if i % 2 else {"tokens": e[0], "loss_mask": e[1]} for i, e in enumerate(examples)]
  ds = data.sft_dataset(mixed, data.DataConfig(seq_len=T, batch_size=4, mode=mode, pad_id=PAD,
                                               drop_remainder=False, process_index=0,
                                               process_count=1))
  got = collections.Counter(_decode(list(ds)))
  # Reference: target t is ids[t + 1], weighted by the mask of that token.
  expected = collections.Counter(
      (tuple(int(x) for x in ids), tuple(float(m) for m in mask[1:])) for ids, mask in examples)
  assert got == expected


def test_sft_too_long_policies():
  ids = np.arange(40) % 200
  mask = (np.arange(40) >= 10).astype(np.float32)
  make = lambda policy: data.sft_dataset(
      [(ids[:5], mask[:5]), (ids, mask)],
      data.DataConfig(seq_len=T, batch_size=1, mode="pad", too_long=policy, pad_id=PAD,
                      shuffle=False, process_index=0, process_count=1))
  with pytest.raises(ValueError, match=r"example 1 has 40 tokens, more than seq_len \+ 1 = 17"):
    list(make("error"))
  pieces = _decode(list(make("split")))
  assert pieces[1:] == [(tuple(ids[s:s + T + 1]), tuple(mask[s + 1:s + T + 1]))
                        for s in range(0, 39, T)]


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(mode="concat"), r"mode must be one of \('pad', 'pack'\), got 'concat'"),
    (dict(seq_len=0), r"seq_len must be a positive int, got 0"),
    (dict(process_index=2, process_count=2), r"process_index=2 must be in \[0, process_count=2\)"),
    (dict(num_epochs=0), r"num_epochs must be a positive int or None, got 0"),
    (dict(too_long="wrap"), r"too_long must be one of .*got 'wrap'"),
])
def test_bad_arguments(kwargs, pattern):
  base = dict(seq_len=T, batch_size=2, process_index=0, process_count=1)
  with pytest.raises(ValueError, match=pattern):
    data.lm_dataset(["a"], encode, data.DataConfig(**{**base, **kwargs}))


def test_bad_examples():
  base = dict(seq_len=T, batch_size=1, process_index=0, process_count=1, shuffle=False)
  with pytest.raises(ValueError, match=r"example 0: ids and loss_mask must be 1-D of equal "
                                       r"length, got ids.shape=\(3,\) weights.shape=\(2,\)"):
    list(data.sft_dataset([([1, 2, 3], [0, 1])], data.DataConfig(**base)))
  with pytest.raises(ValueError, match=r"example 0 needs keys 'tokens' and 'loss_mask'"):
    list(data.sft_dataset([{"ids": [1, 2]}], data.DataConfig(**base)))
  with pytest.raises(ValueError, match=r"text 0: token id 300 >= vocab_size=260"):
    list(data.lm_dataset(["a"], lambda s: [300], data.DataConfig(vocab_size=260, **base)))
  with pytest.raises(ValueError, match="texts must be a random-access sequence"):
    data.lm_dataset((t for t in ["a"]), encode, data.DataConfig(**base))
  with pytest.raises(ValueError, match="a single string"):
    data.lm_dataset("abc", encode, data.DataConfig(**base))
  with pytest.raises(ValueError, match=r"3 examples cannot be split over process_count=4"):
    data.sft_dataset([([1, 2], [1, 1])] * 3, data.DataConfig(**{**base, "process_count": 4}))
