"""Training data, samplers and RL rewards of the DeepSeekMath-V2 roles (docs/DESIGN.md §7).

Everything a model learns here is checked against the proof domain's rule
step checker (``opd.tasks.proof_task.check_proof``), the oracle.

**Proofs with known labels** (``proof_items``): each problem's reference
proof and ``corruptions`` corrupted copies (``proof_task.corrupt``, kinds
cycled: wrong_step, missing_step, wrong_final), each with its checker verdict.

**Cold-start SFT pairs** (user turn, assistant turn; the loss covers the
assistant turn only, ``grm.training.judgement_pair``):

  generator  ``generator_prompt(problem)`` → proof Y, ``Self-evaluation:``, Z,
             Y the reference or (share ``corrupt_fraction``) a corrupted
             proof, Z the checker's analysis of Y (``write_analysis``): the
             generator learns to grade its own proof honestly.
  refine     ``refine_prompt(problem, corrupted proof, its analysis)`` → the
             reference + its honest Z (``refine_pairs``): the prompt of
             sequential refinement, seen in training.
  verifier   ``verifier_prompt(problem, proof)`` → the checker's analysis.
  meta       ``meta_prompt(problem, proof, analysis)`` → ``write_meta``, the
             analysis written with ``noise`` (issues dropped, spurious ones
             added), so some stated issues are not real.

The models in the loop (verifier, meta-verifier) are ``GenerateFn``s,
prompts → texts (``grm.verify.sampling.sampler_fn``).

**RL rewards** (``reward_fn`` of ``opd.rl.train_grpo``, one ``Reward`` per
episode so the parts are logged as ``reward/components/*``):

  ``VerifierRLReward``   R_format · R_score(s', s) [· R_meta], s the
                         checker's score; R_meta = the meta-verifier's score
                         of the analysis (one sample; invalid → 0).
  ``GeneratorRLReward``  R_format(Y, Z) · (α R_Y + β R_score(s', R_Y) ·
                         R_meta(Z)); R_Y = the verifier's score of Y (one
                         sample; invalid → 0), R_meta(Z) = the meta-verifier's
                         score of Z as an analysis of Y.

A truncated rollout has format 0. The checker's score is logged beside
(``checker``) but never enters a reward.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from typing import Callable, Sequence

import numpy as np

from grm.training import train_judgement_sft
from grm.verify import rewards as rewards_lib
from grm.verify.format import (generator_prompt, meta_prompt, parse_analysis, parse_generation,
                               parse_meta, refine_prompt, split_generation, verifier_prompt,
                               write_analysis, write_generation, write_meta)
from opd.models import ModelConfig
from opd.rl import GRPOConfig, GRPOExtras, train_grpo
from opd.tasks import DIFFICULTIES, Example, Reward, get_task
from opd.tasks.proof_task import (CORRUPTIONS, Issue, ProofCheck, check_proof, corrupt,
                                  proof_lines, score_of)
from opd.training.loop_config import LoopConfig, RunIO, Runtime

__all__ = ["GENERATOR_DOMAIN", "VERIFIER_DOMAIN", "GeneratorRLReward", "ProofItem",
           "VerifierRLReward", "generator_examples", "generator_pairs", "meta_pairs",
           "proof_items", "proof_problems", "refine_pairs", "train_role_rl", "train_role_sft",
           "verifier_examples", "verifier_pairs"]

VERIFIER_DOMAIN = "proof_verifier"
GENERATOR_DOMAIN = "proof_generator"
GenerateFn = Callable[[Sequence[str]], Sequence[str]]


# ----------------------------------------------------------------------------- data
def proof_problems(split: str, n: int, *, difficulties: Sequence[int], seed: int) -> list[Example]:
  """``n`` proof-domain examples of ``split``, difficulties round-robin
  (distinct within a difficulty for the test split)."""
  if not difficulties or any(d not in DIFFICULTIES for d in difficulties):
    raise ValueError(f"difficulties={tuple(difficulties)!r} must be non-empty, drawn from "
                     f"{DIFFICULTIES}")
  task = get_task("proof")
  counts = [n // len(difficulties) + (i < n % len(difficulties)) for i in range(len(difficulties))]
  pools = [task.examples(split, c, seed=seed, difficulty=d, unique=split == "test")
           for d, c in zip(difficulties, counts)]
  return [ex for group in itertools.zip_longest(*pools) for ex in group if ex is not None]


@dataclasses.dataclass(frozen=True)
class ProofItem:
  """A proof of a problem with the checker's verdict (``source``: "reference"
  or the corruption's kind)."""
  example: Example
  proof: str
  check: ProofCheck
  source: str

  @property
  def problem(self) -> str:
    return self.example.prompt


