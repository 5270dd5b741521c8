"""Tests for opd/rollout/constraint.py and constrained decoding in opd/rollout/sampler.py.

Python's ``re`` is the independent oracle of what a pattern matches. One
tiny model, one prompt batch [8, 4] and one table shape [64, 270] serve
every sampling test, so the sampler compiles once (plus once for the
unconstrained call). The same properties again with a small byte-level BPE
trained in the test (tokens of several bytes; a model V past the
tokenizer's), and hand cases of a token across a pattern's boundary.
"""
import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from opd.models import ModelConfig, forward, init_params, param_logical_axes
from opd.parallel import sharding as shd
from opd.rollout.constraint import DEAD, Constraint, compile_patterns
from opd.rollout.sampler import SamplingConfig, compiled_programs, generate
from opd.text.bpe import BPETokenizer, train_bpe_json
from opd.text.bytelevel import vocabulary_bytes
from opd.text.tokenizers import END, ByteTokenizer

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                  d_ff=64)
B, P, N = 8, 4, 32
END_IDS = (TOK.eos_id, TOK.token_to_id(END))
S = "([1-9]|10)"
# A small family of bounded patterns (every match is < N bytes, so a row must end).
FAMILY = (r"Better: (A|B)", r"Score: (0|0\.5|1)", r"(xy|x){1,3}", r"[ab]{1,5}c?",
          *(r"Scores: \\boxed\{" + S + r"(, " + S + r"){%d}\}" % (n - 1) for n in (1, 2, 3)))


def _params(seed: int, scale: float):
  params = init_params(CFG, jax.random.key(seed))
  # A random init is nearly uniform over V; scaling the head gives peaked,
  # seed-dependent logits ("random logits").
  params["lm_head"] = params["lm_head"] * scale
  return params


PROMPTS = np.random.RandomState(0).randint(0, 256, (B, P)).astype(np.int32)
PROMPT_MASK = np.ones((B, P), bool)


def _texts(out) -> list[tuple[bytes | None, bool]]:
  """(text bytes without the end token, or None when it holds a special token; finished)."""
  toks, mask, fin = map(np.asarray, (out.tokens, out.mask, out.finished))
  rows = []
  for t, m, f in zip(toks, mask, fin):
    ids = t[m][:-1] if f else t[m]
    rows.append((bytes(ids.tolist()) if (ids < 256).all() else None, bool(f)))
  return rows


@pytest.mark.parametrize("pattern", [r"(a|ab)", r"0(\.5)?", r"[ab]{1,3}", r"(0|0\.5|1)",
                                     r"([^\n]*\n)*S: (0|1)", r"(ab)*b?"])
def test_table_accepts_exactly_what_re_fullmatch_accepts(pattern):
  """Every string over a small alphabet up to length 5: the table reaches an
  accepting state iff ``re.fullmatch`` matches (``(a|ab)`` and ``0(\\.5)?`` are
  the shapes outlines-core's final states got wrong without the sentinel)."""
  auto = compile_patterns([pattern], TOK, end_ids=END_IDS)
  alphabet = sorted(set(b"ab0.5\nS: 1"))
  for length in range(6):
    for chars in itertools.product(alphabet, repeat=length):
      text = bytes(chars)
      state = auto.walk(text)
      accepted = state != DEAD and bool(auto.final[state])
      assert accepted == bool(re.fullmatch(pattern.encode(), text)), (pattern, text)
      if accepted:  # the end ids are allowed exactly in accepting states
        assert (auto.table[state, list(END_IDS)] == state).all()
      elif state != DEAD:
        assert (auto.table[state, list(END_IDS)] == DEAD).all()


