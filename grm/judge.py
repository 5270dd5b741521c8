"""Sampling GRM judgements: k shuffled samples per example, one sampler call (docs/DESIGN.md §6).

For E examples (a query and its n_e responses) and k samples each, the E·k
prompts, every one with its own seeded response order (seed ``(seed, e,
j)``), go through ``opd.rollout.policy.sample`` together (``sample_rows``:
one call, or fixed-size chunks of ``batch_size`` rows at a fixed prompt
width when there are more), then each output is parsed (``grm.parse``) and
its scores mapped back to the original order.
``score_arrays`` turns one example's samples into the ``[k, n]`` / ``[k]``
arrays the pure voting functions (``grm.voting``) take.

A sample the sampler cut at its token budget (``finished`` False) is invalid
with reason ``truncated`` even when its text ends on a well-formed scores
line: the model never chose to stop there (``judge_completion``).
``REASONS`` is ``grm.parse.REASONS`` plus ``truncated``; ``invalid_sample_counts``
counts sampled judgements over it.

``constrained=True`` decodes every row under ``score_pattern(n)`` of its
response count (``opd.rollout.constraint``; one table holds the patterns of
every n of the call): free text, then the last line ``Scores: \boxed{...}``
with exactly n integers in 1..10, as ``grm.format.format_scores`` writes it.
A finished constrained sample always parses; a truncated one stays invalid.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax
import numpy as np
import tqdm

from grm.format import SCORES_PREFIX, GRMPrompt, build_prompt, prompt_ids, unshuffle
from grm.parse import REASONS as PARSE_REASONS
from grm.parse import Judgement, parse_judgement
from opd.rollout.constraint import TokenAutomaton, compile_patterns
from opd.rollout.policy import Completion, Policy, sample
from opd.rollout.sampler import SamplingConfig

TRUNCATED = "truncated"
REASONS = PARSE_REASONS + (TRUNCATED,)
_SCORE = "([1-9]|10)"


def score_pattern(n: int) -> str:
  """The regular expression of a judgement of n responses whose last line is valid:
  any lines, then ``Scores: \boxed{s_1, ..., s_n}``, each s in 1..10."""
  return (r"([^\n]*\n)*" + re.escape(SCORES_PREFIX) + r" \\boxed\{" + _SCORE
          + (r"(, " + _SCORE + r"){%d}" % (n - 1) if n > 1 else "") + r"\}")


@dataclasses.dataclass(frozen=True)
class SampledJudgement:
  """One GRM sample for one example.

  Attributes:
    prompt: the prompt it answered (``prompt.order`` is its shuffle).
    text: what the model wrote (stop token excluded).
    judgement: the parse, scores in the shown order.
    finished: the sample ended with a stop token (False: cut at the budget).
  """
  prompt: GRMPrompt
  text: str
  judgement: Judgement
  finished: bool

  @property
  def scores(self) -> tuple[int, ...] | None:
    """The scores in the original response order, or None when invalid."""
    if not self.judgement.valid:
      return None
    return unshuffle(self.judgement.scores, self.prompt.order)


def _check_groups(groups) -> list[tuple[str, tuple[str, ...]]]:
  out = []
  for e, g in enumerate(groups):
    if not (isinstance(g, (tuple, list)) and len(g) == 2):
      raise ValueError(f"groups[{e}] must be a (query, responses) pair, got {g!r:.80}")
    query, responses = g
    if isinstance(responses, str) or len(responses) == 0:
      raise ValueError(f"groups[{e}] responses must be a non-empty sequence of str")
    out.append((query, tuple(responses)))
  return out


def build_prompts(groups, k: int, seed: int, *, hints: Sequence[int | None] | None = None
                  ) -> list[list[GRMPrompt]]:
  """``[E][k]`` prompts; sample j of example e is shuffled with seed ``(seed, e, j)``.

  Args:
    groups: E ``(query, responses)`` pairs.
    k: samples per example (>= 1).
    seed: int base seed of the shuffles.
    hints: optional ``[E]`` original index of the best response per example
      (hinted sampling), None entries for no hint.
  """
  groups = _check_groups(groups)
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k={k!r} must be an int >= 1")
  if hints is not None and len(hints) != len(groups):
    raise ValueError(f"hints has {len(hints)} entries for {len(groups)} groups")
  return [[build_prompt(q, r, seed=(int(seed), e, j),
                        hint_best=None if hints is None else hints[e]) for j in range(k)]
          for e, (q, r) in enumerate(groups)]


@dataclasses.dataclass(frozen=True)
class Chunking:
  """How ``sample_rows`` lays rows into sampler calls.

  Attributes:
    batch_size: rows per sampler call (None: all rows in one call).
    prompt_bucket: prompts are left-padded to a multiple of this.
    length_bucket: None: every chunk is padded to the longest prompt of all;
      L: rows sorted by length, each chunk padded to its own longest rounded
      up to a multiple of L (``sample_rows``).
  """
  batch_size: int | None = None
  prompt_bucket: int = 32
  length_bucket: int | None = None

  def __post_init__(self):
    for name in ("batch_size", "length_bucket"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                            or v < 1):
        raise ValueError(f"{name}={v!r} must be an int >= 1 or None")
    p = self.prompt_bucket
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1:
      raise ValueError(f"prompt_bucket={p!r} must be an int >= 1")


def sample_judgements(policy: Policy, groups, *, k: int, seed: int, sampling: SamplingConfig,
                      hints: Sequence[int | None] | None = None,
                      chunking: Chunking = Chunking(), progress: str | None = None,
                      constrained: bool = False) -> list[list[SampledJudgement]]:
  """k judgements per example, all E·k prompts in one batched sampler call.

  Args:
    policy: the GRM (``opd.rollout.Policy``: model, params, tokenizer, mesh, rules).
    groups: E ``(query, responses)`` pairs, responses in their original order.
    k: samples per example.
    seed: seeds both the shuffles (``build_prompts``) and the sampler.
    sampling: e.g. ``opd.rollout.sampling_for_chat(tok, ...)``.
    hints: optional per-example best index for hinted sampling.
    chunking, progress: as ``sample_rows`` (``chunking.batch_size`` bounds the
      rows sampled at once; None: all in one call).
    constrained: decode each row under ``score_pattern`` of its n.

  Returns:
    ``[E][k]`` ``SampledJudgement``s.
  """
  prompts = build_prompts(groups, k, seed, hints=hints)
  flat = [p for row in prompts for p in row]
  ids = [prompt_ids(policy.tokenizer, p) for p in flat]
  automaton = patterns = None
  if constrained and flat:
    automaton = compile_patterns([score_pattern(n) for n in range(1, max(p.n for p in flat) + 1)],
                                 policy.tokenizer, end_ids=sampling.end_ids,
                                 vocab_size=policy.model_cfg.vocab_size)
    patterns = [p.n - 1 for p in flat]
  completions = sample_rows(policy, ids, seed, sampling, chunking=chunking, progress=progress,
                            constraint=automaton, patterns=patterns)
  out = [judge_completion(p, c.text, c.finished) for p, c in zip(flat, completions)]
  return [out[e * k:(e + 1) * k] for e in range(len(prompts))]


def sample_rows(policy: Policy, prompts: Sequence[np.ndarray], seed: int,
                sampling: SamplingConfig, *, chunking: Chunking = Chunking(),
                progress: str | None = None, constraint: TokenAutomaton | None = None,
                patterns: Sequence[int] | None = None) -> list[Completion]:
  """One completion per prompt (id arrays), in sampler calls of at most ``batch_size`` rows.

  ``chunking.batch_size`` None, or at least ``len(prompts)``: one call of
  ``opd.rollout.policy.sample`` with key ``seed``. Otherwise the prompts
  go in chunks of exactly ``batch_size`` rows (the last padded by
  ``sample``), chunk c with key ``fold_in(key(seed), c)``, and the prompt
  width is fixed so the chunks share compiled samplers:

  - ``length_bucket`` None: every chunk is padded to the longest prompt
    (rounded up to ``prompt_bucket``): one shape, rows in their given order
    (a group's k samples stay in one chunk, where the sampler's shared
    prefill sees the repeated orders).
  - ``length_bucket`` L: rows are first stably sorted by length (equal-length
    rows keep their order) and each chunk is padded to its own longest
    rounded up to a multiple of L: fewer pad tokens, at most
    ``span / L + 1`` shapes. Completions come back in the given order.

  ``progress``: a label for a progress bar over the chunks (None: no bar).
  ``constraint``, ``patterns``: constrained decoding, prompt i under pattern
  ``patterns[i]`` of the automaton (``opd.rollout.policy.sample``).
  """
  if not prompts:
    return []
  if not isinstance(chunking, Chunking):
    raise ValueError(f"chunking must be a Chunking, got {type(chunking).__name__}")
  batch_size, prompt_bucket, length_bucket = (chunking.batch_size, chunking.prompt_bucket,
                                              chunking.length_bucket)
  n = len(prompts)
  if batch_size is None or n <= batch_size:
    return sample(policy, list(prompts), int(seed), sampling, batch_size=batch_size,
                  prompt_bucket=prompt_bucket, constraint=constraint, patterns=patterns)
  lengths = np.asarray([len(p) for p in prompts])
  if length_bucket is None:
    order = np.arange(n)
  else:
    order = np.argsort(lengths, kind="stable")
  key = jax.random.key(int(seed))
  out: list[Completion | None] = [None] * n
  starts = range(0, n, int(batch_size))
  if progress is not None:
    starts = tqdm.tqdm(starts, desc=str(progress), unit="chunk", dynamic_ncols=True)
  for c, start in enumerate(starts):
    idx = order[start:start + int(batch_size)]
    longest = int(lengths.max() if length_bucket is None else lengths[idx].max())
    step = prompt_bucket if length_bucket is None else int(length_bucket)
    width = step * math.ceil(longest / step)
    got = sample(policy, [prompts[i] for i in idx], jax.random.fold_in(key, c), sampling,
                 batch_size=int(batch_size), prompt_bucket=width, constraint=constraint,
                 patterns=None if patterns is None else [patterns[i] for i in idx])
    for i, comp in zip(idx, got):
      out[int(i)] = comp
  return out  # type: ignore[return-value]


def judge_completion(prompt: GRMPrompt, text: str, finished: bool) -> SampledJudgement:
  """One sampler output as a ``SampledJudgement``; an unfinished one is
  invalid with reason ``truncated`` (module docstring), else it is parsed."""
  if finished:
    judgement = parse_judgement(text, prompt.n)
  else:
    judgement = Judgement(scores=None, reason=TRUNCATED)
  return SampledJudgement(prompt=prompt, text=text, judgement=judgement, finished=bool(finished))


def invalid_sample_counts(samples: Sequence[SampledJudgement]) -> dict[str, int]:
  """``{reason: count}`` over the invalid samples, every reason of ``REASONS`` present."""
  out = {r: 0 for r in REASONS}
  for s in samples:
    if s.judgement.reason is not None:
      out[s.judgement.reason] += 1
  return out


def score_arrays(samples: Sequence[SampledJudgement]) -> tuple[np.ndarray, np.ndarray]:
  """One example's samples as ``(scores [k, n] int64, valid [k] bool)``, original order.

  Rows of invalid samples are zeros (the voting functions ignore them).
  """
  if not samples:
    raise ValueError("samples must hold at least one SampledJudgement")
  n = samples[0].prompt.n
  if any(s.prompt.n != n for s in samples):
    raise ValueError(f"samples mix response counts {[s.prompt.n for s in samples]}")
  scores = np.zeros((len(samples), n), np.int64)
  valid = np.zeros(len(samples), bool)
  for j, s in enumerate(samples):
    if s.scores is not None:
      scores[j], valid[j] = s.scores, True
  return scores, valid
