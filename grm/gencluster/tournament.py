"""Ranking clusters by a pairwise tournament (docs/DESIGN.md §6 pairwise judge, §7).

Every pair of cluster representatives (the longest-reasoning member of each
of the ``max_clusters`` largest clusters) is judged ``games`` times by a
pairwise judge (``grm.pairwise``: "Response A/B", last line ``Better: A|B``).
Which representative is shown as A is a coin flip seeded by
``(seed, *where, i, j, game)``; the judge's choice is mapped back to the
original order (``pairwise.preferred_index``), so a judge that always says
"A" wins each pair for a seeded random side, never for a fixed one.

A valid judgement gives the preferred cluster one win; an invalid one gives
nobody anything. Clusters are ranked by wins, then size, then by their order
in the input (largest first), so the ranking is a function of the seed and
the judge's texts only: deterministic for a deterministic judge.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from grm import pairwise

JudgeFn = Callable[[Sequence[str], int], Sequence[str]]  # (prompt texts, seed) -> completions


@dataclasses.dataclass(frozen=True)
class Match:
  """One judged pair: clusters ``i < j``, the prompt shown, and the game index."""
  i: int
  j: int
  game: int
  prompt: pairwise.PairwisePrompt


def matches(query: str, representatives: Sequence[str], *, seed: int, where: Sequence[int] = (),
            games: int = 1) -> list[Match]:
  """All pairs ``i < j`` of representatives, ``games`` times, order randomised by the seed."""
  if isinstance(games, bool) or not isinstance(games, int) or games < 1:
    raise ValueError(f"games={games!r} must be an int >= 1")
  n = len(representatives)
  return [Match(i, j, g, pairwise.build_pairwise_prompt(
      query, representatives[i], representatives[j],
      seed=(int(seed), *map(int, where), i, j, g)))
          for i in range(n) for j in range(i + 1, n) for g in range(games)]


@dataclasses.dataclass(frozen=True)
class Ranking:
  """``order``: cluster indices best first; ``wins`` per cluster; judgement counts."""
  order: tuple[int, ...]
  wins: tuple[int, ...]
  judged: int
  valid: int


def rank(sizes: Sequence[int], games: Sequence[Match], texts: Sequence[str]) -> Ranking:
  """Ranks clusters from the judge's texts for ``games`` (module docstring).

  Args:
    sizes: cluster sizes, in the input order (largest first).
    games: the matches judged.
    texts: the judge's completion per match.
  """
  if len(games) != len(texts):
    raise ValueError(f"{len(games)} matches but {len(texts)} judge texts")
  wins = np.zeros(len(sizes), np.int64)
  valid = 0
  for m, text in zip(games, texts):
    p = pairwise.preferred_index(pairwise.parse_pairwise(text), m.prompt.swapped)
    if p >= 0:
      valid += 1
      wins[(m.i, m.j)[p]] += 1
  order = sorted(range(len(sizes)), key=lambda c: (-wins[c], -sizes[c], c))
  return Ranking(tuple(order), tuple(int(w) for w in wins), len(games), valid)


def run_tournament(query: str, representatives: Sequence[str], sizes: Sequence[int], judge: JudgeFn,
               *, seed: int, where: Sequence[int] = (), games: int = 1) -> Ranking:
  """``rank`` of ``matches`` judged by ``judge`` (one call, seeded by ``seed``)."""
  if len(representatives) != len(sizes):
    raise ValueError(f"{len(representatives)} representatives but {len(sizes)} sizes")
  ms = matches(query, representatives, seed=seed, where=where, games=games)
  texts = list(judge([m.prompt.text for m in ms], int(seed))) if ms else []
  return rank(sizes, ms, texts)
