"""The task tokenizer a config names (docs/DESIGN.md §9, "Tokenizers and
domain-balanced batches").

``opd.text.bpe`` trains a BPE tokenizer on any corpus; the corpus of the
toy world is defined here, above the text package: ``bpe_corpus(cfg)`` is
``mixture_corpus(cfg.corpus_size, seed=cfg.seed, difficulties=cfg.difficulties)``,
train-split prompts plus reference answers (tool turns included) of the five
domains, interleaved round-robin, rendered in the chat format. No test prompt
is ever seen.
"""
from __future__ import annotations

import os

from opd.tasks import mixture_corpus
from opd.text.bpe import BPEConfig, BPETokenizer, resolve_tokenizer
from opd.text.tokenizers import ByteTokenizer

__all__ = ["bpe_corpus", "task_tokenizer"]


def bpe_corpus(cfg: BPEConfig) -> list[str]:
  """The training texts of a task BPE tokenizer (module docstring)."""
  return mixture_corpus(cfg.corpus_size, seed=cfg.seed, difficulties=cfg.difficulties)


def task_tokenizer(spec: str, directory: str | os.PathLike | None, *,
                   field: str = "tokenizer") -> ByteTokenizer | BPETokenizer:
  """``"byte"`` or ``"bpe:<V>"`` trained on ``bpe_corpus`` and stored in
  ``directory`` (reused there when built with the same config;
  ``opd.text.bpe.resolve_tokenizer``)."""
  return resolve_tokenizer(spec, directory, bpe_corpus, field=field)
