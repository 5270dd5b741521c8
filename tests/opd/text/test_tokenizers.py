"""Byte tokenizer, ``tokenizer.json`` wrapper, batch padding and vocab checks."""
import itertools
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from opd.models import ModelConfig
from opd.text.tokenizers import (SPECIAL_TOKENS, ByteTokenizer, HFTokenizer, check_vocab)

TOK = ByteTokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_arbitrary_unicode(text):
  ids = TOK.encode(text)
  assert TOK.decode(ids) == text
  # Without special tokens in the text the ids are exactly the UTF-8 bytes.
  if not any(t in text for t in SPECIAL_TOKENS):
    assert ids == list(text.encode("utf-8"))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPECIAL_TOKENS)), max_size=8))
def test_byte_round_trip_with_special_tokens(pieces):
  text = "".join(pieces)
  ids = TOK.encode(text, add_bos=True, add_eos=True)
  assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
  assert TOK.decode(ids) == "<|bos|>" + text + "<|eos|>"
  # Neighbouring pieces may spell a special token ("<|" + "end|>"), so the
  # reference removes every special-token occurrence from the joined text.
  specials = "|".join(re.escape(t) for t in SPECIAL_TOKENS)
  assert TOK.decode(ids, skip_special=True) == re.sub(specials, "", text)


def test_special_ids_and_lookup():
  assert TOK.vocab_size == 256 + len(SPECIAL_TOKENS)
  assert TOK.special_ids == frozenset(range(256, TOK.vocab_size))
  for k, t in enumerate(SPECIAL_TOKENS):
    assert TOK.token_to_id(t) == 256 + k
    assert TOK.encode(t) == [256 + k]
  assert TOK.token_to_id("<|pad|>") == TOK.pad_id
  assert TOK.token_to_id("a") == ord("a")
  assert len({TOK.bos_id, TOK.eos_id, TOK.pad_id}) == 3
  with pytest.raises(ValueError, match="neither a special token"):
    TOK.token_to_id("ab")
  # Specials inside text are split out; <think> is not confused with </think>.
  ids = TOK.encode("x</think>y<think>")
  assert ids == [ord("x"), TOK.token_to_id("</think>"), ord("y"), TOK.token_to_id("<think>")]
  # allow_special=False keeps the marker as plain bytes (no role injection).
  assert TOK.encode("<|end|>", allow_special=False) == list(b"<|end|>")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=40))
def test_byte_decode_never_raises_on_any_ids(ids):
  # Reference: runs of byte ids decode together (U+FFFD for invalid UTF-8);
  # a special id is its string.
  ref = []
  for is_byte, run in itertools.groupby(ids, key=lambda i: i < 256):
    run = list(run)
    ref.append(bytes(run).decode("utf-8", "replace") if is_byte
               else "".join(SPECIAL_TOKENS[i - 256] for i in run))
  assert TOK.decode(ids) == "".join(ref)


def test_byte_decode_invalid_utf8_and_bad_input():
  cut = list("é".encode())[:1] + [ord("a")]
  assert TOK.decode(cut) == "\ufffda"
  with pytest.raises(ValueError, match="token id 270 is outside"):
    TOK.decode([1, 270])
  with pytest.raises(ValueError, match="lone surrogate"):
    TOK.encode("a\ud800")
  with pytest.raises(ValueError, match="1-D"):
    TOK.decode([[1, 2]])


@pytest.mark.parametrize("padding", ["left", "right"])
def test_encode_batch_padding(padding):
  texts = ["hi", "", "héllo<|end|>"]
  ids, mask = TOK.encode_batch(texts, add_bos=True, padding=padding)
  refs = [TOK.encode(t, add_bos=True) for t in texts]
  T = max(map(len, refs))
  assert ids.shape == mask.shape == (3, T) and ids.dtype == np.int32
  for row, m, ref in zip(ids, mask, refs):
    assert m.sum() == len(ref)
    assert list(row[m]) == ref
    assert (row[~m] == TOK.pad_id).all()
    real = np.flatnonzero(m)
    # Real tokens are contiguous and flush with the padding side's opposite end.
    assert (real == (np.arange(T - len(ref), T) if padding == "left" else np.arange(len(ref)))).all()
  assert TOK.decode_batch(ids, mask) == ["<|bos|>" + t for t in texts]


def test_encode_batch_max_length_and_errors():
  ids, mask = TOK.encode_batch(["abc", "a"], max_length=5)
  assert ids.shape == (2, 5) and mask.sum() == 4
  with pytest.raises(ValueError, match="sequence 0 has 3 tokens > max_length=2"):
    TOK.encode_batch(["abc", "a"], max_length=2)
  ids, mask = TOK.encode_batch(["abc", "a"], max_length=2, truncation=True)
  assert ids.tolist() == [[97, 98], [97, TOK.pad_id]]
  with pytest.raises(ValueError, match="padding='middle'"):
    TOK.encode_batch(["a"], padding="middle")
  with pytest.raises(ValueError, match="list of strings"):
    TOK.encode_batch("abc")


def test_check_vocab():
  check_vocab(TOK, ModelConfig(vocab_size=512, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32))
  with pytest.raises(ValueError, match="vocab_size=270 exceeds the model's vocab_size=256"):
    check_vocab(TOK, ModelConfig(vocab_size=256, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32))


