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

**Swap-averaging** (``judge_pairs_both_orders``): each pair is judged in
its seeded order and in the mirrored one; the verdict is the mean of the
valid orders' picks, ``share`` = the credit of the original second response
(0, 1/2 or 1; NaN when neither order is valid). A judge that always answers
"A" gets 1/2 on every pair. ``position_stats`` reports the "A" rate of the
single judgements (before) and the credit the combined verdict gives the
response shown first as A (after; 1/2 when the judge reads only positions).
``SCORE_PATTERN`` is the verdict line for constrained decoding
(``opd.rollout.constraint``): free text, then ``Better: A`` or ``Better: B``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from grm.format import plain, user_prompt_ids
from grm.judge import Chunking, sample_rows
from opd.rollout.constraint import compile_patterns
from opd.rollout.policy import Policy
from opd.rollout.sampler import SamplingConfig

CHOICE_PREFIX = "Better:"
PAIRWISE_REASONS = ("not_text", "empty", "no_choice_line", "malformed_choice")
_CHOICE_LINE = re.compile(re.escape(CHOICE_PREFIX) + r"[ \t]*([AB])[ \t]*", re.ASCII)
SCORE_PATTERN = r"([^\n]*\n)*" + re.escape(CHOICE_PREFIX) + r" (A|B)"
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


def mirrored(query: str, first: str, second: str, *, seed) -> PairwisePrompt:
  """The prompt showing ``build_pairwise_prompt(query, first, second, seed=seed)``'s
  responses in the other order. Its ``preferred_index`` counts in (second,
  first) order: the original index is ``1 - p``."""
  return build_pairwise_prompt(query, second, first, seed=seed)


def swap_average(first, second) -> np.ndarray:
  """Combined verdicts of pairs judged in both orders.

  Args:
    first, second: ``[E]`` preferred original index per pair (0, 1, or -1
      when invalid) of the seeded order and of the mirrored one (mapped back
      to the original order).

  Returns:
    ``[E]`` float64 credit of the second response: the mean pick of the
    valid orders (0, 0.5 or 1), NaN when neither is valid.
  """
  a, b = np.asarray(first), np.asarray(second)
  if a.shape != b.shape or a.ndim != 1 or np.any((a < -1) | (a > 1) | (b < -1) | (b > 1)):
    raise ValueError(f"first {a.shape=} and second {b.shape=} must be equal [E] arrays of "
                     "values in {-1, 0, 1}")
  picks = np.stack([a, b]).astype(np.float64)
  valid = picks >= 0
  n = valid.sum(0)
  total = np.where(valid, picks, 0.0).sum(0)
  return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def position_stats(judgements: Sequence[PairwiseJudgement], swapped_first: Sequence[bool],
                   share) -> dict[str, float]:
  """The judge's position bias before and after swap-averaging (module docstring).

  Args:
    judgements: every parsed judgement (both orders).
    swapped_first: ``[E]`` whether the seeded (first) order showed the second
      response as A.
    share: ``[E]`` ``swap_average``'s credit of the second response.

  Returns:
    ``a_rate_before``: the fraction of valid judgements answering "A";
    ``a_rate_after``: the mean credit the combined verdict gives the response
    the first order showed as A, over pairs with a verdict;
    ``split_rate``: the fraction of pairs with a verdict of exactly 1/2 (the
    two orders disagree: position, not content, decided both). NaN where
    nothing counts.
  """
  sh = np.asarray(share, np.float64)
  sw = np.asarray(swapped_first, bool)
  if sh.shape != sw.shape or sh.ndim != 1:
    raise ValueError(f"share {sh.shape=} and swapped_first {sw.shape=} must be equal [E]")
  valid = [j.choice for j in judgements if j.valid]
  decided = ~np.isnan(sh)
  credit_a = np.where(sw, sh, 1.0 - sh)[decided]
  nan = float("nan")
  return {"a_rate_before": float(np.mean([c == "A" for c in valid])) if valid else nan,
          "a_rate_after": float(credit_a.mean()) if credit_a.size else nan,
          "split_rate": float(np.mean(sh[decided] == 0.5)) if decided.any() else nan}


def _judge(policy: Policy, prompts, seed, sampling, constrained, chunking):
  ids = [user_prompt_ids(policy.tokenizer, p.text) for p in prompts]
  automaton = None
  if constrained:
    automaton = compile_patterns([SCORE_PATTERN], policy.tokenizer, end_ids=sampling.end_ids,
                                 vocab_size=policy.model_cfg.vocab_size)
  completions = sample_rows(policy, ids, int(seed), sampling, chunking=chunking,
                            constraint=automaton)
  return [parse_pairwise(c.text) for c in completions]


def judge_pairs(policy: Policy, pairs: Sequence[tuple[str, str, str]], *, seed: int,
                sampling: SamplingConfig, chunking: Chunking = Chunking(),
                constrained: bool = False) -> tuple[np.ndarray, list[PairwiseJudgement]]:
  """Judges ``(query, first, second)`` triples in batched sampler calls.

  Pair e is swapped with seed ``(seed, e)``. ``policy`` is the pairwise judge
  (``opd.rollout.Policy``); ``chunking`` lays the rows into sampler calls
  (``grm.judge.sample_rows``); ``constrained`` decodes under ``SCORE_PATTERN``.

  Returns:
    ``(preferred [E] int64, judgements)``: the preferred original index per
    pair (-1 when the output was invalid) and the parses.
  """
  prompts = [build_pairwise_prompt(q, a, b, seed=(int(seed), e))
             for e, (q, a, b) in enumerate(pairs)]
  judgements = _judge(policy, prompts, seed, sampling, constrained, chunking)
  preferred = np.asarray([preferred_index(j, p.swapped) for j, p in zip(judgements, prompts)],
                         np.int64)
  return preferred, judgements


@dataclasses.dataclass(frozen=True)
class SwapVerdicts:
  """``share [E]``: ``swap_average``'s credit of each pair's second response;
  ``first [E]``: the seeded order's preferred index alone (``judge_pairs``'
  ``preferred``); ``swapped [E]``: the seeded order's swap flags;
  ``judgements``: the seeded orders' parses, then the mirrored ones';
  ``stats``: ``position_stats``."""
  share: np.ndarray
  first: np.ndarray
  swapped: np.ndarray
  judgements: list[PairwiseJudgement]
  stats: dict[str, float]


def judge_pairs_both_orders(policy: Policy, pairs: Sequence[tuple[str, str, str]], *,
                            seed: int, sampling: SamplingConfig,
                            chunking: Chunking = Chunking(),
                            constrained: bool = False) -> SwapVerdicts:
  """``judge_pairs`` with every pair judged in both orders (one sampler pass over
  2E prompts) and swap-averaged (module docstring)."""
  first = [build_pairwise_prompt(q, a, b, seed=(int(seed), e))
           for e, (q, a, b) in enumerate(pairs)]
  second = [mirrored(q, a, b, seed=(int(seed), e)) for e, (q, a, b) in enumerate(pairs)]
  judgements = _judge(policy, first + second, seed, sampling, constrained, chunking)
  E = len(pairs)
  pa = np.asarray([preferred_index(j, p.swapped) for j, p in zip(judgements[:E], first)],
                  np.int64)
  pb = [preferred_index(j, p.swapped) for j, p in zip(judgements[E:], second)]
  share = swap_average(pa, np.asarray([1 - p if p >= 0 else -1 for p in pb], np.int64))
  swapped = np.asarray([p.swapped for p in first], bool)
  return SwapVerdicts(share, pa, swapped, judgements, position_stats(judgements, swapped, share))
