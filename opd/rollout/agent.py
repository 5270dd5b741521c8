"""Multi-turn episodes: the policy and a task's environment take turns (docs/DESIGN.md §8).

A task with ``multi_turn=True`` supplies an environment (``Task.make_env``,
e.g. ``opd.tasks.AgentEnv``). Each round samples the next assistant turn of
every unfinished episode in one sampler call, steps each environment, and
appends its reply as non-policy tokens::

  <|tool|><tool_result>REPLY</tool_result><|end|><|assistant|>

An episode ends when its environment says so (answer, malformed turn, turn
limit) or when a turn reaches ``max_new_tokens`` without closing (truncated:
judged as written, scored on the turns so far). The sampler batch keeps the
size it started with while the active set shrinks, so no round recompiles.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np

from opd import tasks as tasks_lib
from opd.rollout import policy as policy_lib
from opd.rollout.policy import Episode, Policy
from opd.rollout.sampler import SamplingConfig
from opd.tasks import Example, Reward, RewardStats, Task
from opd.text.tokenizers import ASSISTANT, END, TOOL, TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN


def rollout_multi_turn(policy: Policy, examples: Sequence[Example], rng, sampling: SamplingConfig,
                       *, tasks: Mapping[str, Task] | None = None,
                       stats: RewardStats | None = None, prompt_bucket: int = 32,
                       batch_size: int | None = None) -> list[Episode]:
  """Batched multi-turn episodes, one per example, each with its reward.

  Args:
    policy: the model that samples (its mesh and rules go to the sampler).
    examples: examples of multi-turn tasks.
    rng: int seed or key; round r samples with the r-th ``jax.random.split``.
    sampling: per-turn sampling (``max_new_tokens`` is per assistant turn).
    tasks: domain -> task whose ``make_env`` runs the episodes (default
      ``opd.tasks.get_task(domain)``).
    stats: counts the rewards' reasons.
    prompt_bucket: contexts are left-padded to a multiple of this.
    batch_size: sampler rows per round (default ``len(examples)``).

  Returns:
    Episodes in the order of ``examples``; ``turns`` holds the assistant
    turns' texts. A crashing reward scores 0 with a ``verifier_error`` reason.
  """
  tasks = dict(tasks or {})
  envs = []
  for ex in examples:
    if ex.domain not in tasks:
      tasks[ex.domain] = tasks_lib.get_task(ex.domain)
    envs.append(tasks[ex.domain].make_env())
    envs[-1].reset(ex)
  tokenizer = policy.tokenizer
  prompts = [policy_lib.prompt_ids(tokenizer, ex) for ex in examples]
  # (ids, logprobs, is_policy) pieces after the prompt, per episode.
  pieces: list[list[tuple[np.ndarray, np.ndarray, bool]]] = [[] for _ in examples]
  turns: list[list[str]] = [[] for _ in examples]
  truncated = [False] * len(examples)
  active = list(range(len(examples)))
  key = policy_lib.as_key(rng)
  while active:
    key, sub = jax.random.split(key)
    contexts = [np.concatenate([prompts[i]] + [p[0] for p in pieces[i]]) for i in active]
    comps = policy_lib.sample(policy, contexts, sub, sampling,
                              batch_size=batch_size or len(examples), prompt_bucket=prompt_bucket)
    still = []
    for i, c in zip(active, comps):
      pieces[i].append((c.ids, c.logprobs, True))
      turns[i].append(c.text)
      result, done, _ = envs[i].step(c.text)
      if not c.finished:
        truncated[i] = True  # out of tokens mid-turn: judged as written, episode over
        continue
      if done:
        continue
      feedback = (f"{TOOL}{TOOL_RESULT_OPEN}{result if result is not None else ''}"
                  f"{TOOL_RESULT_CLOSE}{END}{ASSISTANT}")
      fb_ids = np.asarray(tokenizer.encode(feedback), np.int32)
      pieces[i].append((fb_ids, np.zeros(len(fb_ids), np.float32), False))
      still.append(i)
    active = still
  out = []
  for i, ex in enumerate(examples):
    ids = np.concatenate([p[0] for p in pieces[i]]).astype(np.int32)
    logps = np.concatenate([p[1] for p in pieces[i]]).astype(np.float32)
    policy_mask = np.concatenate([np.full(len(p[0]), p[2], bool) for p in pieces[i]])
    try:
      reward = envs[i].reward()
    except Exception as e:  # noqa: BLE001 - count, score 0, never crash a trainer
      reward = Reward(0.0, 0.0, {}, f"verifier_error:{type(e).__name__}: {e}"[:300])
    if stats is not None:
      stats.add(reward)
    out.append(Episode(ex, prompts[i], ids, policy_mask, logps, turns[i], truncated[i], reward))
  return out
