"""Agent: multi-turn tool use with the layered reward of docs/DESIGN.md §8.

The user asks about values in a hidden per-example table; the policy must
look them up, compute with the calculator and answer. Each assistant turn is
either exactly one tool call or the final answer (optionally after a
``<think>`` block)::

  user       What is the price of the pear times 3?
  assistant  <tool_call>{"name": "lookup", "arguments": {"key": "pear"}}</tool_call>
  tool       7
  assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "7*3"}}</tool_call>
  tool       21
  assistant  Answer: 21

Tools: ``lookup(key)`` over the table and ``calculator(expression)`` (exact
``+ - * / ( )``); a failing call returns ``error: <message>`` as the tool
result and the episode continues. A malformed turn (neither one call nor an
answer) ends the episode, as do the answer and the turn limit.

Layered reward, weights from ``AgentRewardConfig`` (default: format 0.30,
execution 0.25, step 0.20, final answer 0.25; the GRM 0.15 and user 0.10
shares of docs/DESIGN.md §8 are taken from the final-answer share once a GRM exists):

  format        well-formed assistant turns / assistant turns;
  execution     tool calls that executed / tool calls (0 with no calls);
  step          required steps done / max(required steps, calls made) -- a
                lookup of a needed key, or a calculation whose result is the
                needed value; extra or wrong calls dilute it;
  final_answer  1 iff the answer equals the expected value;
  grm, user     scores in [0, 1] supplied by the caller.

Difficulty: 1 = one lookup; 2 = a lookup then a calculation with a constant;
3 = two lookups then a calculation. Turn limit = required turns + 2.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from opd.config.fields import check_float, check_int, set_field
from opd.text import parsers
from opd.text.tool_calls import ToolCall, format_tool_call
from opd.tasks.base import Draft, Example, Reward, Task, malformed
from opd.tasks.tools import ToolError, run_tool
from opd.tasks.vocab import ATTRIBUTES, ENTITIES

Policy = Callable[[list[dict[str, str]]], str]
_OPS = {"plus": "+", "minus": "-", "times": "*"}


@dataclasses.dataclass(frozen=True)
class AgentRewardConfig:
  """Weights of the reward layers; non-negative, summing to 1."""
  format: float = 0.30
  execution: float = 0.25
  step: float = 0.20
  final_answer: float = 0.25
  grm: float = 0.0
  user: float = 0.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      set_field(self, f.name, check_float("AgentRewardConfig", f.name, getattr(self, f.name),
                                          min_value=0.0))
    total = sum(self.weights().values())
    if abs(total - 1.0) > 1e-6:
      raise ValueError(f"AgentRewardConfig weights must sum to 1, got {total} ({self.weights()})")

  def weights(self) -> dict[str, float]:
    return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class ToolRecord:
  name: str
  arguments: dict[str, Any]
  ok: bool
  result: str


@dataclasses.dataclass
class Trajectory:
  """An episode so far.

  Attributes:
    example: the task.
    messages: the conversation (user prompt, assistant and tool turns).
    turns: the parsed assistant turns.
    tool_records: every executed (or failed) call.
    answer: the final answer, if one was given.
    end_reason: ``"running"``, ``"answered"``, ``"malformed"`` or ``"turn_limit"``.
  """
  example: Example
  messages: list[dict[str, str]]
  turns: list[parsers.AssistantTurn] = dataclasses.field(default_factory=list)
  tool_records: list[ToolRecord] = dataclasses.field(default_factory=list)
  answer: parsers.ParsedAnswer | None = None
  end_reason: str = "running"

  @property
  def done(self) -> bool:
    return self.end_reason != "running"


class AgentEnv:
  """The tool-use environment; knows nothing about models.

  Usage: ``messages = env.reset(example)``, then repeatedly
  ``result, done, info = env.step(assistant_text)`` until ``done``, then
  ``env.reward()``; or just ``rollout(env, example, policy)``.
  """

  def __init__(self, config: AgentRewardConfig | None = None, *, max_turns: int | None = None):
    """Args: config: reward weights; max_turns: assistant-turn limit (default
    from the example: required turns + 2)."""
    self.config = AgentRewardConfig() if config is None else config
    if not isinstance(self.config, AgentRewardConfig):
      raise ValueError(f"config must be an AgentRewardConfig, got {type(config).__name__}")
    self.max_turns = check_int("AgentEnv", "max_turns", max_turns, min_value=1, allow_none=True)
    self._traj: Trajectory | None = None

  @property
  def trajectory(self) -> Trajectory:
    if self._traj is None:
      raise ValueError("no episode: call reset(example) first")
    return self._traj

  def reset(self, example: Example) -> list[dict[str, str]]:
    """Starts an episode; returns the messages the policy sees first."""
    if not isinstance(example, Example) or example.domain != AgentTask.domain:
      raise ValueError(f"example must be an agent-domain Example, got {example!r:.80}")
    self._traj = Trajectory(example, example.prompt_messages())
    self._limit = self.max_turns or example.meta["max_turns"]
    return list(self._traj.messages)

  def step(self, assistant_text: Any) -> tuple[str | None, bool, dict[str, Any]]:
    """Applies one assistant turn.

    Returns:
      ``(tool_result, done, info)``: the tool's reply text (None when the
      turn was not a tool call), whether the episode ended, and
      ``{"kind": ..., "reason": ...}`` describing the turn.
    """
    traj = self.trajectory
    if traj.done:
      raise ValueError(f"episode already ended ({traj.end_reason}); call reset")
    turn = parsers.parse_assistant_turn(assistant_text)
    traj.turns.append(turn)
    traj.messages.append({"role": "assistant",
                          "content": assistant_text if isinstance(assistant_text, str) else ""})
    result = None
    if turn.kind == "tool_call":
      try:
        result = run_tool(turn.call.name, turn.call.arguments, traj.example.meta["table"])
        ok = True
      except ToolError as e:
        result, ok = f"error: {e}", False
      traj.tool_records.append(ToolRecord(turn.call.name, turn.call.arguments, ok, result))
      traj.messages.append({"role": "tool", "content": result})
      if len(traj.turns) >= self._limit:
        traj.end_reason = "turn_limit"
    elif turn.kind == "answer":
      traj.answer, traj.end_reason = turn.answer, "answered"
    else:
      traj.end_reason = "malformed"
    return result, traj.done, {"kind": turn.kind, "reason": turn.reason}

  def reward(self, trajectory: Trajectory | None = None, *, grm: float | None = None,
             user: float | None = None) -> Reward:
    """The layered reward of a (finished or not) trajectory."""
    traj = self.trajectory if trajectory is None else trajectory
    return layered_reward(traj, self.config, grm=grm, user=user)


def layered_reward(traj: Trajectory, config: AgentRewardConfig, *, grm: float | None = None,
                   user: float | None = None) -> Reward:
  """Combines the reward layers of the module docstring with ``config``'s weights."""
  meta = traj.example.meta
  n_turns, calls = len(traj.turns), traj.tool_records
  parts = {
      "format": sum(t.kind != "malformed" for t in traj.turns) / n_turns if n_turns else 0.0,
      "execution": sum(c.ok for c in calls) / len(calls) if calls else 0.0,
      "step": _step_score(meta["steps"], calls),
      "final_answer": float(traj.answer is not None and traj.answer.ok
                            and traj.answer.value == Fraction(meta["answer"])),
  }
  for name, value in (("grm", grm), ("user", user)):
    weight = getattr(config, name)
    if value is None:
      if weight > 0:
        raise ValueError(f"AgentRewardConfig.{name}={weight} > 0 needs a {name} score")
      continue
    parts[name] = check_float("layered_reward", name, value, min_value=0.0, max_value=1.0)
  weights = config.weights()
  total = min(1.0, sum(weights[k] * v for k, v in parts.items()))
  if traj.end_reason == "malformed":
    reason = f"malformed:{traj.turns[-1].reason}"
  elif traj.end_reason in ("turn_limit", "running"):
    reason = "turn_limit" if traj.end_reason == "turn_limit" else "incomplete"
  elif not parts["final_answer"]:
    reason = "wrong_answer"
  else:
    reason = "ok" if all(v == 1.0 for v in parts.values()) else "partial"
  return Reward(total, parts["format"], parts, reason)