def test_patterns_sit_side_by_side_in_one_padded_table():
  auto = compile_patterns(FAMILY[:2], TOK, end_ids=END_IDS, state_bucket=64)
  assert auto.table.shape == (64, TOK.vocab_size) and auto.table.dtype == np.int32
  assert auto.starts[0] == 0 < auto.starts[1]
  assert auto.final[auto.walk(b"Better: B", 0)] and auto.walk(b"Better: B", 1) == DEAD
  assert auto.final[auto.walk(b"Score: 0.5", 1)]
  # Special tokens other than the end ids and NUL never appear.
  assert (auto.table[:, 256:][:, [i - 256 for i in range(256, TOK.vocab_size)
                                  if i not in END_IDS]] == DEAD).all()
  assert (auto.table[:, 0] == DEAD).all()
  np.testing.assert_array_equal(auto.rows([1, 0, 1]).start, [auto.starts[1], 0, auto.starts[1]])


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="patterns"):
    compile_patterns([], TOK, end_ids=END_IDS)
  with pytest.raises(ValueError, match=r"patterns\[0\]"):
    compile_patterns(["(a"], TOK, end_ids=END_IDS)
  with pytest.raises(ValueError, match="end_ids"):
    compile_patterns(["a"], TOK, end_ids=())
  with pytest.raises(ValueError, match="byte tokenizer"):
    compile_patterns(["a"], object(), end_ids=(1,), vocab_size=10)
  auto = compile_patterns(["a"], TOK, end_ids=END_IDS)
  with pytest.raises(ValueError, match="pattern_ids"):
    auto.rows([1])
  sampling = SamplingConfig(max_new_tokens=4, eos_ids=END_IDS)
  params = _params(0, 1.0)
  with pytest.raises(ValueError, match=r"constraint.table shape"):
    generate(CFG, params, PROMPTS, PROMPT_MASK, 0, sampling,
             constraint=Constraint(auto.table[:, :10], np.zeros(B, np.int32)))
  with pytest.raises(ValueError, match=r"constraint.start values"):
    generate(CFG, params, PROMPTS, PROMPT_MASK, 0, sampling,
             constraint=Constraint(auto.table, np.full(B, 64, np.int32)))


@pytest.fixture(scope="module")
def automata():
  """Two different pattern sets compiled to the same [64, V] table shape."""
  first = compile_patterns(FAMILY, TOK, end_ids=END_IDS, state_bucket=64)
  second = compile_patterns(FAMILY[::-1], TOK, end_ids=END_IDS, state_bucket=64)
  assert first.table.shape == second.table.shape and len(first.starts) == len(FAMILY)
  return first, second


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 30.0, 300.0]),
       temperature=st.sampled_from([0.0, 0.7, 1.5]), which=st.integers(0, 1),
       rows=st.lists(st.integers(0, len(FAMILY) - 1), min_size=B, max_size=B))
def test_constrained_samples_always_match_their_pattern(automata, seed, scale, temperature,
                                                       which, rows):
  auto = automata[which]
  sampling = SamplingConfig(max_new_tokens=N, temperature=temperature, eos_ids=END_IDS)
  generate(CFG, _params(0, 1.0), PROMPTS, PROMPT_MASK, 0, sampling,
           constraint=auto.rows(rows))  # compiled once, then every example reuses it
  before = compiled_programs()
  out = generate(CFG, _params(seed, scale), PROMPTS, PROMPT_MASK, seed, sampling,
                 constraint=auto.rows(rows))
  assert compiled_programs() == before  # no recompile: new table, new starts, new logits
  for b, (text, finished) in enumerate(_texts(out)):
    assert finished and text is not None, (rows[b], text)  # bounded: the row had to end
    assert re.fullmatch(auto.patterns[rows[b]].encode(), text), (auto.patterns[rows[b]], text)


def test_unconstrained_samples_do_not_match():
  """The property above is not vacuous: the same model unconstrained writes other text."""
  sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_ids=END_IDS)
  out = generate(CFG, _params(1, 30.0), PROMPTS, PROMPT_MASK, 1, sampling)
  assert not any(t is not None and re.fullmatch(FAMILY[0].encode(), t) for t, _ in _texts(out))


_forward = jax.jit(lambda params, tokens, mask: forward(CFG, params, tokens, mask=mask))


