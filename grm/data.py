"""Preference groups from the task suite, and a rule-based judge for cold-start SFT (docs/DESIGN.md §6).

**Groups.** For each task example, candidate responses come from our own
models (``sample_candidates``: every (model, temperature) pair rolls out the
examples through ``opd.rollout.rollout``, which runs the task's verifier;
the writing task's verifier *is* its hidden rubric). ``build_groups`` then
draws, per example, a group of n responses (n uniform in ``sizes``, capped
by the number of distinct candidates) with ground-truth ratings:

  n >= 2  the verifier rewards in [0, 1]; a group is kept only when its best
          response is unique (dropped groups are counted, ``no_unique_best``).
          With ``max_draws > 1`` subsets are redrawn until one has a unique
          best (the size first lowered to the largest that can have one), so
          an example is dropped only when all its candidates score alike;
  n == 1  the integer rating ``rating_from_reward(r) = 1 + round(9 r)``.

Splits are those of the examples, which ``opd.tasks`` assigns by a hash of
the prompt, so a prompt never appears in two splits (``split_groups`` checks
it).

**Rule-based judge.** ``rule_judgement`` writes a judgement that knows the
truth, in the grammar of ``grm.format``: two principles drawn from a
per-domain list with integer weights summing to 100, a critique that names
each response's verifier reason (``Response 2: wrong_answer.``), and scores consistent with the ratings
(the best strictly highest; the others jittered by ±1 with probability
``noise``, never reaching the best). It plays the role that a stronger
model's judgements play in the paper.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax
import numpy as np

from grm.correctness import check_ratings
from grm.format import GRMPrompt, Principle, build_prompt, format_judgement, shuffle
from opd.models import ModelConfig
from opd.rollout.episodes import RolloutLog, rollout
from opd.rollout.policy import Episode, Policy, sampling_for_chat
from opd.tasks import Example, Reward

# Short texts (byte-level models: every character is a token the GRM writes).
PRINCIPLES = {
    "math": ("The final answer is correct.",
             "It ends with 'Answer: <number>'.",
             "The reasoning is short and sound."),
    "code": ("It returns the right values.",
             "It defines the function and runs.",
             "The code is short and direct."),
    "instruct": ("Every constraint holds.",
                 "No forbidden word appears.",
                 "The length is as requested."),
    "writing": ("It has the requested sentences.",
                "It uses the required words.",
                "Sentences are well punctuated.",
                "No word repeats."),
    "agent": ("The answer matches the tools.",
              "Tool calls are well-formed.",
              "No needless tool calls."),
}


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One sampled response and its verifier verdict."""
  text: str
  reward: Reward


@dataclasses.dataclass(frozen=True)
class PreferenceGroup:
  """A query with n responses and their ground truth.

  Attributes:
    domain, example_id, split: from the task example.
    query: the prompt shown to the GRM.
    responses: n response texts.
    ratings: n rewards in [0, 1] (n >= 2, unique best) or one integer
      rating in 1..10 (n == 1).
    reasons: n verifier reasons (``Reward.reason``).
  """
  domain: str
  example_id: str
  split: str
  query: str
  responses: tuple[str, ...]
  ratings: tuple[float, ...]
  reasons: tuple[str, ...]

  @property
  def n(self) -> int:
    return len(self.responses)


def rating_from_reward(reward: float) -> int:
  """A reward in [0, 1] as an integer rating ``1 + round(9 r)`` in 1..10."""
  if not 0.0 <= reward <= 1.0:
    raise ValueError(f"reward={reward!r} must be in [0, 1]")
  return 1 + int(np.rint(9.0 * reward))


def episode_text(episode: Episode) -> str:
  """The response as the GRM sees it: the policy's turns, one per line (a
  single-turn episode's completion as sampled)."""
  return "\n".join(episode.turns)


def sample_candidates(models: Sequence[tuple[ModelConfig, object]], tokenizer,
                      examples: Sequence[Example], *, temperatures: Sequence[float],
                      max_new_tokens: int, seed: int, mesh=None, rules=None,
                      log: RolloutLog | None = None) -> list[list[Candidate]]:
  """``[E][len(models) * len(temperatures)]`` verified candidates per example.

  Each (model, temperature) pair is one ``opd.rollout.rollout`` call over
  all examples (key folded from ``seed`` and the pair's index), on ``mesh``
  with ``rules``, adding to ``log`` (reward counts, timings).
  """
  if not models or not temperatures:
    raise ValueError(f"need at least one model and one temperature, got {len(models)} models "
                     f"and temperatures={tuple(temperatures)}")
  out: list[list[Candidate]] = [[] for _ in examples]
  for m, (cfg, params) in enumerate(models):
    for t, temperature in enumerate(temperatures):
      sampling = sampling_for_chat(tokenizer, max_new_tokens=max_new_tokens,
                                   temperature=temperature)
      key = jax.random.fold_in(jax.random.key(int(seed)), m * len(temperatures) + t)
      episodes = rollout(Policy(cfg, params, tokenizer, mesh, rules), examples, key, sampling,
                         log=log)
      for e, ep in enumerate(episodes):
        out[e].append(Candidate(episode_text(ep), ep.reward))
  return out