# ---------------------------------------------------------------------------
# tokenizer.json wrapper (a tiny BPE trained here; no downloads).

CORPUS = ["the quick brown fox jumps over the lazy dog " * 3, "héllo wörld, 你好 世界",
          "<|user|>what is 2+3?<|end|><|assistant|>5<|end|>"]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(CORPUS, trainer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tok.save(str(path))
  return HFTokenizer(str(path.parent)), tok


def test_hf_tokenizer_matches_library(hf_tok):
  wrapped, lib = hf_tok
  assert wrapped.vocab_size == lib.get_vocab_size()
  assert wrapped.bos_id == lib.token_to_id("<|bos|>")
  assert wrapped.eos_id == lib.token_to_id("<|eos|>")
  assert wrapped.pad_id == lib.token_to_id("<|pad|>")
  assert wrapped.special_ids == {lib.token_to_id(t) for t in SPECIAL_TOKENS}
  text = "<|user|>héllo the fox 你好<|end|>"
  ids = wrapped.encode(text, add_bos=True, add_eos=True)
  assert ids == [wrapped.bos_id] + lib.encode(text, add_special_tokens=False).ids + [
      wrapped.eos_id]
  assert ids[1] == wrapped.token_to_id("<|user|>")
  assert wrapped.decode(ids) == "<|bos|>" + text + "<|eos|>"
  assert wrapped.decode(ids, skip_special=True) == "héllo the fox 你好"
  ids, mask = wrapped.encode_batch(["the", "the lazy dog"], padding="left")
  assert (ids[~mask] == wrapped.pad_id).all() and mask[0, -1] and not mask[0, 0]
  assert wrapped.decode_batch(ids, mask) == ["the", "the lazy dog"]


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=30))
def test_hf_tokenizer_round_trip(hf_tok, text):
  wrapped, _ = hf_tok
  assert wrapped.decode(wrapped.encode(text)) == text


def test_hf_tokenizer_partial_bytes_and_errors(hf_tok, tmp_path):
  wrapped, lib = hf_tok
  # In the GPT-2 byte-to-unicode table byte 0xE4 (the first byte of 你) is
  # the symbol "ä"; on its own it is invalid UTF-8.
  assert "你".encode()[0] == 0xE4
  lead = lib.token_to_id("ä")
  assert wrapped.decode([lead, wrapped.token_to_id("a")]) == "\ufffda"
  with pytest.raises(ValueError, match="outside the vocabulary"):
    wrapped.decode([wrapped.vocab_size])
  with pytest.raises(ValueError, match="not a token"):
    wrapped.token_to_id("definitely-not-a-token")
  path = tmp_path / "tokenizer.json"
  lib.save(str(path))
  with pytest.raises(ValueError, match="eos_token='<nope>'"):
    HFTokenizer(str(path), eos_token="<nope>")
  with pytest.raises(ValueError, match="does not exist"):
    HFTokenizer(str(tmp_path / "missing.json"))
  # A model directory's tokenizer_config.json names the special tokens.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": {"content": "<|end|>", "special": True}, "pad_token": "<|eos|>",
       "bos_token": None}))
  from_dir = HFTokenizer(str(tmp_path))
  assert from_dir.eos_id == lib.token_to_id("<|end|>")
  assert from_dir.pad_id == lib.token_to_id("<|eos|>")
  assert from_dir.bos_id == lib.token_to_id("<|bos|>")  # null: falls back to the defaults
  assert HFTokenizer(str(tmp_path), eos_token="<|eos|>").eos_id == lib.token_to_id("<|eos|>")
  with pytest.raises(ValueError, match="vocab_size=.* exceeds the model's vocab_size=300"):
    check_vocab(wrapped, ModelConfig(vocab_size=300, d_model=16, n_heads=2, n_kv_heads=1,
                                     d_ff=32))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not_a_tokenizer"])
def test_damaged_tokenizer_json_names_the_file(hf_tok, tmp_path, damage):
  # Before: `tokenizers` raised a bare Exception ("expected `,` ... at line 1
  # column ...") that named no file.
  _, lib = hf_tok
  path = tmp_path / "tokenizer.json"
  lib.save(str(path))
  text = path.read_text()
  path.write_text({"truncated": text[:len(text) // 2], "garbage": "\x00\x01 not json",
                   "not_a_tokenizer": json.dumps({"version": "1.0"})}[damage])
  for where in (path, tmp_path):  # the file itself, or the model directory holding it
    with pytest.raises(ValueError, match=f"cannot read tokenizer file '{path}'"):
      HFTokenizer(str(where))


@pytest.mark.parametrize("content,needle", [
    ('{"eos_token": "<|end|>"', "cannot read tokenizer config"),
    ('["<|end|>"]', "must hold a JSON object, got a list")])
def test_damaged_tokenizer_config_names_the_file(hf_tok, tmp_path, content, needle):
  # Before: a bare JSONDecodeError without the path, or AttributeError on a list.
  _, lib = hf_tok
  lib.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(content)
  with pytest.raises(ValueError, match=needle) as e:
    HFTokenizer(str(tmp_path))
  assert f"'{tmp_path / 'tokenizer_config.json'}'" in str(e.value)
