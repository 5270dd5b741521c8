"""opd.text.bytelevel: each token's bytes against the ``tokenizers`` library's own
ByteLevel decoder and against encoding (the bytes of a text's tokens are the text)."""
import json

import pytest

from opd.text.bpe import BPETokenizer, train_bpe_json
from opd.text.bytelevel import byte_decoder, vocabulary_bytes
from opd.text.tokenizers import ByteTokenizer

TEXTS = ["Scores: \\boxed{3, 10}", "naïve café — ünïcode ✓", "def f(x):\n    return x + 1",
         "tabs\tand  spaces", "日本語のテキスト"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  path = tmp_path_factory.mktemp("bytelevel") / "tokenizer.json"
  path.write_text(train_bpe_json(TEXTS * 30, 360))
  return BPETokenizer(path)


def test_decoder_is_a_bijection_onto_the_bytes():
  decoder = byte_decoder()
  assert len(decoder) == 256 and sorted(decoder.values()) == list(range(256))
  assert decoder["!"] == ord("!") and decoder["Ġ"] == ord(" ") and decoder["Ċ"] == ord("\n")


def test_each_token_decodes_as_the_library_decodes_it(bpe):
  """Every token whose bytes are UTF-8: the library's ``decode([id])`` gives the same
  text. Tokens of a partial character decode to U+FFFD there, so they are checked
  joined with their neighbours below."""
  pieces = vocabulary_bytes(bpe)
  assert set(pieces) == set(range(bpe.vocab_size)) - set(bpe.special_ids)
  checked = 0
  for i, piece in pieces.items():
    try:
      text = piece.decode("utf-8")
    except UnicodeDecodeError:
      continue
    assert bpe.decode([i]) == text, (i, piece)
    checked += 1
  # The 128 ASCII bytes and the merges that are whole characters.
  assert checked > 128 and sum(len(p) > 1 for p in pieces.values()) > 20


@pytest.mark.parametrize("text", TEXTS + ["unseen: ÆØÅ 🙂 zzz"])
def test_a_texts_tokens_write_its_bytes(bpe, text):
  pieces = vocabulary_bytes(bpe)
  assert b"".join(pieces[i] for i in bpe.encode(text)) == text.encode("utf-8")


def test_byte_tokenizer_and_added_tokens(bpe, tmp_path):
  assert vocabulary_bytes(ByteTokenizer()) == {i: bytes([i]) for i in range(256)}
  # A non-special added token writes its content as is (not through the alphabet).
  spec = json.loads(bpe._tok.to_str())
  spec["added_tokens"].append({"id": bpe.vocab_size, "content": "<tool> x", "single_word": False,
                               "lstrip": False, "rstrip": False, "normalized": False,
                               "special": False})
  path = tmp_path / "tokenizer.json"
  path.write_text(json.dumps(spec))
  tok = BPETokenizer(path)
  assert vocabulary_bytes(tok)[bpe.vocab_size] == b"<tool> x"
  assert tok.decode([bpe.vocab_size]) == "<tool> x"


def test_other_tokenizers_are_refused():
  with pytest.raises(ValueError, match="neither the byte tokenizer nor a byte-level BPE"):
    vocabulary_bytes(object())
