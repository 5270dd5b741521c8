"""Tests for opd/rollout/prefill.py: grouping a prompt batch by its real
tokens and the bucket of distinct rows (the sampler's equality with and
without a shared prefill is tested in test_sampler.py)."""
import numpy as np
import pytest

from opd.rollout.prefill import distinct_rows, prefill_bucket


@pytest.mark.parametrize("distinct,multiple_of,expected", [
    # next power of two >= distinct, then up to a multiple of multiple_of
    (1, 1, 1), (2, 1, 2), (3, 1, 4), (5, 1, 8), (8, 1, 8), (9, 1, 16),
    (1, 4, 4), (3, 4, 4), (5, 4, 8), (3, 6, 6), (5, 6, 12),
])
def test_prefill_bucket(distinct, multiple_of, expected):
  assert prefill_bucket(distinct, multiple_of) == expected


def test_distinct_rows_groups_by_real_tokens():
  # Real tokens per row (x: pad slot holding a junk id that must be ignored):
  #   0: 5 6 7         left-padded            -> prompt a
  #   1: 5 6 7         right-padded           -> a
  #   2: 5 6 7         hole after the first   -> a
  #   3: 5 6           same ids as a's slots, shorter mask -> prompt b
  #   4: 9 9 9                                -> prompt c
  #   5: 5 6 7 x                              -> a
  #   6: 9 9 9         right-padded           -> c
  #   7: 5 6           left-padded            -> b
  tokens = np.array([[1, 5, 6, 7], [5, 6, 7, 2], [5, 3, 6, 7], [5, 6, 7, 0],
                     [9, 9, 9, 9], [5, 6, 7, 4], [9, 9, 9, 8], [8, 8, 5, 6]], np.int32)
  mask = np.array([[0, 1, 1, 1], [1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0],
                   [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 1, 1]], bool)
  # Reference: group rows by the tuple of their masked-in ids, numbered by
  # first appearance.
  seen = {}
  expected_source = [seen.setdefault(tuple(t[m]), len(seen)) for t, m in zip(tokens, mask)]
  assert expected_source == [0, 0, 0, 1, 2, 0, 2, 1]
  got = distinct_rows(tokens, mask)
  # Three prompts -> bucket U = 4: their first rows 0, 3, 4, then row 0 again.
  np.testing.assert_array_equal(got.rows, [0, 3, 4, 0])
  np.testing.assert_array_equal(got.source, expected_source)
  # Each row reads a row holding its own prompt.
  for b in range(8):
    r = got.rows[got.source[b]]
    np.testing.assert_array_equal(tokens[r][mask[r]], tokens[b][mask[b]])
  # Bucketed to a multiple of 8 devices, U = 8 > B / 2: no sharing.
  assert distinct_rows(tokens, mask, multiple_of=8) is None
  # All rows distinct: no sharing.
  assert distinct_rows(np.arange(8, dtype=np.int32)[:, None], np.ones((8, 1), bool)) is None


def test_distinct_rows_rejects_bad_shapes():
  with pytest.raises(ValueError, match="distinct_rows"):
    distinct_rows(np.zeros((2, 3), np.int32), np.ones((2, 4), bool))
  with pytest.raises(ValueError, match="distinct=0"):
    prefill_bucket(0)
