"""The bytes behind a byte-level BPE's tokens (docs/DESIGN.md §6 and §3).

A byte-level BPE (GPT-2's scheme; ``opd.text.bpe`` trains one) writes each
byte as one printable character of a fixed 256-character alphabet, and its
vocabulary entries are strings over that alphabet: ``"Ġthe"`` is the bytes
``b" the"``. ``byte_decoder`` inverts the alphabet; ``vocabulary_bytes``
gives every id of a tokenizer the byte string it writes, the form
constrained decoding (``opd.rollout.constraint``) and cross-tokenizer
alignment (``opd.distill.crosstok``) both need.
"""
from __future__ import annotations

import functools

from opd.text.tokenizers import ByteTokenizer

__all__ = ["byte_decoder", "is_byte_level", "vocabulary_bytes"]


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
  """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE
  token string uses for each byte -> that byte."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = list(printable), 0
  for b in range(256):
    if b not in printable:
      printable.append(b)
      chars.append(256 + extra)
      extra += 1
  return {chr(c): b for b, c in zip(printable, chars)}


def is_byte_level(tokenizer) -> bool:
  """``tokenizer`` wraps a ``tokenizers`` file whose decoder is ``ByteLevel``."""
  inner = getattr(tokenizer, "_tok", None)
  return inner is not None and type(inner.decoder).__name__ == "ByteLevel"


def vocabulary_bytes(tokenizer) -> dict[int, bytes]:
  """``{id: the bytes it writes}`` for every id that is not a special token.

  The byte tokenizer: ids 0..255, one byte each. A byte-level BPE: each
  vocabulary entry through ``byte_decoder``; an added token that is not
  special (a file may have some) writes its content's UTF-8 as it is.

  Raises:
    ValueError: a tokenizer that is neither, or an entry with a character
      outside the byte-level alphabet (the id named).
  """
  if isinstance(tokenizer, ByteTokenizer):
    return {i: bytes([i]) for i in range(256)}
  if not is_byte_level(tokenizer):
    raise ValueError(f"tokenizer {type(tokenizer).__name__} is neither the byte tokenizer nor a "
                     "byte-level BPE: its tokens have no byte strings")
  decoder = byte_decoder()
  added = tokenizer._tok.get_added_tokens_decoder()  # {id: AddedToken}
  out = {}
  for i in range(tokenizer.vocab_size):
    if i in tokenizer.special_ids:
      continue
    if i in added:
      out[i] = added[i].content.encode("utf-8")
      continue
    piece = tokenizer.id_to_token(i)
    try:
      out[i] = bytes(decoder[c] for c in piece)
    except KeyError as e:
      raise ValueError(f"token id {i} ({piece!r}) has character {e.args[0]!r} outside the "
                       "byte-level alphabet") from None
  return out