def build_groups(examples: Sequence[Example], candidates: Sequence[Sequence[Candidate]], *,
                 seed: int, sizes: Sequence[int] = (1, 2, 3, 4), max_draws: int = 1
                 ) -> tuple[list[PreferenceGroup], dict[str, int]]:
  """One preference group per example (module docstring).

  Args:
    examples: E task examples.
    candidates: ``[E]`` lists of verified candidates (duplicates allowed:
      identical texts count once).
    seed: ``np.random.default_rng((seed, e))`` draws example e's group.
    sizes: allowed group sizes (each in 1..10).
    max_draws: for n >= 2, random subsets of size n are drawn until one has
      a unique best, at most this many times (1: one draw, dropped on a tie
      at the top). With ``max_draws > 1`` the size is first lowered to the
      largest any subset can have a unique best at, ``1 + #{candidates below
      the top reward}`` (a group of n needs n - 1 responses below its best);
      when that is under 2 (every distinct candidate has the same reward) or
      no draw succeeds, the example is dropped. The kept groups are random
      subsets conditioned on a unique best.

  Returns:
    ``(groups, counts)`` with counts ``kept``, ``no_unique_best``,
    ``no_candidates``, ``kept_n{n}`` per size and (``max_draws > 1``)
    ``redrawn`` (groups kept after more than one draw) and ``size_lowered``.
  """
  if len(examples) != len(candidates):
    raise ValueError(f"{len(examples)} examples but {len(candidates)} candidate lists")
  sizes = tuple(sorted(set(int(s) for s in sizes)))
  if not sizes or sizes[0] < 1 or sizes[-1] > 10:
    raise ValueError(f"sizes={sizes} must be non-empty ints in [1, 10]")
  if isinstance(max_draws, bool) or not isinstance(max_draws, (int, np.integer)) or max_draws < 1:
    raise ValueError(f"max_draws={max_draws!r} must be an int >= 1")
  counts = collections.Counter()
  groups = []
  for e, (example, cands) in enumerate(zip(examples, candidates)):
    distinct = list({c.text: c for c in cands if c.reward is not None}.values())
    if not distinct:
      counts["no_candidates"] += 1
      continue
    rng = np.random.default_rng((int(seed), e))
    n = min(int(rng.choice(sizes)), len(distinct))
    if n >= 2 and max_draws > 1:
      top = max(c.reward.reward for c in distinct)
      feasible = 1 + sum(c.reward.reward < top for c in distinct)
      if feasible < 2:
        counts["no_unique_best"] += 1
        continue
      if feasible < n:
        n = feasible
        counts["size_lowered"] += 1
    for draw in range(max_draws if n >= 2 else 1):
      picked = [distinct[i] for i in rng.choice(len(distinct), size=n, replace=False)]
      rewards = [c.reward.reward for c in picked]
      if n == 1 or rewards.count(max(rewards)) == 1:
        break
    if n == 1:
      ratings = (float(rating_from_reward(rewards[0])),)
    elif rewards.count(max(rewards)) != 1:
      counts["no_unique_best"] += 1
      continue
    else:
      ratings = tuple(float(r) for r in rewards)
      if draw:
        counts["redrawn"] += 1
    groups.append(PreferenceGroup(example.domain, example.id, example.split, example.prompt,
                                  tuple(c.text for c in picked), ratings,
                                  tuple(c.reward.reason for c in picked)))
    counts["kept"] += 1
    counts[f"kept_n{n}"] += 1
  return groups, {k: int(v) for k, v in counts.items()}


def split_groups(groups: Sequence[PreferenceGroup]) -> dict[str, list[PreferenceGroup]]:
  """Groups by split; raises ``ValueError`` when a query sits in two splits."""
  by_split: dict[str, list[PreferenceGroup]] = collections.defaultdict(list)
  where: dict[tuple[str, str], str] = {}
  for g in groups:
    key = (g.domain, g.query)
    if where.setdefault(key, g.split) != g.split:
      raise ValueError(f"query {g.query!r:.60} of {g.domain} is in splits {where[key]!r} and "
                       f"{g.split!r}")
    by_split[g.split].append(g)
  return dict(by_split)