def test_logprobs_are_the_masked_distributions(automata):
  """GRPO's old log-probs of a constrained sample: ``log_softmax(masked logits / T)``,
  the mask walked in numpy over the sampled tokens, logits from one full forward."""
  auto = automata[0]
  T = 0.7
  rows = [0, 1, 2, 3, 4, 5, 6, 0]
  params = _params(3, 30.0)
  sampling = SamplingConfig(max_new_tokens=N, temperature=T, eos_ids=END_IDS)
  out = generate(CFG, params, PROMPTS, PROMPT_MASK, 5, sampling, constraint=auto.rows(rows))
  toks, mask = np.asarray(out.tokens), np.asarray(out.mask)
  full = _forward(params, jnp.asarray(np.concatenate([PROMPTS, toks], 1)),
                  jnp.asarray(np.concatenate([PROMPT_MASK, mask], 1)))
  logits = np.asarray(full.logits, np.float64)[:, P - 1:P - 1 + N] / T  # [B, N, V]
  allowed = np.zeros(logits.shape, bool)
  for b in range(B):
    state = auto.starts[rows[b]]
    for t in range(int(mask[b].sum())):
      allowed[b, t] = auto.table[state] != DEAD
      state = auto.table[state, toks[b, t]]
  masked = np.where(allowed, logits, -np.inf)
  lse = lambda x: x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
  pick = np.take_along_axis(logits, toks[..., None], -1)[..., 0]
  expected = np.where(mask, pick - lse(np.where(mask[..., None], masked, 0.0)), 0.0)
  unmasked = np.where(mask, pick - lse(logits), 0.0)
  # Cached decoding vs one forward, float32: ~1e-6 relative per logit over a
  # 1-layer D=32 model (DEVELOPING.md "Reductions"), times |logit| <= ~100 at
  # this head scale, plus the log-sum-exp; 1e-3 absolute is far above that
  # and far below the mask's effect checked next.
  atol = 1e-3
  np.testing.assert_allclose(np.asarray(out.logprobs), expected, atol=atol)
  assert np.abs(expected - unmasked).max() > 100 * atol


def test_constrained_sampling_on_a_mesh_matches_one_device(automata):
  """Batch-sharded rows, vocab-sharded head: the table is replicated and each row
  keeps its own state; greedy, so the same tokens as on one device."""
  mesh = shd.make_mesh((2, 2, 2))
  params = _params(4, 30.0)
  sharded = jax.device_put(params, shd.tree_shardings(param_logical_axes(CFG), params, mesh,
                                                      shd.DEFAULT_RULES))
  rows = [0, 1, 2, 3, 4, 5, 6, 1]
  sampling = SamplingConfig(max_new_tokens=N, temperature=0.0, eos_ids=END_IDS)
  single = generate(CFG, params, PROMPTS, PROMPT_MASK, 0, sampling,
                    constraint=automata[0].rows(rows))
  out = generate(CFG, sharded, PROMPTS, PROMPT_MASK, 0, sampling, mesh=mesh,
                 constraint=automata[0].rows(rows))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  for b, (text, finished) in enumerate(_texts(out)):
    assert finished and re.fullmatch(FAMILY[rows[b]].encode(), text)


# --- A byte-level BPE: tokens of several bytes ---------------------------------------------

# Text of the patterns, so the trained BPE merges inside and across their parts
# ("ab", "xy", "10", "Better", "ĠA", ...; GPT-2's pre-tokenizer never merges
# letters with digits or punctuation).
BPE_CORPUS = ["ab abab aab ba 10 110 1010 11 01", "Better: A", "Better: B", "Score: 0.5",
              "Score: 1", "xyxyx xy", "abababc", r"Scores: \boxed{3, 10, 7}"] * 40