def proof_items(examples: Sequence[Example], *, corruptions: int, seed: int) -> list[ProofItem]:
  """Each example's reference proof, then ``corruptions`` corrupted proofs
  (kinds cycled from the example's index; a kind the example does not admit
  is skipped), every one checked by ``check_proof``."""
  if isinstance(corruptions, bool) or not isinstance(corruptions, int) or corruptions < 0:
    raise ValueError(f"corruptions={corruptions!r} must be an int >= 0")
  out = []
  for e, ex in enumerate(examples):
    ref = ex.reference_text
    out.append(ProofItem(ex, ref, check_proof(ex, ref), "reference"))
    rng = random.Random(f"{seed}/{ex.id}")
    for j in range(corruptions):
      kind = CORRUPTIONS[(e + j) % len(CORRUPTIONS)]
      made = corrupt(ex, kind, rng)
      if made is not None:
        out.append(ProofItem(ex, made[0], check_proof(ex, made[0]), kind))
  return out


def _analysis(item: ProofItem, noise: float, rng: random.Random) -> str:
  return write_analysis(item.check, n_lines=max(1, len(proof_lines(item.proof))), noise=noise,
                        rng=rng)


def generator_pairs(items: Sequence[ProofItem], *, corrupt_fraction: float, seed: int
                    ) -> list[tuple[str, str]]:
  """Generator SFT pairs: every reference item, and each corrupted item with
  probability ``corrupt_fraction``, as (generator prompt, Y + honest Z)."""
  if not 0.0 <= corrupt_fraction <= 1.0:
    raise ValueError(f"corrupt_fraction={corrupt_fraction!r} must be in [0, 1]")
  rng = random.Random(seed)
  return [(generator_prompt(it.problem), write_generation(it.proof, write_analysis(it.check)))
          for it in items if it.source == "reference" or rng.random() < corrupt_fraction]


def refine_pairs(items: Sequence[ProofItem], *, fraction: float, seed: int
                 ) -> list[tuple[str, str]]:
  """Refinement SFT pairs for the generator: each corrupted item with probability
  ``fraction``, as (``refine_prompt(problem, corrupted proof, the checker's
  analysis of it)``, the reference proof + its honest self-evaluation). Without
  them the refinement prompt is one the generator never saw."""
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"fraction={fraction!r} must be in [0, 1]")
  rng = random.Random(seed)
  out = []
  for it in items:
    if it.source == "reference" or rng.random() >= fraction:
      continue
    ref = it.example.reference_text
    out.append((refine_prompt(it.problem, it.proof, write_analysis(it.check)),
                write_generation(ref, write_analysis(check_proof(it.example, ref)))))
  return out


def verifier_pairs(items: Sequence[ProofItem]) -> list[tuple[str, str]]:
  """Verifier SFT pairs: (verifier prompt, the checker's analysis)."""
  return [(verifier_prompt(it.problem, it.proof), write_analysis(it.check)) for it in items]


def meta_pairs(items: Sequence[ProofItem], *, noise: float, seed: int) -> list[tuple[str, str]]:
  """Meta-verifier SFT pairs: per item one analysis written with ``noise``
  and the rule meta-verification of it against the checker."""
  rng = random.Random(seed)
  out = []
  for it in items:
    text = _analysis(it, noise, rng)
    out.append((meta_prompt(it.problem, it.proof, text), write_meta(parse_analysis(text),
                                                                    it.check)))
  return out