def truth_scores(ratings: Sequence[float], rng: np.random.Generator,
                 noise: float) -> tuple[int, ...]:
  """Scores in 1..10 (original order) that are correct for ``ratings``.

  n == 1: the rating itself. n >= 2: ``rating_from_reward`` of each reward,
  then the best lifted strictly above the rest (others lowered when the best
  is at 10), then each other score moved by ±1 with probability ``noise``
  while staying in 1..best-1.
  """
  r = check_ratings(ratings)
  if r.size == 1:
    return (int(r[0]),)
  j = int(np.argmax(r))
  scores = np.array([rating_from_reward(float(np.clip(x, 0.0, 1.0))) for x in r])
  others = np.delete(np.arange(r.size), j)
  best = max(int(scores[j]), int(scores[others].max()) + 1, 2)
  best = min(best, 10)
  scores[others] = np.minimum(scores[others], best - 1)
  scores[j] = best
  for i in others:
    if rng.random() < noise:
      scores[i] = int(np.clip(scores[i] + rng.choice((-1, 1)), 1, best - 1))
  return tuple(int(s) for s in scores)


def rule_judgement(group: PreferenceGroup, *, seed, noise: float = 0.2,
                   shuffle_seed=None, principles: int = 2, critique: bool = True
                   ) -> tuple[GRMPrompt, str]:
  """A GRM prompt for ``group`` and a correct judgement text for it (SFT target).

  Args:
    group: a ``PreferenceGroup``.
    seed: ``np.random.default_rng`` seed of principles, weights and noise.
    noise: probability of a ±1 jitter on each non-best score.
    shuffle_seed: the prompt's response order (``grm.format.build_prompt``).
    principles: how many principles the judgement states (0 up to the domain's
      list; weights sum to 100); the judgement sized to the model writing it.
    critique: whether the critique names each response's verifier reason (else
      the judgement goes from the principles straight to the scores).

  Returns:
    ``(prompt, text)``; ``parse_judgement(text, n)`` is valid and its
    unshuffled scores are correct for ``group.ratings``.
  """
  if not 0.0 <= noise <= 1.0:
    raise ValueError(f"noise={noise!r} must be in [0, 1]")
  if group.domain not in PRINCIPLES:
    raise ValueError(f"group.domain={group.domain!r} has no principle list; "
                     f"known: {sorted(PRINCIPLES)}")
  pool = PRINCIPLES[group.domain]
  if isinstance(principles, bool) or not isinstance(principles, (int, np.integer)) or not (
      0 <= principles <= len(pool)):
    raise ValueError(f"principles={principles!r} must be an int in [0, {len(pool)}] (the "
                     f"{group.domain} list's length)")
  rng = np.random.default_rng(seed)
  prompt = build_prompt(group.query, group.responses, seed=shuffle_seed)
  stated = _principles(pool, int(principles), rng)
  scores = truth_scores(group.ratings, rng, noise)
  shown_scores = shuffle(scores, prompt.order)
  shown_reasons = shuffle(group.reasons, prompt.order)
  text = "\n".join(f"Response {p + 1}: {reason}." for p, reason in enumerate(shown_reasons))
  return prompt, format_judgement(stated, text if critique else "", shown_scores)


def _principles(pool: Sequence[str], k: int, rng: np.random.Generator) -> list[Principle]:
  """``k`` principles of ``pool`` (pool order) with weights summing to 100. Two, as
  the cold start always drew them: the first weight uniform in 10..90 (tens); one:
  100; more: each of the first k - 1 uniform in 10.. tens, the rest to the last."""
  if k == 0:
    return []
  chosen = [pool[i] for i in sorted(rng.choice(len(pool), size=k, replace=False))]
  weights, left = [], 100
  for slots in range(k - 1, 0, -1):  # leave >= 10 for each principle after this one
    w = int(rng.integers(1, left // 10 - slots + 1)) * 10
    weights.append(w)
    left -= w
  return [Principle(t, w) for t, w in zip(chosen, weights + [left])]


def downsample_rating1(groups: Sequence[PreferenceGroup], keep: float, *, seed
                       ) -> list[PreferenceGroup]:
  """``groups`` with only ``round(keep * m)`` of its m single-response groups rated 1
  (seeded draw without replacement; every other group and the order kept).

  Those groups are most of the single-response ones (a wrong answer rates 1), so a
  GRM trained on them learns to write 1; ``keep`` in [0, 1], 1 keeps all.
  """
  if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 <= keep <= 1.0:
    raise ValueError(f"keep={keep!r} must be a fraction in [0, 1]")
  ones = [i for i, g in enumerate(groups) if g.n == 1 and float(g.ratings[0]) == 1.0]
  n_keep = int(np.rint(keep * len(ones)))
  kept = set(np.random.default_rng(seed).choice(ones, size=n_keep, replace=False).tolist()) \
      if ones else set()
  drop = set(ones) - kept
  return [g for i, g in enumerate(groups) if i not in drop]
