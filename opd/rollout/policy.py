"""A policy and one sampler call over its token prompts (docs/DESIGN.md §8).

The pieces both ``opd.rollout.episodes`` (single-turn rollouts) and
``opd.rollout.agent`` (the multi-turn environment loop) build on, below
both so neither imports the other back:

* ``Policy``: the model that samples (config, parameters, tokenizer) and
  where it runs (mesh, rules);
* ``sample``: one completion per prompt of ids, in one padded sampler call;
* ``Episode`` (one rollout of one example), ``prompt_ids`` (an example's
  rendered prompt), ``sampling_for_chat`` and ``as_key``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np

from opd import tasks as tasks_lib
from opd.models import ModelConfig
from opd.parallel import sharding as shd
from opd.rollout.constraint import TokenAutomaton
from opd.rollout.sampler import SamplingConfig, generate
from opd.tasks import Example, Reward
from opd.text.tokenizers import END, EOS


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
  """A model that samples text, and where it runs.

  Attributes:
    model_cfg: its ``ModelConfig``.
    params: its parameter tree (None for a sampler faked in tests).
    tokenizer: renders prompts and decodes samples (``opd.text.tokenizers``).
    mesh: the device mesh the sampler shards its batch over (None: one device).
    rules: logical -> mesh rules (None: ``DEFAULT_RULES``).
  """
  model_cfg: ModelConfig
  params: Any
  tokenizer: Any
  mesh: Any = None
  rules: Any = None

  def replace(self, **changes) -> "Policy":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class Episode:
  """One rollout of one example (see ``opd.rollout.episodes`` for the arrays)."""
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


def as_key(rng):
  """``rng`` as a ``jax.random`` key (ints are seeds)."""
  if isinstance(rng, (int, np.integer)):
    return jax.random.key(int(rng))
  return rng


@dataclasses.dataclass(frozen=True)
class Completion:
  ids: np.ndarray        # [n] sampled ids, the ending <|end|>/EOS included when finished
  logprobs: np.ndarray   # [n]
  finished: bool
  text: str              # decoded, without the ending stop token


def sample(policy: Policy, prompts: Sequence[np.ndarray], rng, sampling: SamplingConfig, *,
           batch_size: int | None = None, prompt_bucket: int = 32,
           constraint: TokenAutomaton | None = None,
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
  model_cfg, tokenizer, mesh, rules = (policy.model_cfg, policy.tokenizer, policy.mesh,
                                       policy.rules)
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
  out = generate(model_cfg, policy.params, tokens, mask, rng, sampling, mesh=mesh, rules=rules,
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
