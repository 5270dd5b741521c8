"""Ranking clusters by a pairwise tournament (docs/DESIGN.md §6 pairwise judge, §7).

Every pair of cluster representatives (the longest-reasoning member of each
of the ``max_clusters`` largest clusters) is judged ``games`` times by a
pairwise judge (``grm.pairwise``: "Response A/B", last line ``Better: A|B``).
Which representative is shown as A is a coin flip seeded by
``(seed, *where, i, j, game)``; the judge's choice is mapped back to the
original order (``pairwise.preferred_index``), so a judge that always says
"A" wins each pair for a seeded random side, never for a fixed one.

With ``both_orders`` each game is also judged in the mirrored order
(``pairwise.mirrored``) and the two verdicts are swap-averaged
(``pairwise.swap_average``): a game gives its clusters the mean of its
valid orders' picks (1, 1/2 or 0 wins; a judge that always answers "A" gives
every game 1/2 each, so only size then orders clusters). ``position_bias``
reports the "A" rate before and after. With one order a valid judgement
gives the preferred cluster one win; an invalid one gives nobody anything.
Clusters are ranked by wins, then size, then by their order in the input
(largest first), so the ranking is a function of the seed and the judge's
texts only: deterministic for a deterministic judge.
``judge_accuracy`` scores the judge on the matches where exactly one side
is correct.
"""
from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Sequence

import numpy as np

from grm import pairwise

JudgeFn = Callable[[Sequence[str], int], Sequence[str]]  # (prompt texts, seed) -> completions


@dataclasses.dataclass(frozen=True)
class Match:
  """One judged pair: clusters ``i < j``, the prompt shown, the game index, and
  whether the prompt is the game's mirrored order (``pairwise.mirrored``)."""
  i: int
  j: int
  game: int
  prompt: pairwise.PairwisePrompt
  mirror: bool = False

  def pick(self, text: str) -> int:
    """The judge's preferred side, 0 (cluster i) or 1 (cluster j), or -1 when invalid."""
    p = pairwise.preferred_index(pairwise.parse_pairwise(text), self.prompt.swapped)
    return 1 - p if self.mirror and p >= 0 else p


def matches(query: str, representatives: Sequence[str], *, seed: int, where: Sequence[int] = (),
            games: int = 1, both_orders: bool = False) -> list[Match]:
  """All pairs ``i < j`` of representatives, ``games`` times, order randomised by the
  seed; with ``both_orders`` each game's mirrored match follows it."""
  if isinstance(games, bool) or not isinstance(games, int) or games < 1:
    raise ValueError(f"games={games!r} must be an int >= 1")
  n = len(representatives)
  out = []
  for i in range(n):
    for j in range(i + 1, n):
      for g in range(games):
        args = (query, representatives[i], representatives[j])
        seed_g = (int(seed), *map(int, where), i, j, g)
        out.append(Match(i, j, g, pairwise.build_pairwise_prompt(*args, seed=seed_g)))
        if both_orders:
          out.append(Match(i, j, g, pairwise.mirrored(*args, seed=seed_g), mirror=True))
  return out


def _verdicts(games: Sequence[Match], texts: Sequence[str]):
  """Per game ``(i, j, game)``: ``(first match, swap-averaged credit of j)`` in order."""
  if len(games) != len(texts):
    raise ValueError(f"{len(games)} matches but {len(texts)} judge texts")
  picks: dict[tuple[int, int, int], list] = {}
  for m, text in zip(games, texts):
    row = picks.setdefault((m.i, m.j, m.game), [m, -1, -1])
    row[2 if m.mirror else 1] = m.pick(text)
  first = [row[0] for row in picks.values()]
  share = pairwise.swap_average(np.asarray([r[1] for r in picks.values()], np.int64),
                                np.asarray([r[2] for r in picks.values()], np.int64))
  return first, share


def position_bias(games: Sequence[Match], texts: Sequence[str],
                  owners: Sequence | None = None) -> dict[str, float]:
  """``pairwise.position_stats`` of tournaments' judgements: the "A" rate of the
  single judgements, and the credit the combined verdict gives each game's
  first-shown A (1/2 after swap-averaging a judge that reads positions only).

  ``owners``: per match, the tournament it belongs to (e.g. its subtask), when
  ``games`` pools several: a game is ``(owner, i, j, game)``, so two subtasks'
  matches of clusters (0, 1) stay two games. None: one tournament.
  """
  if owners is None:
    owners = [None] * len(games)
  if len(owners) != len(games) or len(games) != len(texts):
    raise ValueError(f"{len(games)} matches, {len(texts)} judge texts and {len(owners)} "
                     "owners must be equal")
  by_owner: dict = {}
  for m, t, o in zip(games, texts, owners):
    ms, ts = by_owner.setdefault(o, ([], []))
    ms.append(m)
    ts.append(t)
  swapped, share = [], []
  for ms, ts in by_owner.values():
    first, sh = _verdicts(ms, ts)
    mirrored = [m for m in ms if m.mirror]
    if mirrored and len(mirrored) != len(first):
      raise ValueError("games mix mirrored and single-order matches")
    swapped += [m.prompt.swapped for m in first]
    share += list(sh)
  return pairwise.position_stats([pairwise.parse_pairwise(t) for t in texts],
                                 np.asarray(swapped, bool), np.asarray(share, np.float64))