def _step_score(required: Sequence[Sequence[str]], calls: Sequence[ToolRecord]) -> float:
  todo = [tuple(s) for s in required]
  for call in calls:
    if not call.ok:
      continue
    if call.name == "lookup":
      step = ("lookup", call.arguments["key"])
    else:
      step = ("calculator", call.result)
    if step in todo:
      todo.remove(step)
  return (len(required) - len(todo)) / max(len(required), len(calls))


def rollout(env: AgentEnv, example: Example, policy: Policy, *, grm: float | None = None,
            user: float | None = None) -> tuple[Trajectory, Reward]:
  """Runs ``policy(messages) -> assistant_text`` until the episode ends."""
  messages = env.reset(example)
  done = False
  while not done:
    _, done, _ = env.step(policy(messages))
    messages = list(env.trajectory.messages)
  return env.trajectory, env.reward(grm=grm, user=user)


def assistant_turns(response: Any) -> list[str] | None:
  """The assistant turns of a response; None if it has none.

  Accepts a list of turn texts, or one string: either a single turn or a
  rendered continuation (``...<|end|><|tool|>...<|end|><|assistant|>...``,
  the first turn's ``<|assistant|>`` header optional). Tool turns in the text
  are ignored: tool results are always recomputed by replaying the calls.
  """
  if isinstance(response, str):
    if "<|end|>" not in response:
      return [response]
    turns = []
    for i, segment in enumerate(response.split("<|end|>")):
      if segment.startswith("<|assistant|>"):
        turns.append(segment[len("<|assistant|>"):])
      elif i == 0 and not segment.startswith("<|"):
        turns.append(segment)
    return turns or None
  if isinstance(response, Sequence) and all(isinstance(t, str) for t in response) and response:
    return list(response)
  return None


