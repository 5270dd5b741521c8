"""Sequential refinement with self-verification (docs/DESIGN.md §7).

Round 0 asks the generator for a proof and its self-evaluation
(``generator_prompt``); each later round shows it the previous proof and
self-evaluation (``refine_prompt``) and asks again. A problem stops at the
first round whose output parses (``Generation.valid``) with self-score 1, or
after ``max_rounds`` refinements. Every round is one batched
``generate_fn(prompts) -> texts`` call over the problems still running.

A round whose output does not parse keeps the problem running; its proof
(or, with no proof part, the whole text) and its self-evaluation text (or
"") go into the next refinement prompt.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import tqdm

from grm.verify.format import (Generation, generator_prompt, parse_generation, refine_prompt,
                               split_generation)

GenerateFn = Callable[[Sequence[str]], Sequence[str]]


@dataclasses.dataclass(frozen=True)
class Refinement:
  """Per-problem record of a refinement run.

  Attributes:
    proofs: ``[P][r_p + 1]`` the proof of each round the problem ran
      (round 0 = the first generation).
    generations: ``[P][r_p + 1]`` the parsed outputs.
    stopped: ``[P]`` the round r_p at which each problem stopped: its first
      round with a valid self-score of 1, else ``max_rounds``.
    converged: ``[P]`` whether it stopped on a self-score of 1.
  """
  proofs: list[list[str]]
  generations: list[list[Generation]]
  stopped: list[int]
  converged: list[bool]

  def proof_at(self, p: int, rounds: int) -> str:
    """Problem p's proof after ``rounds`` refinement rounds (its last one if it stopped earlier)."""
    if rounds < 0:
      raise ValueError(f"rounds={rounds} must be >= 0")
    return self.proofs[p][min(rounds, len(self.proofs[p]) - 1)]


def refine(problems: Sequence[str], generate_fn: GenerateFn, *, max_rounds: int,
           progress: bool = False) -> Refinement:
  """Generate, self-verify and refine each problem until its self-score is 1.

  Args:
    problems: ``[P]`` problem texts.
    generate_fn: batched generator, prompts -> texts (generator grammar).
    max_rounds: refinement rounds after the first generation (>= 0).

  Returns:
    A ``Refinement``.
  """
  if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
    raise ValueError(f"max_rounds={max_rounds!r} must be an int >= 0")
  P = len(problems)
  proofs: list[list[str]] = [[] for _ in range(P)]
  gens: list[list[Generation]] = [[] for _ in range(P)]
  last: list[tuple[str, str]] = [("", "")] * P
  active, stopped, converged = list(range(P)), [max_rounds] * P, [False] * P
  for r in tqdm.trange(max_rounds + 1, desc="refine", disable=not progress):
    if not active:
      break
    prompts = [generator_prompt(problems[p]) if r == 0 else refine_prompt(problems[p], *last[p])
               for p in active]
    texts = list(generate_fn(prompts))
    if len(texts) != len(prompts):
      raise ValueError(f"generate_fn returned {len(texts)} texts for {len(prompts)} prompts")
    still = []
    for p, text in zip(active, texts):
      gen = parse_generation(text)
      last[p] = split_generation(text)
      proofs[p].append(last[p][0])
      gens[p].append(gen)
      if gen.valid and gen.analysis.score == 1.0:
        stopped[p], converged[p] = r, True
      else:
        still.append(p)
    active = still
  return Refinement(proofs, gens, stopped, converged)
