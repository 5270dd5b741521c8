"""The pairwise generative judge baseline: "A or B", order randomised (docs/DESIGN.md §6).

The prompt shows a query and two responses as "Response A" and "Response B";
which original response is A is a seeded coin flip (``PairwisePrompt.swapped``).
Output grammar (``format_pairwise`` renders it, ``parse_pairwise`` reads it
and never raises)::

  <free-text critique, any number of lines>
  Better: A

The last line is ``Better: A`` or ``Better: B`` (spaces or tabs around the
letter allowed). Reason codes of an invalid output: ``not_text``, ``empty``,
``no_choice_line`` (the last line does not start with ``Better:``),
``malformed_choice`` (it does, but the rest is not A or B).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from grm.format import plain, user_prompt_ids
from grm.judge import sample_rows
from opd.models import ModelConfig
from opd.rollout.sampler import SamplingConfig

CHOICE_PREFIX = "Better:"
PAIRWISE_REASONS = ("not_text", "empty", "no_choice_line", "malformed_choice")
_CHOICE_LINE = re.compile(re.escape(CHOICE_PREFIX) + r"[ \t]*([AB])[ \t]*", re.ASCII)
_INSTRUCTION = ("Compare the two responses to the query below. Write a short critique, then "
                "end with exactly one line \"Better: A\" or \"Better: B\" naming the better "
                "response.")


@dataclasses.dataclass(frozen=True)
class PairwisePrompt:
  """``text``: the user message; ``swapped``: Response A is the original second one."""
  text: str
  swapped: bool


@dataclasses.dataclass(frozen=True)
class PairwiseJudgement:
  """``choice``: "A", "B" or None (invalid); ``reason``: None or a ``PAIRWISE_REASONS`` code."""
  choice: str | None
  reason: str | None

  @property
  def valid(self) -> bool:
    return self.reason is None


def build_pairwise_prompt(query: str, first: str, second: str, *, seed) -> PairwisePrompt:
  """The pairwise prompt; A/B order from ``np.random.default_rng(seed)`` (None: no swap)."""
  for name, v in (("query", query), ("first", first), ("second", second)):
    if not isinstance(v, str):
      raise ValueError(f"{name} must be a str, got {type(v).__name__}")
  swapped = False if seed is None else bool(np.random.default_rng(seed).integers(2))
  a, b = (second, first) if swapped else (first, second)
  text = "\n".join([_INSTRUCTION, "", "[Query]", plain(query.strip()), "[End of Query]", "",
                    "[Response A]", plain(a.strip()), "[End of Response A]", "",
                    "[Response B]", plain(b.strip()), "[End of Response B]"])
  return PairwisePrompt(text=text, swapped=swapped)


def format_pairwise(critique: str, choice: str) -> str:
  """A judge output in the grammar above (SFT targets); ``choice`` is "A" or "B"."""
  if choice not in ("A", "B"):
    raise ValueError(f"choice={choice!r} must be 'A' or 'B'")
  if not isinstance(critique, str):
    raise ValueError(f"critique must be a str, got {type(critique).__name__}")
  line = f"{CHOICE_PREFIX} {choice}"
  return f"{critique.strip()}\n{line}" if critique.strip() else line


def parse_pairwise(text) -> PairwiseJudgement:
  """Reads the last line's choice; never raises."""
  if not isinstance(text, str):
    return PairwiseJudgement(None, "not_text")
  if not text.strip():
    return PairwiseJudgement(None, "empty")
  last = text.rstrip().split("\n")[-1].strip()
  if not last.startswith(CHOICE_PREFIX):
    return PairwiseJudgement(None, "no_choice_line")
  m = _CHOICE_LINE.fullmatch(last)
  if m is None:
    return PairwiseJudgement(None, "malformed_choice")
  return PairwiseJudgement(m.group(1), None)


def preferred_index(judgement: PairwiseJudgement, swapped: bool) -> int:
  """The original index (0 = first, 1 = second) the judge prefers, or -1 when invalid."""
  if not judgement.valid:
    return -1
  picked_a = judgement.choice == "A"
  return int(picked_a == swapped)  # A is original 0 unless swapped


def judge_pairs(model_cfg: ModelConfig, params, tokenizer, pairs: Sequence[tuple[str, str, str]],
                *, seed: int, sampling: SamplingConfig, prompt_bucket: int = 32,
                batch_size: int | None = None, length_bucket: int | None = None, mesh=None,
                rules=None) -> tuple[np.ndarray, list[PairwiseJudgement]]:
  """Judges ``(query, first, second)`` triples in batched sampler calls.

  Pair e is swapped with seed ``(seed, e)``. ``batch_size`` (None: all in
  one call), ``prompt_bucket`` and ``length_bucket`` are those of
  ``grm.judge.sample_rows``.

  Returns:
    ``(preferred [E] int64, judgements)``: the preferred original index per
    pair (-1 when the output was invalid) and the parses.
  """
  prompts = [build_pairwise_prompt(q, a, b, seed=(int(seed), e))
             for e, (q, a, b) in enumerate(pairs)]
  ids = [user_prompt_ids(tokenizer, p.text) for p in prompts]
  completions = sample_rows(model_cfg, params, tokenizer, ids, int(seed), sampling,
                            batch_size=batch_size, prompt_bucket=prompt_bucket,
                            length_bucket=length_bucket, mesh=mesh, rules=rules)
  judgements = [parse_pairwise(c.text) for c in completions]
  preferred = np.asarray([preferred_index(j, p.swapped) for j, p in zip(judgements, prompts)],
                         np.int64)
  return preferred, judgements