def train_role_sft(model_cfg: ModelConfig, params, pairs, **kwargs):
  """SFT of one role on ``(user text, assistant text)`` pairs: the GRM's SFT
  (``grm.training.train_judgement_sft``; keyword arguments go there)."""
  return train_judgement_sft(model_cfg, params, pairs, **kwargs)


# ----------------------------------------------------------------------------- RL
def verifier_examples(items: Sequence[ProofItem]) -> list[Example]:
  """Verifier prompts as ``Example``s (domain ``VERIFIER_DOMAIN``) for
  ``train_grpo``; ``meta`` holds the problem, proof and checker verdict."""
  return [Example(domain=VERIFIER_DOMAIN, id=f"{it.example.id}-{k}", split=it.example.split,
                  difficulty=it.example.difficulty, prompt=verifier_prompt(it.problem, it.proof),
                  reference=(("assistant", write_analysis(it.check)),),
                  meta={"problem": it.problem, "proof": it.proof, "label": it.check.score,
                        "issues": [[i.line, i.kind] for i in it.check.issues]})
          for k, it in enumerate(items)]


def generator_examples(examples: Sequence[Example]) -> list[Example]:
  """Generator prompts as ``Example``s (domain ``GENERATOR_DOMAIN``); ``meta``
  keeps the proof example (for the logged checker score)."""
  return [Example(domain=GENERATOR_DOMAIN, id=ex.id, split=ex.split, difficulty=ex.difficulty,
                  prompt=generator_prompt(ex.prompt), reference=ex.reference,
                  meta={"problem": ex.prompt, "proof_example": ex.to_json()})
          for ex in examples]


def _check_of(meta) -> ProofCheck:
  issues = tuple(Issue(int(line), kind) for line, kind in meta["issues"])
  return ProofCheck(issues, score_of(issues))


def _meta_scores(meta_fn: GenerateFn, jobs: Sequence[tuple[str, str, str]]) -> np.ndarray:
  """``[J]`` the meta-verifier's score of each (problem, proof, analysis); invalid → 0."""
  if not jobs:
    return np.zeros(0)
  texts = list(meta_fn([meta_prompt(q, y, a) for q, y, a in jobs]))
  out = []
  for (_, _, a), text in zip(jobs, texts):
    meta = parse_meta(text, len(parse_analysis(a).issues))
    out.append(meta.score if meta.valid else 0.0)
  return np.asarray(out, np.float64)


def _reward(value: float, fmt: float, reason: str | None, **parts: float) -> Reward:
  comps = {k: float(v) for k, v in parts.items() if not math.isnan(v)}
  return Reward(float(np.clip(value, 0.0, 1.0)), fmt, comps,
                "ok" if reason is None else f"malformed:{reason}")


class VerifierRLReward:
  """``reward_fn`` of verifier GRPO: R_format · R_score [· R_meta] (module docstring).

  Args:
    meta_fn: the meta-verifier's ``GenerateFn``; None for R_format · R_score.

  Components: ``score`` (R_score), ``meta`` (R_meta, with ``meta_fn``),
  ``faithful`` (share of the analysis's stated issues the checker confirms;
  absent when it states none) and ``accurate`` (s' = s).
  """

  def __init__(self, meta_fn: GenerateFn | None = None):
    self.meta_fn = meta_fn

  def __call__(self, episodes) -> list[Reward]:
    analyses, labels, checks = [], [], []
    for ep in episodes:
      meta = ep.example.meta
      if "label" not in meta or "issues" not in meta:
        raise ValueError(f"episode example {ep.example.id!r} is not a verifier example "
                         "(meta needs 'label' and 'issues'; see verifier_examples)")
      text = "" if ep.truncated else (ep.turns[-1] if ep.turns else "")
      analyses.append((text, parse_analysis(text)))
      labels.append(float(meta["label"]))
      checks.append(_check_of(meta))
    fmt, pred = rewards_lib.analysis_arrays([a for _, a in analyses])
    r_meta = None
    if self.meta_fn is not None:
      idx = [b for b, (_, a) in enumerate(analyses) if a.valid]
      r_meta = np.zeros(len(episodes))
      r_meta[idx] = _meta_scores(self.meta_fn, [
          (episodes[b].example.meta["problem"], episodes[b].example.meta["proof"],
           analyses[b][0]) for b in idx])
    total = rewards_lib.verifier_reward(fmt, pred, labels, r_meta)
    out = []
    for b, (_, a) in enumerate(analyses):
      faithful, _ = rewards_lib.faithfulness([a], [checks[b]])
      parts = {"score": float(1.0 - abs(pred[b] - labels[b])) if a.valid else 0.0,
               "faithful": faithful, "accurate": float(a.valid and a.score == labels[b])}
      if r_meta is not None:
        parts["meta"] = float(r_meta[b])
      out.append(_reward(total[b], float(fmt[b]), a.reason, **parts))
    return out


