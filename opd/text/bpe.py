"""A byte-level BPE tokenizer trained on the task corpus (docs/DESIGN.md §9,
"Tokenizers and domain-balanced batches").

``BPEConfig`` says what is trained: V entries (the 14 chat special tokens of
``opd.text.tokenizers.SPECIAL_TOKENS`` at ids 0..13 with the byte tokenizer's
strings, the 256 byte symbols, then merges) learnt from ``corpus_size``
conversations drawn with ``seed``. ``build_bpe(directory, cfg, corpus)``
trains once and writes ``tokenizer.json`` with ``bpe.json`` beside it (the
config, its sha256 digest, the file's sha256, the build's seconds and the
vocabulary size built); a later call with the same
config reuses the file, one with another config is refused naming the fields
that differ. Training is deterministic: the same config and corpus give a
byte-identical ``tokenizer.json``. A corpus can run out of pairs seen
``min_frequency`` times before V is reached (merges never cross GPT-2's
pre-token boundaries): the tokenizer then has fewer entries than V, which its
``vocab_size`` and ``bpe.json``'s ``vocab_size_built`` report (a model's
``vocab_size`` may exceed the tokenizer's, ``check_vocab``).

Special-token strings are cut out of the corpus before training, so no merge
spans one, and they always encode to their single id. Byte-level
pre-tokenisation (GPT-2's split, no prefix space) makes every string
round-trip: ``decode(encode(s)) == s``.

``resolve_tokenizer(spec, directory, corpus)`` turns a config's
``tokenizer`` field (``"byte"`` or ``"bpe:<V>"``) into a tokenizer; the task
corpus itself lives above this package (``opd.tasks.tokenizer``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import time
from typing import Callable, Sequence

from opd.config import fields
from opd.config.overrides import config_mismatches
from opd.text.tokenizers import BOS, EOS, PAD, SPECIAL_TOKENS, ByteTokenizer, HFTokenizer

__all__ = ["BPEConfig", "BPETokenizer", "MIN_VOCAB", "build_bpe", "parse_tokenizer_spec",
           "resolve_tokenizer", "train_bpe_json"]

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "bpe.json"
# The special tokens plus the 256 byte symbols, and at least one merge.
MIN_VOCAB = len(SPECIAL_TOKENS) + 256 + 1
_SPECIAL_SPLIT = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len,
                                                                   reverse=True)))


@dataclasses.dataclass(frozen=True)
class BPEConfig:
  """What a task BPE tokenizer is trained on; hashable and JSON-ready.

  Attributes:
    vocab_size: V, every entry included (>= ``MIN_VOCAB``).
    corpus_size: conversations of the corpus (prompt plus reference answer
      turns, the five domains interleaved; ``opd.tasks.tokenizer.bpe_corpus``).
    seed: the corpus's draw.
    difficulties: levels the corpus spreads over.
    min_frequency: a pair seen fewer times is never merged.
  """
  vocab_size: int
  corpus_size: int = 20_000
  seed: int = 0
  difficulties: tuple[int, ...] = (1, 2, 3)
  min_frequency: int = 2

  def __post_init__(self):
    fields.check_fields(self, "BPEConfig", ints={"vocab_size": MIN_VOCAB, "corpus_size": 1,
                                                 "seed": 0, "min_frequency": 1})
    diffs = self.difficulties
    if (isinstance(diffs, (str, bytes)) or not isinstance(diffs, Sequence) or not diffs
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in diffs)):
      raise ValueError(f"BPEConfig.difficulties must be a non-empty sequence of ints, "
                       f"got {diffs!r}")
    fields.set_field(self, "difficulties", tuple(diffs))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def digest(self) -> str:
    """sha256 of the config's canonical JSON."""
    return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def parse_tokenizer_spec(spec: str, field: str = "tokenizer") -> BPEConfig | None:
  """``"byte"`` -> None, ``"bpe:<V>"`` -> ``BPEConfig(vocab_size=V)``.

  Raises:
    ValueError: naming ``field`` and the value, for anything else.
  """
  if spec == "byte":
    return None
  m = re.fullmatch(r"bpe:(\d+)", spec) if isinstance(spec, str) else None
  if m is None:
    raise ValueError(f"{field}={spec!r}: expected 'byte' or 'bpe:<vocab_size>' "
                     f"(e.g. 'bpe:1024')")
  size = int(m.group(1))
  if size < MIN_VOCAB:
    raise ValueError(f"{field}={spec!r}: vocab_size {size} must be >= {MIN_VOCAB} "
                     f"({len(SPECIAL_TOKENS)} special tokens + 256 bytes + 1 merge)")
  return BPEConfig(vocab_size=size)


def _pieces(texts: Sequence[str]):
  """The corpus with the special-token strings cut out (no merge may span one)."""
  for text in texts:
    if not isinstance(text, str):
      raise ValueError(f"corpus entries must be str, got {type(text).__name__}")
    for piece in _SPECIAL_SPLIT.split(text):
      if piece:
        yield piece