class AgentTask(Task):
  domain = "agent"
  multi_turn = True

  def __init__(self, config: AgentRewardConfig | None = None):
    self.config = AgentRewardConfig() if config is None else config
    if not isinstance(self.config, AgentRewardConfig):
      raise ValueError(f"AgentTask.config must be an AgentRewardConfig, got {config!r}")

  def make_env(self) -> AgentEnv:
    """A fresh ``AgentEnv`` with this task's reward weights."""
    return AgentEnv(self.config)

  def draft(self, rng: random.Random, difficulty: int) -> Draft:
    attr = rng.choice(ATTRIBUTES)
    names = rng.sample(ENTITIES, 5)
    table = {name: rng.randrange(1, 21) for name in sorted(names)}
    e1, e2 = names[0], names[1]
    steps: list[list[str]] = [["lookup", e1]]
    if difficulty == 1:
      answer = Fraction(table[e1])
      prompt = rng.choice((f"What is the {attr} of the {e1}?", f"Look up the {attr} of the {e1}."))
    elif difficulty == 2:
      word, k = rng.choice(sorted(_OPS)), rng.randrange(2, 10)
      expression = f"{table[e1]}{_OPS[word]}{k}"
      prompt = f"What is the {attr} of the {e1} {word} {k}?"
    else:
      word = rng.choice(sorted(_OPS))
      expression = f"{table[e1]}{_OPS[word]}{table[e2]}"
      steps.append(["lookup", e2])
      prompt = f"What is the {attr} of the {e1} {word} that of the {e2}?"
    reference = []
    for _, key in steps:
      reference += [("assistant", format_tool_call(ToolCall("lookup", {"key": key}))),
                    ("tool", str(table[key]))]
    if difficulty > 1:
      answer = Fraction(run_tool("calculator", {"expression": expression}, table))
      steps.append(["calculator", parsers.format_number(answer)])
      reference += [("assistant", format_tool_call(
                      ToolCall("calculator", {"expression": expression}))),
                    ("tool", parsers.format_number(answer))]
    reference.append(("assistant", parsers.format_answer(answer)))
    meta = {"table": table, "answer": parsers.format_number(answer), "steps": steps,
            "max_turns": len(steps) + 3}
    return Draft(prompt, tuple(reference), meta)

  def verify(self, example: Example, response: Any, *, grm: float | None = None,
             user: float | None = None) -> Reward:
    """Replays the assistant turns of ``response`` in a fresh environment.

    ``response`` is a list of assistant turn texts, a rendered continuation
    string, or a finished ``Trajectory`` (scored as is). Turns after the
    episode ends are ignored.
    """
    self.check_example(example)
    env = AgentEnv(self.config)
    if isinstance(response, Trajectory):
      if response.example.id != example.id:
        raise ValueError(f"trajectory is for {response.example.id}, not {example.id}")
      return env.reward(response, grm=grm, user=user)
    turns = assistant_turns(response)
    if turns is None:
      return malformed("no_assistant_turns")
    env.reset(example)
    for text in turns:
      env.step(text)
      if env.trajectory.done:
        break
    return env.reward(grm=grm, user=user)
