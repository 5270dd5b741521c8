"""The toy task suite (docs/DESIGN.md §9): five seeded domains with verifiers.

``get_task(name)`` returns a ``Task`` for one of ``ALL_DOMAINS``;
``mixture_corpus`` renders train-split examples of every domain as chat text
for pre-training the tiny base model. See ``opd.tasks.base`` for the
example/reward types, splits and safe scoring, and each domain module for
its exact text formats. One easy (difficulty 1) example per domain, as
prompt -> reference response:

  math      "What is 8 - 4?" -> "Answer: 4"
  code      "Write f(x) that returns x times 3 plus 2." -> "def f(x): return x*3+2"
  instruct  "Write 2 words about a dog. Avoid 'brown'." -> "fast dog"
  writing   "Write one sentence about the sand. Mention 'calm'." -> "The calm sand rests."
  agent     "What is the age of the bee?" ->
            '<tool_call>{"name": "lookup", "arguments": {"key": "bee"}}</tool_call>',
            tool turn "10", then "Answer: 10"

Every response may start with a ``<think>...</think>`` block.
"""
from __future__ import annotations

from typing import Sequence

from opd.text import chat
from opd.tasks.agent_task import AgentEnv, AgentRewardConfig, AgentTask, Trajectory, rollout
from opd.tasks.base import (DIFFICULTIES, SPLITS, TEST_FRACTION, Example, Reward, RewardStats,
                            Task, VerifierFailureError, safe_verify, safe_verify_batch, split_of)
from opd.tasks.code_task import CodeTask
from opd.tasks.instruct_task import InstructTask
from opd.tasks.math_task import MathTask
from opd.tasks.proof_task import ProofTask
from opd.tasks.writing_task import WritingTask

ALL_DOMAINS = ("math", "code", "instruct", "agent", "writing")
# Domains outside the five-domain pipelines (get_task only): the proof domain of §7.
EXTRA_DOMAINS = ("proof",)
_TASKS = {"math": MathTask, "code": CodeTask, "instruct": InstructTask, "agent": AgentTask,
          "writing": WritingTask, "proof": ProofTask}


def render_messages(messages, *, add_generation_prompt: bool = False) -> str:
  """A task conversation (raw assistant text, see ``Example``) in the chat
  format of ``opd.text.chat``; with ``add_generation_prompt`` it ends by opening an
  assistant turn (mode "non-think", as the specialists are prompted)."""
  return chat.render(chat.from_raw(messages), add_generation_prompt=add_generation_prompt,
                     mode="non-think")


def is_multi_turn(domain: str) -> bool:
  """Whether ``domain``'s episodes run in an environment loop (``Task.multi_turn``)."""
  if domain not in _TASKS:
    raise ValueError(f"unknown domain {domain!r}; domains: {ALL_DOMAINS + EXTRA_DOMAINS}")
  return _TASKS[domain].multi_turn


def get_task(name: str, **kwargs) -> Task:
  """A fresh task of domain ``name``; ``kwargs`` go to its constructor
  (``CodeTask(sandbox=..., workers=...)``, ``AgentTask(config=...)``)."""
  if name not in _TASKS:
    raise ValueError(f"unknown domain {name!r}; domains: {ALL_DOMAINS + EXTRA_DOMAINS}")
  return _TASKS[name](**kwargs)


def domain_examples(domains: Sequence[str], split: str, n: int, seed: int,
                    difficulties: Sequence[int], unique: bool = False) -> list[Example]:
  """``n`` examples of each domain's ``split``, spread evenly over ``difficulties``
  (the first ``n % len(difficulties)`` levels get one more); i.i.d. draws
  (repeats allowed, as the problem space of an easy level can be small)
  unless ``unique``."""
  if not difficulties:
    raise ValueError(f"difficulties={tuple(difficulties)} must name at least one level")
  out = []
  for d in domains:
    task = get_task(d)
    per = [n // len(difficulties) + (i < n % len(difficulties)) for i in range(len(difficulties))]
    for diff, k in zip(difficulties, per):
      out += task.examples(split, k, seed=seed, difficulty=diff, unique=unique)
  return out


def mixture_corpus(n: int, seed: int = 0, *, domains: tuple[str, ...] = ALL_DOMAINS,
                   difficulties: tuple[int, ...] = (1,), responses: bool = True,
                   split: str = "train") -> list[str]:
  """``n`` rendered conversations of ``split``, domains interleaved round-robin.

  Each text is ``render_messages(example.messages())`` (prompt plus reference
  turns, no bos/eos), or only the prompt turn with ``responses=False`` (a
  base that has seen the domains' language but not their solutions leaves
  more headroom for the specialists). Pre-training uses the train split (the
  default) and never sees a test prompt; ``split="test"`` gives held-out
  text for measuring it. Deterministic in ``seed``.

  Raises:
    ValueError: unknown domain, difficulty or split, empty ``domains``, n < 0.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"n must be a non-negative int, got {n!r}")
  if not domains:
    raise ValueError("domains must not be empty")
  for d in difficulties:
    if d not in DIFFICULTIES:
      raise ValueError(f"difficulties must be drawn from {DIFFICULTIES}, got {difficulties!r}")
  slots = [(dom, diff) for dom in domains for diff in difficulties]
  counts = {slot: n // len(slots) + (i < n % len(slots)) for i, slot in enumerate(slots)}
  pools = {}
  for (dom, diff), count in counts.items():
    task = get_task(dom)
    pools[dom, diff] = [render_messages(e.messages() if responses else e.prompt_messages())
                        for e in task.examples(split, count, seed=seed, difficulty=diff,
                                               unique=False)]
  out = []
  for i in range(max(counts.values(), default=0)):
    out += [pools[slot][i] for slot in slots if i < len(pools[slot])]
  return out


__all__ = [
    "ALL_DOMAINS", "DIFFICULTIES", "SPLITS", "TEST_FRACTION", "AgentEnv", "AgentRewardConfig",
    "AgentTask", "CodeTask", "Example", "InstructTask", "MathTask", "Reward", "RewardStats",
    "Task", "Trajectory", "VerifierFailureError", "WritingTask", "get_task", "mixture_corpus",
    "render_messages", "rollout", "safe_verify", "safe_verify_batch",
    "split_of", "EXTRA_DOMAINS", "ProofTask", "domain_examples",
]
