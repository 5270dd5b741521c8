"""Rollouts: a model answers task prompts; episodes come back as token ids.

The one place where the sampler, the tokenizer, the chat format and the task
verifiers meet. GRPO, evaluation and on-policy distillation all consume the
``Episode``s made here:

  prompt_ids    [P]  BOS + the rendered prompt + ``<|assistant|>``
  response_ids  [N]  everything after the prompt. Single-turn: the sampled
                     completion, ending with ``<|end|>`` when it finished.
                     Agent: assistant turns interleaved with the tool turns the
                     environment fed back.
  policy_mask   [N]  True where the policy sampled the token (trainable);
                     False on tool results and on the role headers between
                     turns.
  logprobs      [N]  the sampler's ``log_softmax(logits / T)`` at policy
                     tokens, 0 elsewhere (GRPO's ``logp_old``).

Shapes stay static for ``jit``: prompts are left-padded to a multiple of
``prompt_bucket`` and the batch is padded to the size it started with, so an
agent episode whose active set shrinks does not recompile the sampler.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from opd import tasks as tasks_lib
from opd.models import ModelConfig
from opd.rollout.sampler import SamplingConfig, generate
from opd.tasks import AgentEnv, AgentRewardConfig, Example, Reward, RewardStats
from opd.text.tokenizers import ASSISTANT, END, EOS, TOOL, TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN


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
           mesh=None, rules=None) -> list[Completion]:
  """Samples one completion per prompt (lists of ids of any lengths).

  Prompts are left-padded to a multiple of ``prompt_bucket`` and the batch
  is padded to ``batch_size`` rows (default ``len(prompts)``) by repeating
  the first prompt, so repeated calls reuse one compiled sampler.
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
  B = batch_size or len(prompts)
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
  out = generate(model_cfg, params, tokens, mask, rng, sampling, mesh=mesh, rules=rules)
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


def rollout(model_cfg: ModelConfig, params, tokenizer, examples: Sequence[Example], rng,
            sampling: SamplingConfig, *, stats: RewardStats | None = None,
            agent_config: AgentRewardConfig | None = None,
            task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
            prompt_bucket: int = 32, batch_size: int | None = None, mesh=None, rules=None,
            verify: bool = True) -> list[Episode]:
  """One episode per example (repeat examples for groups), verified.

  Single-turn domains are sampled in one batch; agent examples run the
  multi-turn loop (``rollout_agent``). Verifier crashes score 0 with a
  counted reason (``stats``), never raise. ``batch_size`` fixes the number
  of sampler rows (padded) so calls with fewer examples reuse the compile.
  """
  task_kwargs = dict(task_kwargs or {})
  single = [i for i, e in enumerate(examples) if e.domain != "agent"]
  multi = [i for i, e in enumerate(examples) if e.domain == "agent"]
  episodes: list[Episode | None] = [None] * len(examples)
  key_single, key_multi = jax.random.split(_as_key(rng))
  if single:
    prompts = [prompt_ids(tokenizer, examples[i]) for i in single]
    comps = sample(model_cfg, params, tokenizer, prompts, key_single, sampling,
                   batch_size=batch_size, prompt_bucket=prompt_bucket, mesh=mesh, rules=rules)
    if verify:
      # A group of samples often repeats itself: verify each distinct
      # (example, response) once (code responses each cost a sandbox run).
      by_domain: dict[str, dict[tuple[str, str], int]] = {}
      for j, i in enumerate(single):
        by_domain.setdefault(examples[i].domain, {}).setdefault(
            (examples[i].id, comps[j].text), j)
      verified: dict[tuple[str, str], Reward] = {}
      for domain, firsts in by_domain.items():
        task = tasks_lib.get_task(domain, **task_kwargs.get(domain, {}))
        js = list(firsts.values())
        got = tasks_lib.safe_verify_batch(task, [examples[single[j]] for j in js],
                                          [comps[j].text for j in js])
        verified.update(zip(firsts, got))
      rewards = {j: verified[examples[i].id, comps[j].text] for j, i in enumerate(single)}
      if stats is not None:
        for j in range(len(single)):
          stats.add(rewards[j])
    for j, (i, c) in enumerate(zip(single, comps)):
      episodes[i] = Episode(examples[i], prompts[j], c.ids, np.ones(len(c.ids), bool),
                            c.logprobs, [c.text], not c.finished,
                            rewards[j] if verify else None)
  if multi:
    agent_eps = rollout_agent(model_cfg, params, tokenizer, [examples[i] for i in multi],
                              key_multi, sampling, config=agent_config, stats=stats,
                              prompt_bucket=prompt_bucket, batch_size=batch_size, mesh=mesh,
                              rules=rules)
    for i, ep in zip(multi, agent_eps):
      episodes[i] = ep
  return episodes  # type: ignore[return-value]


