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
environment (``opd.rollout.agent``).

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
from opd.models import ModelConfig
from opd.parallel import sharding as shd
from opd.rollout.constraint import TokenAutomaton
from opd.rollout.sampler import SamplingConfig, generate
from opd.tasks import AgentRewardConfig, AgentTask, Example, Reward, RewardStats, Task
from opd.text.tokenizers import END, EOS


@dataclasses.dataclass
class Episode:
  """One rollout of one example (see the module docstring for the arrays)."""
  example: Example
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  policy_mask: np.ndarray
  logprobs: np.ndarray
  turns: list[str]
  truncated: bool
  reward: Reward | None = None

  @property
  def num_policy_tokens(self) -> int:
    return int(self.policy_mask.sum())


def sampling_for_chat(tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                      top_k: int = 0, top_p: float = 1.0) -> SamplingConfig:
  """A ``SamplingConfig`` that ends a turn at ``<|end|>`` or EOS."""
  return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, eos_ids=(tokenizer.token_to_id(EOS),),
                        stop_ids=(tokenizer.token_to_id(END),), pad_id=tokenizer.pad_id)


def prompt_ids(tokenizer, example: Example) -> np.ndarray:
  """``[P]`` ids of BOS + the example's prompt + the opened assistant turn."""
  text = tasks_lib.render_messages(example.prompt_messages(), add_generation_prompt=True)
  return np.asarray(tokenizer.encode(text, add_bos=True), np.int32)


@dataclasses.dataclass(frozen=True)
class Completion:
  ids: np.ndarray        # [n] sampled ids, the ending <|end|>/EOS included when finished
  logprobs: np.ndarray   # [n]
  finished: bool
  text: str              # decoded, without the ending stop token


def sample(model_cfg: ModelConfig, params, tokenizer, prompts: Sequence[np.ndarray], rng,
           sampling: SamplingConfig, *, batch_size: int | None = None, prompt_bucket: int = 32,
           mesh=None, rules=None, constraint: TokenAutomaton | None = None,
           patterns: Sequence[int] | None = None) -> list[Completion]:
  """Samples one completion per prompt (lists of ids of any lengths).

  Prompts are left-padded to a multiple of ``prompt_bucket`` and the batch
  is padded to ``batch_size`` rows by repeating the first prompt, so repeated
  calls reuse one compiled sampler. ``batch_size`` defaults to
  ``len(prompts)`` rounded up to a multiple of the mesh's batch shards; an
  explicit one must be such a multiple (ValueError naming it otherwise).
  ``constraint``: constrained decoding, prompt i following pattern
  ``patterns[i]`` of the automaton (None: pattern 0 for every prompt).
  """
  if not prompts:
    return []
  if model_cfg.vocab_size > tokenizer.vocab_size:
    raise ValueError(
        f"model vocab_size={model_cfg.vocab_size} exceeds the tokenizer's "
        f"{tokenizer.vocab_size} ids: the sampler could emit ids the tokenizer cannot "
        "decode; use vocab_size equal to the tokenizer's")
  if prompt_bucket < 1:
    raise ValueError(f"prompt_bucket must be >= 1, got {prompt_bucket!r}")
  if mesh is None:
    B = batch_size or len(prompts)
  elif batch_size:
    B = batch_size
    shd.check_batch_divisible(B, mesh, rules or shd.DEFAULT_RULES, field="batch_size")
  else:
    shards = shd.batch_shards(mesh, rules or shd.DEFAULT_RULES)
    B = shards * math.ceil(len(prompts) / shards)
  if len(prompts) > B:
    raise ValueError(f"got {len(prompts)} prompts for batch_size={B}")
  longest = max(len(p) for p in prompts)
  if longest + sampling.max_new_tokens > 1 << 20 or min(len(p) for p in prompts) == 0:
    raise ValueError(f"prompt lengths must be in [1, 2^20), got {[len(p) for p in prompts]}")
  P = prompt_bucket * math.ceil(longest / prompt_bucket)
  tokens = np.full((B, P), tokenizer.pad_id, np.int32)
  mask = np.zeros((B, P), bool)
  for i in range(B):
    p = prompts[i] if i < len(prompts) else prompts[0]
    tokens[i, P - len(p):], mask[i, P - len(p):] = p, True
  rows = None
  if constraint is not None:
    which = [0] * len(prompts) if patterns is None else list(patterns)
    if len(which) != len(prompts):
      raise ValueError(f"patterns has {len(which)} entries for {len(prompts)} prompts")
    rows = constraint.rows(which + [which[0]] * (B - len(prompts)))
  elif patterns is not None:
    raise ValueError("patterns given without a constraint")
  out = generate(model_cfg, params, tokens, mask, rng, sampling, mesh=mesh, rules=rules,
                 constraint=rows)
  ids, lengths, logps, finished = jax.device_get((out.tokens, out.lengths, out.logprobs,
                                                  out.finished))
  completions = []
  for i in range(len(prompts)):
    n = int(lengths[i])
    row = np.asarray(ids[i, :n], np.int32)
    text_ids = row[:-1] if finished[i] else row
    completions.append(Completion(row, np.asarray(logps[i, :n], np.float32), bool(finished[i]),
                                  tokenizer.decode(text_ids)))
  return completions


