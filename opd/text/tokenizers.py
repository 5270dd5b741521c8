"""Tokenizers: a file-free byte tokenizer and a ``tokenizer.json`` wrapper.

Both share one interface (``encode``, ``decode``, ``encode_batch``,
``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``special_ids``,
``token_to_id``), so toy experiments and real checkpoints run the same code.

The byte tokenizer maps ids 0..255 to bytes and appends ``SPECIAL_TOKENS``
(the strings the chat template uses, see docs/DEVELOPING.md "Tokens and chat
format"), so its vocabulary has 256 + 14 = 270 entries.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterable, Sequence

import numpy as np

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, TOOL, END = "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE = "<tool_result>", "</tool_result>"
SPECIAL_TOKENS = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, TOOL, END, THINK_OPEN, THINK_CLOSE,
                  TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE)


def _pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, padding: str,
               max_length: int | None, truncation: bool) -> tuple[np.ndarray, np.ndarray]:
  if padding not in ("left", "right"):
    raise ValueError(f"padding={padding!r} must be 'left' or 'right'")
  longest = max((len(s) for s in seqs), default=0)
  T = longest if max_length is None else max_length
  if max_length is not None and max_length <= 0:
    raise ValueError(f"max_length={max_length} must be positive")
  ids = np.full((len(seqs), T), pad_id, np.int32)
  mask = np.zeros((len(seqs), T), bool)
  for i, s in enumerate(seqs):
    if len(s) > T:
      if not truncation:
        raise ValueError(f"sequence {i} has {len(s)} tokens > max_length={T}; "
                         "pass truncation=True to cut it")
      s = s[:T]
    n = len(s)
    sl = slice(T - n, T) if padding == "left" else slice(0, n)
    ids[i, sl] = s
    mask[i, sl] = True
  return ids, mask


class _TokenizerBase:
  """Batch helpers shared by both tokenizers; subclasses define ``encode``/``decode``."""

  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  pad_id: int

  def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
    if add_bos:
      if self.bos_id is None:
        raise ValueError(f"add_bos=True but {type(self).__name__} has no BOS token")
      ids = [self.bos_id] + ids
    if add_eos:
      if self.eos_id is None:
        raise ValueError(f"add_eos=True but {type(self).__name__} has no EOS token")
      ids = ids + [self.eos_id]
    return ids

  def encode_batch(self, texts: Iterable[str], *, add_bos: bool = False, add_eos: bool = False,
                   padding: str = "right", max_length: int | None = None,
                   truncation: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Encodes and pads a batch.

    Args:
      texts: B strings.
      add_bos, add_eos: as ``encode``.
      padding: "right" (training) or "left" (prompts for generation).
      max_length: T; defaults to the longest sequence. Longer sequences raise
        unless ``truncation`` (which keeps the first T tokens).

    Returns:
      ``(ids [B, T] int32, mask [B, T] bool)``; pads hold ``pad_id``.
    """
    if isinstance(texts, str):
      raise ValueError("encode_batch takes a list of strings, got one str")
    seqs = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
    return _pad_batch(seqs, self.pad_id, padding, max_length, truncation)

  def decode_batch(self, ids, mask=None, skip_special: bool = False) -> list[str]:
    """Decodes ``ids [B, T]``, keeping only positions where ``mask [B, T]`` is True."""
    ids = np.asarray(ids)
    if ids.ndim != 2:
      raise ValueError(f"decode_batch expects ids [B, T], got {ids.shape=}")
    if mask is not None:
      mask = np.asarray(mask, bool)
      if mask.shape != ids.shape:
        raise ValueError(f"{mask.shape=} does not match {ids.shape=}")
    rows = ids if mask is None else [row[m] for row, m in zip(ids, mask)]
    return [self.decode(row, skip_special=skip_special) for row in rows]

  def _check_ids(self, ids) -> list[int]:
    arr = np.asarray(ids)
    if arr.ndim != 1:
      raise ValueError(f"decode expects a 1-D sequence of ids, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
      bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
      raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
    return [int(i) for i in arr]


class ByteTokenizer(_TokenizerBase):
  """UTF-8 bytes (ids 0..255) followed by ``SPECIAL_TOKENS``; needs no files."""

  def __init__(self, special_tokens: Sequence[str] = SPECIAL_TOKENS):
    if len(set(special_tokens)) != len(special_tokens) or not all(special_tokens):
      raise ValueError(f"special_tokens must be distinct non-empty strings, got {special_tokens}")
    for required in (BOS, EOS, PAD):
      if required not in special_tokens:
        raise ValueError(f"special_tokens must include {required!r}")
    self.special_tokens = tuple(special_tokens)
    self._special_to_id = {t: 256 + i for i, t in enumerate(self.special_tokens)}
    # Longest first so that no special token is matched by a prefix of another.
    alternation = "|".join(re.escape(t) for t in sorted(self.special_tokens, key=len,
                                                        reverse=True))
    self._split = re.compile(f"({alternation})")
    self.vocab_size = 256 + len(self.special_tokens)
    self.bos_id, self.eos_id = self._special_to_id[BOS], self._special_to_id[EOS]
    self.pad_id = self._special_to_id[PAD]
    self.special_ids = frozenset(self._special_to_id.values())
    # The ModelConfig.tokenizer spec this tokenizer is (check_vocab); None if custom.
    self.spec = "byte" if self.special_tokens == tuple(SPECIAL_TOKENS) else None

  def token_to_id(self, token: str) -> int:
    """Id of a special-token string or of a one-byte string."""
    if token in self._special_to_id:
      return self._special_to_id[token]
    data = token.encode("utf-8", "surrogatepass")
    if len(data) == 1:
      return data[0]
    raise ValueError(f"{token!r} is neither a special token nor a single byte")

  def id_to_token(self, i: int) -> str:
    if 0 <= i < 256:
      return bytes([i]).decode("latin-1")
    if 256 <= i < self.vocab_size:
      return self.special_tokens[i - 256]
    raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, *,
             allow_special: bool = True) -> list[int]:
    """Special-token strings become their ids; everything else UTF-8 bytes.

    ``allow_special=False`` encodes special-token strings as plain bytes
    (for untrusted text that must not inject role markers).
    """
    if not isinstance(text, str):
      raise ValueError(f"encode expects a str, got {type(text).__name__}")
    parts = self._split.split(text) if allow_special else [text]
    ids: list[int] = []
    for k, part in enumerate(parts):
      if allow_special and k % 2 == 1:
        ids.append(self._special_to_id[part])
        continue
      try:
        ids.extend(part.encode("utf-8"))
      except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode (lone surrogate {part[e.start]!r} "
                         f"at offset {e.start} of a segment)") from None
    return self._wrap(ids, add_bos, add_eos)

  def decode(self, ids, skip_special: bool = False) -> str:
    """Bytes are joined and decoded with U+FFFD for invalid UTF-8: never raises on bytes.

    Raises:
      ValueError: an id outside ``[0, vocab_size)``.
    """
    out: list[str] = []
    buf = bytearray()
    for i in self._check_ids(ids):
      if i < 256:
        buf.append(i)
        continue
      out.append(buf.decode("utf-8", "replace"))
      buf.clear()
      if not skip_special:
        out.append(self.special_tokens[i - 256])
    out.append(buf.decode("utf-8", "replace"))
    return "".join(out)