@pytest.fixture(scope="module")
def bpe():
  """A small byte-level BPE trained here, and a model over a V 5 ids larger than its
  vocabulary (ids the tokenizer does not have must never be allowed)."""
  import tempfile  # noqa: PLC0415
  path = tempfile.mkdtemp(prefix="bpe_constraint") + "/tokenizer.json"
  with open(path, "w") as f:
    f.write(train_bpe_json(BPE_CORPUS, 340))
  tok = BPETokenizer(path)
  return tok, dataclasses.replace(CFG, vocab_size=tok.vocab_size + 5)


def _bpe_end_ids(tok):
  return (tok.eos_id, tok.token_to_id(END))


def _accepts(auto, ids, pattern=0) -> bool:
  state = auto.walk(ids, pattern)
  return state != DEAD and bool(auto.final[state])


def test_a_bpe_token_across_a_pattern_boundary(bpe):
  """Hand cases with the trained BPE's two-byte tokens "ab", "10" and "xy"."""
  tok, _ = bpe
  ab, a, b, ten, one, zero, xy, x, y, z = (
      tok.token_to_id(t) for t in ("ab", "a", "b", "10", "1", "0", "xy", "x", "y", "z"))
  auto = compile_patterns([r"a", r"a(b|c)", r"(a|x)b", r"1", r"(1|2)0?", r"x(yz)?"], tok,
                          end_ids=_bpe_end_ids(tok))
  start = auto.starts
  # "ab" would write past the end of `a`'s only match: not allowed; "a" alone matches.
  assert auto.table[start[0], ab] == DEAD and _accepts(auto, [a], 0)
  # One token covers a literal and the group after it, or a group and the literal after it.
  for p in (1, 2):
    assert auto.final[auto.table[start[p], ab]] and _accepts(auto, [a, b], p)
    assert not _accepts(auto, [a], p)
  # "10" past the end of `1`; into the optional tail of `(1|2)0?`.
  assert auto.table[start[3], ten] == DEAD and _accepts(auto, [one], 3)
  for ids in ([ten], [one, zero], [one]):
    assert _accepts(auto, ids, 4), ids
  assert auto.walk([ten, zero], 4) == DEAD
  # "xy" ends inside the optional group: not accepting until the "z" arrives.
  assert not auto.final[auto.table[start[5], xy]] and _accepts(auto, [xy, z], 5)
  assert _accepts(auto, [x], 5) and _accepts(auto, [x, y, z], 5)
  assert auto.walk([xy, y], 5) == DEAD


@pytest.mark.parametrize("pattern", [r"(a|ab)", r"1(0|1)?", r"[ab]{1,3}", r"(ab)*b?",
                                     r"a(b|10)1?", r"(0|10|1)b?"])
def test_bpe_table_accepts_exactly_what_re_fullmatch_accepts(bpe, pattern):
  """Every token sequence writing at most 5 bytes over the tokens of a small alphabet
  (single bytes and merges): accepting iff ``re.fullmatch`` matches the bytes
  written; the end ids allowed exactly in accepting states."""
  tok, model_cfg = bpe
  auto = compile_patterns([pattern], tok, end_ids=_bpe_end_ids(tok),
                          vocab_size=model_cfg.vocab_size)
  pieces = vocabulary_bytes(tok)
  alphabet = set(b"ab10")
  tokens = [(i, p) for i, p in pieces.items() if set(p) <= alphabet]
  assert sum(len(p) > 1 for _, p in tokens) >= 4, tokens  # the BPE merged inside the alphabet
  stack, checked = [((), b"")], 0
  while stack:
    ids, text = stack.pop()
    accepted = _accepts(auto, ids)
    assert accepted == bool(re.fullmatch(pattern.encode(), text)), (pattern, text, ids)
    state = auto.walk(ids)
    if state != DEAD:
      assert (auto.table[state, list(_bpe_end_ids(tok))] != DEAD).all() == accepted
    checked += 1
    stack.extend((ids + (i,), text + p) for i, p in tokens if len(text) + len(p) <= 5)
  assert checked > 1000
  # Special tokens other than the end ids, and ids past the tokenizer's vocabulary, never.
  others = [i for i in range(model_cfg.vocab_size)
            if i not in pieces and i not in _bpe_end_ids(tok)]
  assert (auto.table[:, others] == DEAD).all()