def as_key(rng):
  """``rng`` as a ``jax.random`` key (ints are seeds)."""
  if isinstance(rng, (int, np.integer)):
    return jax.random.key(int(rng))
  return rng


def rollout(model_cfg: ModelConfig, params, tokenizer, examples: Sequence[Example], rng,
            sampling: SamplingConfig, *, stats: RewardStats | None = None,
            agent_config: AgentRewardConfig | None = None,
            task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
            prompt_bucket: int = 32, batch_size: int | None = None, chunked: bool = False,
            verify_cache: dict[tuple[str, str], Reward] | None = None,
            timings: dict[str, float] | None = None, mesh=None, rules=None,
            verify: bool = True) -> list[Episode]:
  """One episode per example (repeat examples for groups), verified.

  Args:
    model_cfg, params, tokenizer: the policy.
    examples: any mix of domains; multi-turn tasks run in their environment.
    rng: int seed or key. Unchunked, the single-turn call and the multi-turn
      loop use the two halves of ``jax.random.split(rng)``; chunked, chunk c
      (single-turn chunks first, then multi-turn ones) uses
      ``jax.random.fold_in(rng, c)``.
    sampling: a ``SamplingConfig`` (``sampling_for_chat``).
    stats: counts every episode's reward reason.
    agent_config: reward weights of the agent task (shorthand for
      ``task_kwargs={"agent": {"config": agent_config}}``).
    task_kwargs: domain -> task constructor arguments (e.g. the code sandbox).
    prompt_bucket: prompts are left-padded to a multiple of this.
    batch_size: sampler rows per call (padded), so calls with fewer
      examples reuse the compile. Unchunked it must hold all single-turn
      examples (default: their number).
    chunked: run single-turn examples in chunks of exactly ``batch_size``
      rows, all at the padded length of the longest single-turn prompt, and
      multi-turn examples in chunks of ``batch_size`` episodes (a short chunk
      is padded with copies of its first example, then dropped).
    verify_cache: (example id, response) -> Reward, read and extended, so
      repeated calls verify each distinct pair once.
    timings: accumulates seconds under "generate" (sampling and environment
      steps) and "verify".
    mesh, rules: passed to the sampler.
    verify: False skips single-turn verification (``reward`` stays None).

  Verifier crashes score 0 with a counted reason, never raise.
  """
  if chunked and (batch_size is None or batch_size < 1):
    raise ValueError(f"rollout(chunked=True) needs batch_size >= 1, got {batch_size!r}")
  tasks = _tasks(examples, task_kwargs, agent_config, verify)
  is_multi = [e.domain in tasks and tasks[e.domain].multi_turn for e in examples]
  single = [i for i, m in enumerate(is_multi) if not m]
  multi = [i for i, m in enumerate(is_multi) if m]
  key = as_key(rng)
  prompts = {}
  for i in single:
    if examples[i].id not in prompts:
      prompts[examples[i].id] = prompt_ids(tokenizer, examples[i])
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
  timings = timings if timings is not None else {}
  episodes: list[Episode | None] = [None] * len(examples)
  for idx, k in zip(single_chunks, single_keys):
    t0 = time.perf_counter()
    comps = sample(model_cfg, params, tokenizer, [prompts[examples[i].id] for i in idx], k,
                   sampling, batch_size=batch_size, prompt_bucket=single_bucket, mesh=mesh,
                   rules=rules)
    timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - t0
    for i, c in zip(idx, comps):
      episodes[i] = Episode(examples[i], prompts[examples[i].id], c.ids,
                            np.ones(len(c.ids), bool), c.logprobs, [c.text], not c.finished)
  if verify and single:
    t0 = time.perf_counter()
    _verify([episodes[i] for i in single], tasks,
            verify_cache if verify_cache is not None else {}, stats)
    timings["verify"] = timings.get("verify", 0.0) + time.perf_counter() - t0
  from opd.rollout import agent  # agent builds on this module's Episode and sample
  for idx, k in zip(multi_chunks, multi_keys):
    chunk = [examples[i] for i in idx]
    if chunked:
      chunk += [chunk[0]] * (batch_size - len(chunk))
    t0 = time.perf_counter()
    eps = agent.rollout_multi_turn(model_cfg, params, tokenizer, chunk, k, sampling, tasks=tasks,
                                   prompt_bucket=prompt_bucket, batch_size=batch_size,
                                   mesh=mesh, rules=rules)
    timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - t0
    for i, ep in zip(idx, eps):
      episodes[i] = ep
      if stats is not None:
        stats.add(ep.reward)
  return episodes  # type: ignore[return-value]


def _tasks(examples: Sequence[Example], task_kwargs, agent_config, verify: bool
           ) -> dict[str, Task]:
  """Domain -> task for the domains of ``examples`` that need one: multi-turn
  domains always, single-turn ones when verifying. Unknown domains (custom
  prompts scored by the caller) are single-turn and need ``verify=False``."""
  kwargs = {d: dict(v) for d, v in (task_kwargs or {}).items()}
  if agent_config is not None:
    own = kwargs.setdefault(AgentTask.domain, {})
    if "config" in own:
      raise ValueError(f"agent_config and task_kwargs[{AgentTask.domain!r}]['config'] are both "
                       "set; pass one")
    own["config"] = agent_config
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