def _as_key(rng):
  if isinstance(rng, (int, np.integer)):
    return jax.random.key(int(rng))
  return rng


def rollout_agent(model_cfg: ModelConfig, params, tokenizer, examples: Sequence[Example], rng,
                  sampling: SamplingConfig, *, config: AgentRewardConfig | None = None,
                  stats: RewardStats | None = None, prompt_bucket: int = 32,
                  batch_size: int | None = None, mesh=None, rules=None) -> list[Episode]:
  """Batched multi-turn tool-use episodes (``opd.tasks.AgentEnv``).

  Each turn samples the next assistant turn for every unfinished episode,
  steps its environment, and appends the tool reply as non-policy tokens
  ``<|tool|><tool_result>…</tool_result><|end|><|assistant|>``. An episode
  ends when the environment says so (answer, malformed turn, turn limit) or
  when a turn hits ``max_new_tokens`` without closing (truncated, reward
  from the turns so far).
  """
  envs = [AgentEnv(config) for _ in examples]
  for env, ex in zip(envs, examples):
    env.reset(ex)
  prompts = [prompt_ids(tokenizer, ex) for ex in examples]
  pieces: list[list[tuple[np.ndarray, np.ndarray, bool]]] = [[] for _ in examples]
  turns: list[list[str]] = [[] for _ in examples]
  truncated = [False] * len(examples)
  active = list(range(len(examples)))
  key = _as_key(rng)
  while active:
    key, sub = jax.random.split(key)
    contexts = [np.concatenate([prompts[i]] + [p[0] for p in pieces[i]]) for i in active]
    comps = sample(model_cfg, params, tokenizer, contexts, sub, sampling,
                   batch_size=batch_size or len(examples), prompt_bucket=prompt_bucket,
                   mesh=mesh, rules=rules)
    still = []
    for i, c in zip(active, comps):
      pieces[i].append((c.ids, c.logprobs, True))
      turns[i].append(c.text)
      result, done, _ = envs[i].step(c.text)
      if not c.finished:
        # The turn ran out of tokens: it is judged as written (it may still
        # parse) and the episode stops here, scored on its turns so far.
        truncated[i] = True
        continue
      if done:
        continue
      feedback = (f"{TOOL}{TOOL_RESULT_OPEN}{result if result is not None else ''}"
                  f"{TOOL_RESULT_CLOSE}{END}{ASSISTANT}")
      fb_ids = np.asarray(tokenizer.encode(feedback), np.int32)
      pieces[i].append((fb_ids, np.zeros(len(fb_ids), np.float32), False))
      still.append(i)
    active = still
  episodes = []
  for i, ex in enumerate(examples):
    ids = np.concatenate([p[0] for p in pieces[i]]).astype(np.int32)
    logps = np.concatenate([p[1] for p in pieces[i]]).astype(np.float32)
    pmask = np.concatenate([np.full(len(p[0]), p[2], bool) for p in pieces[i]])
    try:
      reward = envs[i].reward()
    except Exception as e:  # noqa: BLE001 - count, score 0, never crash a trainer
      reward = Reward(0.0, 0.0, {}, f"verifier_error:{type(e).__name__}: {e}"[:300])
    if stats is not None:
      stats.add(reward)
    episodes.append(Episode(ex, prompts[i], ids, pmask, logps, turns[i], truncated[i], reward))
  return episodes


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