class GeneratorRLReward:
  """``reward_fn`` of generator GRPO with self-verification (module docstring).

  Args:
    verify_fn, meta_fn: the verifier's and meta-verifier's ``GenerateFn``s.
    alpha, beta: the weights of R_Y and R_Z.

  Components: ``r_y``, ``self_match`` (R_score(s', R_Y)), ``meta_z`` and
  ``checker`` (the rule checker's score of Y; logged, not rewarded).
  """

  def __init__(self, verify_fn: GenerateFn, meta_fn: GenerateFn, *,
               alpha: float = rewards_lib.ALPHA, beta: float = rewards_lib.BETA):
    self.verify_fn, self.meta_fn = verify_fn, meta_fn
    self.reward = rewards_lib.GeneratorReward(alpha, beta)

  def __call__(self, episodes) -> list[Reward]:
    gens, examples = [], []
    for ep in episodes:
      if "proof_example" not in ep.example.meta:
        raise ValueError(f"episode example {ep.example.id!r} is not a generator example "
                         "(see generator_examples)")
      text = "" if ep.truncated else (ep.turns[-1] if ep.turns else "")
      gens.append((text, parse_generation(text)))
      examples.append(_example_from_json(ep.example.meta["proof_example"]))
    idx = [b for b, (_, g) in enumerate(gens) if g.valid]
    r_y, meta_z = np.zeros(len(episodes)), np.zeros(len(episodes))
    if idx:
      problems = [examples[b].prompt for b in idx]
      proofs = [gens[b][1].proof for b in idx]
      verdicts = [parse_analysis(t) for t in self.verify_fn(
          [verifier_prompt(q, y) for q, y in zip(problems, proofs)])]
      r_y[idx] = [a.score if a.valid else 0.0 for a in verdicts]
      meta_z[idx] = _meta_scores(self.meta_fn, [
          (q, y, split_generation(gens[b][0])[1]) for q, y, b in zip(problems, proofs, idx)])
    total = rewards_lib.generator_reward_from_parsed([g for _, g in gens], r_y, meta_z,
                                                     reward=self.reward)
    out = []
    for b, (text, g) in enumerate(gens):
      self_match = 1.0 - abs(g.analysis.score - r_y[b]) if g.valid else 0.0
      checker = check_proof(examples[b], split_generation(text)[0]).score
      out.append(_reward(total[b], float(g.valid), g.reason, r_y=r_y[b], self_match=self_match,
                         meta_z=meta_z[b], checker=checker))
    return out


def _example_from_json(text: str) -> Example:
  d = json.loads(text)
  return Example(**{**d, "reference": tuple(tuple(t) for t in d["reference"])})


def train_role_rl(model_cfg: ModelConfig, params, examples: Sequence[Example], cfg: GRPOConfig,
                  optim, reward_fn, loop: LoopConfig, io: RunIO | None = None, *,
                  runtime: Runtime):
  """GRPO of one role from ``params`` (also the KL reference) with ``reward_fn``
  (``loop``, ``io``, ``runtime``: as ``opd.rl.train_grpo``'s)."""
  return train_grpo(model_cfg, params, params, examples, cfg, optim, loop, io, runtime=runtime,
                    extras=GRPOExtras(reward_fn=reward_fn))