@pytest.fixture(scope="module")
def bpe_automata(bpe):
  tok, model_cfg = bpe
  first, second = (compile_patterns(f, tok, end_ids=_bpe_end_ids(tok),
                                    vocab_size=model_cfg.vocab_size, state_bucket=64)
                   for f in (FAMILY, FAMILY[::-1]))
  assert first.table.shape == second.table.shape and first.table.shape[1] == model_cfg.vocab_size
  return first, second


def _bpe_texts(tok, out) -> list[tuple[bytes | None, bool]]:
  """As ``_texts``, the ids spelled by the BPE's byte strings."""
  pieces = vocabulary_bytes(tok)
  toks, mask, fin = map(np.asarray, (out.tokens, out.mask, out.finished))
  rows = []
  for t, m, f in zip(toks, mask, fin):
    ids = t[m][:-1] if f else t[m]
    ok = all(int(i) in pieces for i in ids)
    rows.append((b"".join(pieces[int(i)] for i in ids) if ok else None, bool(f)))
  return rows


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 30.0, 300.0]),
       temperature=st.sampled_from([0.0, 0.7, 1.5]), which=st.integers(0, 1),
       rows=st.lists(st.integers(0, len(FAMILY) - 1), min_size=B, max_size=B))
def test_bpe_constrained_samples_always_match_their_pattern(bpe, bpe_automata, seed, scale,
                                                           temperature, which, rows):
  """The byte tokenizer's property with the BPE: every row a full match of its pattern
  (tokens of several bytes included), no recompile across pattern sets of one shape."""
  tok, model_cfg = bpe
  auto = bpe_automata[which]
  def params(s, head_scale):
    p = init_params(model_cfg, jax.random.key(s))
    return {**p, "lm_head": p["lm_head"] * head_scale}

  sampling = SamplingConfig(max_new_tokens=N, temperature=temperature,
                            eos_ids=_bpe_end_ids(tok))
  prompts = PROMPTS % tok.vocab_size
  generate(model_cfg, params(0, 1.0), prompts, PROMPT_MASK, 0, sampling,
           constraint=auto.rows(rows))
  before = compiled_programs()
  out = generate(model_cfg, params(seed, scale), prompts, PROMPT_MASK, seed, sampling,
                 constraint=auto.rows(rows))
  assert compiled_programs() == before
  for b, (text, finished) in enumerate(_bpe_texts(tok, out)):
    assert finished and text is not None, (rows[b], text)
    assert re.fullmatch(auto.patterns[rows[b]].encode(), text), (auto.patterns[rows[b]], text)


def test_bpe_constrained_samples_use_multi_byte_tokens(bpe, bpe_automata):
  """The property above is not about single bytes only: near-uniform logits (an
  unscaled random head) at T = 1.5 pick among the allowed tokens, most of which
  write several bytes at a pattern's start ("B", "Be", "Bett", "Better")."""
  tok, model_cfg = bpe
  pieces = vocabulary_bytes(tok)
  sampling = SamplingConfig(max_new_tokens=N, temperature=1.5, eos_ids=_bpe_end_ids(tok))
  rows = list(range(len(FAMILY))) + [0]
  out = generate(model_cfg, init_params(model_cfg, jax.random.key(7)), PROMPTS % tok.vocab_size,
                 PROMPT_MASK, 7, sampling, constraint=bpe_automata[0].rows(rows))
  toks, mask = np.asarray(out.tokens), np.asarray(out.mask)
  written = [int(t) for t in toks[mask] if int(t) in pieces]
  assert sum(len(pieces[t]) > 1 for t in written) >= 4, [pieces[t] for t in written]
  for b, (text, finished) in enumerate(_bpe_texts(tok, out)):
    assert finished and re.fullmatch(FAMILY[rows[b]].encode(), text), (FAMILY[rows[b]], text)