@dataclasses.dataclass(frozen=True)
class Ranking:
  """``order``: cluster indices best first; ``wins`` per cluster; judgement counts."""
  order: tuple[int, ...]
  wins: tuple[float, ...]
  judged: int
  valid: int


def rank(sizes: Sequence[int], games: Sequence[Match], texts: Sequence[str]) -> Ranking:
  """Ranks clusters from the judge's texts for ``games`` (module docstring).

  Args:
    sizes: cluster sizes, in the input order (largest first).
    games: the matches judged.
    texts: the judge's completion per match.
  """
  first, share = _verdicts(games, texts)
  wins = np.zeros(len(sizes), np.float64)
  for m, q in zip(first, share):
    if not np.isnan(q):
      wins[m.i] += 1.0 - q
      wins[m.j] += q
  valid = sum(m.pick(t) >= 0 for m, t in zip(games, texts))
  order = sorted(range(len(sizes)), key=lambda c: (-wins[c], -sizes[c], c))
  return Ranking(tuple(order), tuple(float(w) for w in wins), len(games), int(valid))


def judge_accuracy(games: Sequence[Match], texts: Sequence[str], correct: Sequence[bool]
                   ) -> tuple[int, int]:
  """``(informative, right)`` over the ``games`` where exactly one cluster is
  ``correct`` (its representative passes the subtask's hidden tests): how
  many such matches, and on how many the judge preferred the correct side
  (mapped back through the swap; an invalid judgement is not right)."""
  if len(games) != len(texts):
    raise ValueError(f"{len(games)} matches but {len(texts)} judge texts")
  informative = right = 0
  for m, text in zip(games, texts):
    if bool(correct[m.i]) == bool(correct[m.j]):
      continue
    informative += 1
    right += m.pick(text) == (0 if correct[m.i] else 1)
  return informative, right


def run_tournament(query: str, representatives: Sequence[str], sizes: Sequence[int], judge: JudgeFn,
               *, seed: int, where: Sequence[int] = (), games: int = 1,
               both_orders: bool = False) -> Ranking:
  """``rank`` of ``matches`` judged by ``judge`` (one call, seeded by ``seed``)."""
  if len(representatives) != len(sizes):
    raise ValueError(f"{len(representatives)} representatives but {len(sizes)} sizes")
  ms = matches(query, representatives, seed=seed, where=where, games=games,
               both_orders=both_orders)
  texts = list(judge([m.prompt.text for m in ms], int(seed))) if ms else []
  return rank(sizes, ms, texts)


_INT = re.compile(r"(?<![\w.])\d+(?![\w.])")


def mutate_constant(source: str, rng: random.Random) -> str | None:
  """``source`` with one integer literal changed by 1-3 (a near miss), or None when
  it has none."""
  spots = list(_INT.finditer(source))
  if not spots:
    return None
  m = rng.choice(spots)
  n = int(m.group())
  value = n + rng.choice((1, 2, 3) if n <= 3 else (-3, -2, -1, 1, 2, 3))  # stays >= 0, != n
  return source[:m.start()] + str(value) + source[m.end():]


def judge_sft_pairs(examples, *, seed: int) -> list[tuple[str, str]]:
  """Rule-written pairwise SFT pairs for code: (prompt text, ``Better: A|B``).

  Per code example with an integer literal in its reference: the reference
  against a near miss (``mutate_constant``), sides by a coin seeded with
  ``(seed, e)``; the target names the reference's side. Docs: DESIGN.md §7.
  """
  out = []
  for e, ex in enumerate(examples):
    ref = ex.reference[-1][1]
    wrong = mutate_constant(ref, random.Random(f"gencluster/judge/{seed}/{e}"))
    if wrong is None or wrong == ref:
      continue
    p = pairwise.build_pairwise_prompt(ex.prompt, ref, wrong, seed=(int(seed), e))
    out.append((p.text, pairwise.format_pairwise("", "B" if p.swapped else "A")))
  return out
