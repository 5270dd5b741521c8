"""Cold start (docs/DESIGN.md §3): SFT data for the student from verified teacher rollouts.

Each specialist teacher answers the prompts of its domain (a teacher without
a domain answers every prompt) with the sampler of ``opd.rollout``; the task
verifiers score the answers and only the verified-correct ones (reward >=
``min_reward``, not truncated) are kept. Each kept episode becomes an SFT
pair exactly as the teacher generated it::

    ids        [n]  prompt_ids + response_ids
    loss_mask  [n]  1 on the teacher's sampled tokens (policy_mask), 0 on the
                    prompt and on tool turns

which ``opd.training.data.sft_dataset`` (the SFT objective's batches, as
``opd.training.sft.sft_batches`` builds them) consumes. Rejections are
counted per teacher and per reason.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from opd import rollout as rollout_lib
from opd.distill.teachers import Teacher
from opd.tasks import ALL_DOMAINS, Example, RewardStats

__all__ = ["AnswerSampling", "ColdStartData", "teacher_sft_pairs"]


@dataclasses.dataclass(frozen=True)
class AnswerSampling:
  """How each teacher answers its prompts, and which answers are kept.

  Attributes:
    max_new_tokens, temperature: sampling (per assistant turn).
    samples_per_prompt: answers each teacher samples per prompt.
    min_reward: the verifier reward an answer needs to be kept (1.0: fully
      correct).
    batch_size: sampler rows per call (``rollout(chunked=True)``).
  """
  max_new_tokens: int
  temperature: float = 1.0
  samples_per_prompt: int = 1
  min_reward: float = 1.0
  batch_size: int = 16

  def __post_init__(self):
    if not (0.0 <= self.min_reward <= 1.0):
      raise ValueError(f"min_reward={self.min_reward!r} must be in [0, 1]")
    if not isinstance(self.samples_per_prompt, int) or self.samples_per_prompt < 1:
      raise ValueError(f"samples_per_prompt={self.samples_per_prompt!r} must be a positive int")


class ColdStartData(NamedTuple):
  """What ``teacher_sft_pairs`` returns.

  Attributes:
    pairs: ``(ids [n] int32, loss_mask [n] bool)`` per kept answer.
    metrics: ``cold_start/<teacher>/{answered,kept,rejected}``,
      ``cold_start/rejected/<reason category>`` and ``cold_start/{kept,rejected}``.
    episodes: the kept episodes (for inspection).
  """
  pairs: list[tuple[np.ndarray, np.ndarray]]
  metrics: dict[str, float]
  episodes: list


def _answerer(teachers: Sequence[Teacher], ex: Example) -> list[Teacher]:
  own = [t for t in teachers if t.domain == ex.domain]
  return own or [t for t in teachers if t.domain is None]


def teacher_sft_pairs(teachers: Sequence[Teacher], prompts: Sequence[Example],
                      answers: AnswerSampling, *, tokenizer, seed: int = 0, mesh=None,
                      rules=None, task_kwargs: Mapping[str, Mapping[str, Any]] | None = None
                      ) -> ColdStartData:
  """Teacher answers to their domains' prompts, verified; the correct ones as SFT pairs.

  Args:
    teachers: the specialists (``Teacher``s; their params are used as is).
    prompts: task ``Example``s; each goes to the teachers of its domain.
    answers: how the teachers sample and which answers are kept.
    tokenizer: the byte tokenizer shared by teachers and student.
    seed: teacher k samples with key ``seed + k``.
    mesh, rules, task_kwargs: passed to ``opd.rollout.rollout``.

  Raises:
    ValueError: no teachers, a prompt of a domain without a verifier, or a
      prompt no teacher answers (naming its domain and the teachers' domains).
  """
  teachers = list(teachers)
  if not teachers:
    raise ValueError("teachers=[]: the cold start needs at least one teacher")
  if not isinstance(answers, AnswerSampling):
    raise ValueError(f"answers must be an AnswerSampling, got {type(answers).__name__}")
  todo: dict[str, list[Example]] = {t.name: [] for t in teachers}
  for ex in prompts:
    if ex.domain not in ALL_DOMAINS:
      raise ValueError(f"prompt {ex.id!r} has domain={ex.domain!r}, which has no verifier "
                       f"(domains: {ALL_DOMAINS})")
    who = _answerer(teachers, ex)
    if not who:
      raise ValueError(f"prompt {ex.id!r} of domain={ex.domain!r} has no teacher; teacher "
                       f"domains: {[t.domain for t in teachers]}")
    for t in who:
      todo[t.name] += [ex] * answers.samples_per_prompt
  sampling = rollout_lib.sampling_for_chat(tokenizer, max_new_tokens=answers.max_new_tokens,
                                           temperature=answers.temperature)
  pairs, kept_eps, metrics = [], [], {}
  reasons: collections.Counter = collections.Counter()
  for k, t in enumerate(teachers):
    if not todo[t.name]:
      continue
    policy = rollout_lib.Policy(t.cfg, t.params, tokenizer, mesh, rules)
    episodes = rollout_lib.rollout(policy, todo[t.name], seed + k, sampling,
                                   log=rollout_lib.RolloutLog(stats=RewardStats()),
                                   batch_size=answers.batch_size, chunked=True,
                                   task_kwargs=task_kwargs)
    kept = 0
    for ep in episodes:
      if ep.reward is not None and ep.reward.reward >= answers.min_reward and not ep.truncated:
        ids = np.concatenate([ep.prompt_ids, ep.response_ids]).astype(np.int32)
        mask = np.concatenate([np.zeros(len(ep.prompt_ids), bool), ep.policy_mask])
        pairs.append((ids, mask))
        kept_eps.append(ep)
        kept += 1
      else:
        why = "truncated" if ep.truncated else (ep.reward.reason if ep.reward else "unscored")
        reasons[why.split(":")[0]] += 1
    metrics.update({f"cold_start/{t.name}/answered": float(len(episodes)),
                    f"cold_start/{t.name}/kept": float(kept),
                    f"cold_start/{t.name}/rejected": float(len(episodes) - kept)})
  metrics.update({f"cold_start/rejected/{r}": float(n) for r, n in sorted(reasons.items())})
  metrics["cold_start/kept"] = float(len(pairs))
  metrics["cold_start/rejected"] = float(sum(reasons.values()))
  return ColdStartData(pairs, metrics, kept_eps)