def train_bpe_json(texts: Sequence[str], vocab_size: int, min_frequency: int = 2) -> str:
  """A byte-level BPE ``tokenizer.json`` (as a string) trained on ``texts``.

  Ids 0..13 are ``SPECIAL_TOKENS`` (added, special), then the 256 byte
  symbols, then merges in the order learnt, up to ``vocab_size`` entries.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_pieces(texts), trainer=trainer)
  return tok.to_str()


class BPETokenizer(HFTokenizer):
  """A task BPE ``tokenizer.json`` behind the ``ByteTokenizer`` interface.

  BOS/EOS/PAD are the byte tokenizer's strings, and every one of
  ``SPECIAL_TOKENS`` is checked to be a single special id.

  Args:
    path: the ``tokenizer.json`` (or its directory).
    config: the ``BPEConfig`` it was built from (kept for reference; None if unknown).
  """

  def __init__(self, path: str | os.PathLike, config: BPEConfig | None = None):
    super().__init__(str(path), bos_token=BOS, eos_token=EOS, pad_token=PAD)
    self.config = config
    # The ModelConfig.tokenizer spec ("bpe:<V>") when built from that spec's config.
    self.spec = (f"bpe:{config.vocab_size}"
                 if config is not None and config == BPEConfig(vocab_size=config.vocab_size)
                 else None)
    self.special_tokens = SPECIAL_TOKENS
    for token in SPECIAL_TOKENS:
      i = self.token_to_id(token)  # raises if absent
      if i not in self.special_ids:
        raise ValueError(f"{path}: {token!r} (id {i}) is not a special token of the file")


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _read_meta(path: pathlib.Path) -> dict:
  try:
    meta = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {path}: {e} (delete the directory to rebuild)") from e
  if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
    raise ValueError(f"{path} holds no 'config' object (delete the directory to rebuild)")
  return meta


def build_bpe(directory: str | os.PathLike, cfg: BPEConfig,
              corpus: Callable[[BPEConfig], Sequence[str]]) -> BPETokenizer:
  """The tokenizer of ``cfg`` in ``directory``: reused if built there, else trained.

  Args:
    directory: holds ``tokenizer.json`` and ``bpe.json`` (created if missing).
    cfg: what to train.
    corpus: ``corpus(cfg)`` -> the training texts (called only to build).

  Returns:
    The ``BPETokenizer``; ``bpe.json`` records ``build_s``, the build's
    seconds, and ``vocab_size_built``.

  Raises:
    ValueError: the directory holds a tokenizer of another config (the
      fields that differ named), a ``tokenizer.json`` whose sha256 is not the
      recorded one, or only one of the two files.
  """
  if not isinstance(cfg, BPEConfig):
    raise ValueError(f"cfg must be a BPEConfig, got {type(cfg).__name__}")
  root = pathlib.Path(directory)
  tok_path, meta_path = root / TOKENIZER_FILE, root / META_FILE
  if meta_path.exists() or tok_path.exists():
    if not (meta_path.exists() and tok_path.exists()):
      raise ValueError(f"{root} holds only {(meta_path if meta_path.exists() else tok_path).name} "
                       f"of {TOKENIZER_FILE} and {META_FILE} (an interrupted build?); delete it "
                       "to rebuild")
    meta = _read_meta(meta_path)
    diff = config_mismatches(meta["config"], cfg.to_dict())
    if diff:
      detail = "; ".join(f"{k}: built {have!r}, asked {want!r}" for k, have, want in diff)
      raise ValueError(f"{root} holds a BPE tokenizer of another config ({detail}); use "
                       "another directory or the same config")
    have = hashlib.sha256(tok_path.read_bytes()).hexdigest()
    if have != meta.get("tokenizer_sha256"):
      raise ValueError(f"{tok_path} has sha256 {have}, {META_FILE} recorded "
                       f"{meta.get('tokenizer_sha256')!r}: the file changed after the build")
    return BPETokenizer(tok_path, cfg)
  t0 = time.perf_counter()
  data = train_bpe_json(corpus(cfg), cfg.vocab_size, cfg.min_frequency).encode("utf-8")
  root.mkdir(parents=True, exist_ok=True)
  _write_atomic(tok_path, data)
  tok = BPETokenizer(tok_path, cfg)
  meta = {"config": cfg.to_dict(), "config_sha256": cfg.digest(),
          "tokenizer_sha256": hashlib.sha256(data).hexdigest(),
          "build_s": round(time.perf_counter() - t0, 3), "vocab_size_built": tok.vocab_size}
  # Written last: its presence marks a finished build.
  _write_atomic(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode("utf-8"))
  return tok


def resolve_tokenizer(spec: str, directory: str | os.PathLike | None,
                      corpus: Callable[[BPEConfig], Sequence[str]] | None = None, *,
                      field: str = "tokenizer") -> ByteTokenizer | BPETokenizer:
  """The tokenizer a config's ``tokenizer`` field names.

  Args:
    spec: ``"byte"`` (``ByteTokenizer``) or ``"bpe:<V>"`` (``build_bpe`` of
      ``BPEConfig(vocab_size=V)`` in ``directory``).
    directory: where the BPE tokenizer is stored (unused for ``"byte"``).
    corpus: the BPE corpus function (``build_bpe``).
    field: the config field's name in errors.

  Raises:
    ValueError: a bad spec, or a BPE spec without ``directory``/``corpus``.
  """
  cfg = parse_tokenizer_spec(spec, field)
  if cfg is None:
    return ByteTokenizer()
  if directory is None or corpus is None:
    raise ValueError(f"{field}={spec!r} needs a directory and a corpus to build the tokenizer in")
  return build_bpe(directory, cfg, corpus)
