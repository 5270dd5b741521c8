"""Rollouts: a model answers task prompts; episodes come back as token ids.

The one place where the sampler, the tokenizer, the chat format and the task
verifiers meet. GRPO, evaluation and on-policy distillation all consume the
``Episode``s made here:

  prompt_ids    [P]  BOS + the rendered prompt + ``<|assistant|>``
  response_ids  [N]  everything after the prompt. Single-turn: the sampled
                     completion, ending with ``<|end|>`` when it finished.
                     Multi-turn: assistant turns interleaved with the tool
                     turns the environment fed back.
  policy_mask   [N]  True where the policy sampled the token (trainable);
                     False on tool results and on the role headers between
                     turns.
  logprobs      [N]  the sampler's ``log_softmax(logits / T)`` at policy
                     tokens, 0 elsewhere (GRPO's ``logp_old``).

Single-turn and multi-turn is a property of the task (``Task.multi_turn``):
single-turn examples are sampled in one call and verified, each distinct
(example, response) once; multi-turn examples run in their task's
environment (``opd.rollout.agent``). ``Episode``, ``Policy`` and the one
sampler call ``sample`` live below both, in ``opd.rollout.policy``.

Shapes stay static for ``jit``: prompts are left-padded to a multiple of
``prompt_bucket`` and the batch is padded to a fixed number of rows, so an
agent episode whose active set shrinks does not recompile the sampler. With
``chunked=True`` any number of examples runs in fixed-size chunks (the
evaluation harness): every sampler call has exactly ``batch_size`` rows and
all single-turn prompts share one padded length.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from opd import tasks as tasks_lib
from opd.rollout import agent
from opd.rollout import policy as policy_lib
from opd.rollout.policy import Completion, Episode, Policy, prompt_ids, sampling_for_chat
from opd.rollout.sampler import SamplingConfig
from opd.tasks import AgentRewardConfig, AgentTask, Example, Reward, RewardStats, Task

# Where the episode types are used with rollouts; defined in opd.rollout.policy.
__all__ = ["Completion", "Episode", "Policy", "RolloutLog", "batch_episodes", "prompt_ids",
           "rollout", "sampling_for_chat", "with_agent_config"]


@dataclasses.dataclass
class RolloutLog:
  """What ``rollout`` accumulates over calls; the caller reads it back.

  Attributes:
    stats: counts every episode's reward reason (None: not counted).
    verify_cache: (example id, response) -> Reward, read and extended, so
      repeated calls verify each distinct pair once.
    timings: seconds under "generate" (sampling and environment steps) and
      "verify", added to.
  """
  stats: RewardStats | None = None
  verify_cache: dict[tuple[str, str], Reward] = dataclasses.field(default_factory=dict)
  timings: dict[str, float] = dataclasses.field(default_factory=dict)


def with_agent_config(task_kwargs: Mapping[str, Mapping[str, Any]] | None,
                      agent_config: AgentRewardConfig | None) -> dict[str, dict[str, Any]]:
  """``task_kwargs`` (domain -> task constructor arguments) with the agent
  task's reward weights added as ``{"agent": {"config": agent_config}}``.

  Raises:
    ValueError: ``task_kwargs`` already sets the agent task's ``config``.
  """
  kwargs = {d: dict(v) for d, v in (task_kwargs or {}).items()}
  if agent_config is not None:
    own = kwargs.setdefault(AgentTask.domain, {})
    if "config" in own:
      raise ValueError(f"agent_config and task_kwargs[{AgentTask.domain!r}]['config'] are both "
                       "set; pass one")
    own["config"] = agent_config
  return kwargs


def rollout(policy: Policy, examples: Sequence[Example], rng, sampling: SamplingConfig, *,
            log: RolloutLog | None = None,
            task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
            prompt_bucket: int = 32, batch_size: int | None = None, chunked: bool = False,
            verify: bool = True) -> list[Episode]:
  """One episode per example (repeat examples for groups), verified.

  Args:
    policy: the model that samples (``Policy``; its mesh and rules go to the
      sampler).
    examples: any mix of domains; multi-turn tasks run in their environment.
    rng: int seed or key. Unchunked, the single-turn call and the multi-turn
      loop use the two halves of ``jax.random.split(rng)``; chunked, chunk c
      (single-turn chunks first, then multi-turn ones) uses
      ``jax.random.fold_in(rng, c)``.
    sampling: a ``SamplingConfig`` (``sampling_for_chat``).
    log: reward counts, the verification cache and timings carried over
      calls (``RolloutLog``; None: a fresh one, dropped).
    task_kwargs: domain -> task constructor arguments (e.g. the code sandbox,
      the agent's reward weights: ``with_agent_config``).
    prompt_bucket: prompts are left-padded to a multiple of this.
    batch_size: sampler rows per call (padded), so calls with fewer
      examples reuse the compile. Unchunked it must hold all single-turn
      examples (default: their number).
    chunked: run single-turn examples in chunks of exactly ``batch_size``
      rows, all at the padded length of the longest single-turn prompt, and
      multi-turn examples in chunks of ``batch_size`` episodes (a short chunk
      is padded with copies of its first example, then dropped).
    verify: False skips single-turn verification (``reward`` stays None).

  Verifier crashes score 0 with a counted reason, never raise.
  """
  if chunked and (batch_size is None or batch_size < 1):
    raise ValueError(f"rollout(chunked=True) needs batch_size >= 1, got {batch_size!r}")
  log = log if log is not None else RolloutLog()
  stats, timings = log.stats, log.timings
  tasks = _tasks(examples, task_kwargs, verify)
  is_multi = [e.domain in tasks and tasks[e.domain].multi_turn for e in examples]
  single = [i for i, m in enumerate(is_multi) if not m]
  multi = [i for i, m in enumerate(is_multi) if m]
  key = policy_lib.as_key(rng)
  prompts = {}
  for i in single:
    if examples[i].id not in prompts:
      prompts[examples[i].id] = policy_lib.prompt_ids(policy.tokenizer, examples[i])
  if chunked:
    single_chunks = [single[c:c + batch_size] for c in range(0, len(single), batch_size)]
    multi_chunks = [multi[c:c + batch_size] for c in range(0, len(multi), batch_size)]
    keys = [jax.random.fold_in(key, c) for c in range(len(single_chunks) + len(multi_chunks))]
    single_keys, multi_keys = keys[:len(single_chunks)], keys[len(single_chunks):]
    longest = max((len(p) for p in prompts.values()), default=1)
    single_bucket = prompt_bucket * math.ceil(longest / prompt_bucket)
  else:
    single_chunks, multi_chunks = [single] if single else [], [multi] if multi else []
    key_single, key_multi = jax.random.split(key)
    single_keys, multi_keys, single_bucket = [key_single], [key_multi], prompt_bucket
  episodes: list[Episode | None] = [None] * len(examples)
  for idx, k in zip(single_chunks, single_keys):
    t0 = time.perf_counter()
    comps = policy_lib.sample(policy, [prompts[examples[i].id] for i in idx], k, sampling,
                              batch_size=batch_size, prompt_bucket=single_bucket)
    timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - t0
    for i, c in zip(idx, comps):
      episodes[i] = Episode(examples[i], prompts[examples[i].id], c.ids,
                            np.ones(len(c.ids), bool), c.logprobs, [c.text], not c.finished)
  if verify and single:
    t0 = time.perf_counter()
    _verify([episodes[i] for i in single], tasks, log.verify_cache, stats)
    timings["verify"] = timings.get("verify", 0.0) + time.perf_counter() - t0
  for idx, k in zip(multi_chunks, multi_keys):
    chunk = [examples[i] for i in idx]
    if chunked:
      chunk += [chunk[0]] * (batch_size - len(chunk))
    t0 = time.perf_counter()
    eps = agent.rollout_multi_turn(policy, chunk, k, sampling, tasks=tasks,
                                   prompt_bucket=prompt_bucket, batch_size=batch_size)
    timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - t0
    for i, ep in zip(idx, eps):
      episodes[i] = ep
      if stats is not None:
        stats.add(ep.reward)
  return episodes  # type: ignore[return-value]


def _tasks(examples: Sequence[Example], task_kwargs, verify: bool) -> dict[str, Task]:
  """Domain -> task for the domains of ``examples`` that need one: multi-turn
  domains always, single-turn ones when verifying. Unknown domains (custom
  prompts scored by the caller) are single-turn and need ``verify=False``."""
  kwargs = task_kwargs or {}
  tasks = {}
  for domain in dict.fromkeys(e.domain for e in examples):
    if domain in tasks_lib.ALL_DOMAINS and (verify or tasks_lib.is_multi_turn(domain)):
      tasks[domain] = tasks_lib.get_task(domain, **kwargs.get(domain, {}))
    elif verify:
      tasks_lib.get_task(domain)  # raises: unknown domain
  return tasks


def _verify(episodes: Sequence[Episode], tasks: Mapping[str, Task],
            cache: dict[tuple[str, str], Reward], stats: RewardStats | None) -> None:
  """Sets ``ep.reward`` of single-turn episodes. A group of samples often
  repeats itself: each distinct (example, response) is verified once (code
  responses each cost a sandbox run), and ``cache`` carries over calls."""
  todo: dict[str, dict[tuple[str, str], Example]] = {}
  for ep in episodes:
    k = (ep.example.id, ep.turns[0])
    if k not in cache:
      todo.setdefault(ep.example.domain, {})[k] = ep.example
  for domain, pairs in todo.items():
    got = tasks_lib.safe_verify_batch(tasks[domain], list(pairs.values()),
                                      [text for _, text in pairs])
    cache.update(zip(pairs, got))
  for ep in episodes:
    ep.reward = cache[ep.example.id, ep.turns[0]]
    if stats is not None:
      stats.add(ep.reward)


def batch_episodes(episodes: Sequence[Episode], *, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """Right-padded training arrays for a list of episodes.

  Returns ``tokens [B, L]`` (prompt + response), ``targets [B, L]`` (next
  token), ``mask [B, L]`` (real tokens), ``loss_mask [B, L]`` (1 where the
  target is a policy token), ``old_logprobs [B, L]`` (aligned with targets),
  with ``L = seq_len``. Episodes longer than ``seq_len + 1`` raise.
  """
  B, L = len(episodes), seq_len
  tokens = np.full((B, L), pad_id, np.int32)
  targets = np.full((B, L), pad_id, np.int32)
  mask = np.zeros((B, L), bool)
  loss_mask = np.zeros((B, L), np.float32)
  old = np.zeros((B, L), np.float32)
  for b, ep in enumerate(episodes):
    seq = np.concatenate([ep.prompt_ids, ep.response_ids])
    n = len(seq) - 1
    if n > L:
      raise ValueError(f"episode {b} ({ep.example.id}) has {len(seq)} tokens; seq_len={L} "
                       f"holds at most {L + 1}")
    P = len(ep.prompt_ids)
    tokens[b, :n], targets[b, :n], mask[b, :n] = seq[:-1], seq[1:], True
    # target index t predicts seq[t+1]; response token r sits at seq[P + r].
    loss_mask[b, P - 1:P - 1 + len(ep.response_ids)] = ep.policy_mask
    old[b, P - 1:P - 1 + len(ep.response_ids)] = np.where(ep.policy_mask, ep.logprobs, 0.0)
  return {"tokens": tokens, "targets": targets, "mask": mask, "loss_mask": loss_mask,
          "old_logprobs": old}