def _special_tokens_from_config(file: str) -> dict[str, str]:
  """``{"bos"|"eos"|"pad": token}`` from a HF ``tokenizer_config.json`` (if any)."""
  if not os.path.isfile(file):
    return {}
  try:
    with open(file, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read tokenizer config {file!r}: {e}") from e
  if not isinstance(config, dict):
    raise ValueError(f"tokenizer config {file!r} must hold a JSON object, got a "
                     f"{type(config).__name__}")
  out = {}
  for kind in ("bos", "eos", "pad"):
    token = config.get(f"{kind}_token")
    if isinstance(token, dict):  # serialised AddedToken
      token = token.get("content")
    if isinstance(token, str):
      out[kind] = token
  return out


class HFTokenizer(_TokenizerBase):
  """A ``tokenizers`` ``tokenizer.json`` behind the ``ByteTokenizer`` interface.

  Args:
    path: a ``tokenizer.json`` file, or a directory holding one (and maybe
      a ``tokenizer_config.json`` naming ``bos_token`` / ``eos_token`` /
      ``pad_token``, used unless the arguments below are given).
    bos_token, eos_token, pad_token: token strings; ``None`` tries our
      special tokens and then common names (``<s>``, ``</s>``,
      ``<|endoftext|>``, ...). A missing BOS is allowed (``add_bos`` then
      raises); a missing PAD falls back to EOS.
  """

  _CANDIDATES = {
      "bos": (BOS, "<s>", "<|begin_of_text|>", "<bos>"),
      "eos": (EOS, "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"),
      "pad": (PAD, "<pad>", "<|pad|>", "<|endoftext|>"),
  }

  def __init__(self, path: str, *, bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None):
    from tokenizers import Tokenizer  # keeps the byte tokenizer import-light

    if os.path.isdir(path):
      # A HF model directory: its tokenizer_config.json names the special tokens.
      named = _special_tokens_from_config(os.path.join(path, "tokenizer_config.json"))
      bos_token = bos_token if bos_token is not None else named.get("bos")
      eos_token = eos_token if eos_token is not None else named.get("eos")
      pad_token = pad_token if pad_token is not None else named.get("pad")
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise ValueError(f"tokenizer file {path!r} does not exist")
    try:
      self._tok = Tokenizer.from_file(path)
    except Exception as e:  # `tokenizers` raises a bare Exception naming no file
      raise ValueError(f"cannot read tokenizer file {path!r}: {e} (truncated or not a "
                       "tokenizers tokenizer.json?)") from e
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.bos_id = self._find("bos", bos_token)
    self.eos_id = self._find("eos", eos_token)
    pad = self._find("pad", pad_token)
    if pad is None:
      if self.eos_id is None:
        raise ValueError(f"{path} has neither a pad nor an eos token; pass pad_token=")
      pad = self.eos_id
    self.pad_id = pad
    self.special_ids = frozenset(
        i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

  def _find(self, kind: str, token: str | None) -> int | None:
    if token is not None:
      i = self._tok.token_to_id(token)
      if i is None:
        raise ValueError(f"{kind}_token={token!r} is not in the tokenizer's vocabulary")
      return i
    for cand in self._CANDIDATES[kind]:
      i = self._tok.token_to_id(cand)
      if i is not None:
        return i
    return None

  def token_to_id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{token!r} is not a token of this tokenizer")
    return i

  def id_to_token(self, i: int) -> str:
    token = self._tok.id_to_token(int(i))
    if token is None:
      raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
    return token

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Added special tokens in ``text`` become their ids (the library's rule)."""
    if not isinstance(text, str):
      raise ValueError(f"encode expects a str, got {type(text).__name__}")
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return self._wrap(list(ids), add_bos, add_eos)

  def decode(self, ids, skip_special: bool = False) -> str:
    """Invalid UTF-8 from partial byte-level tokens becomes U+FFFD; never raises on it."""
    return self._tok.decode(self._check_ids(ids), skip_special_tokens=skip_special)


def check_vocab(tokenizer, model_cfg) -> None:
  """Raises unless every id of ``tokenizer`` is a row of the model's embedding.

  A model vocabulary larger than the tokenizer's (padded to a multiple of
  128, say) is fine. A tokenizer that names its spec (``"byte"``,
  ``"bpe:<V>"``) must be the one ``model_cfg.tokenizer`` names.
  """
  want, have = getattr(model_cfg, "tokenizer", None), getattr(tokenizer, "spec", None)
  if want and have and want != have:
    raise ValueError(f"the model's tokenizer={want!r} (ModelConfig.tokenizer) but the tokenizer "
                     f"given is {have!r}: its ids would mean other strings to this model")
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"tokenizer vocab_size={tokenizer.vocab_size} exceeds the model's "
                     f"vocab_size={model_cfg.vocab_size}")
