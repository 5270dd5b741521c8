"""Examples, rewards, the Task base class, leak-free splits and safe scoring.

Every domain is a ``Task``: a seeded generator of ``Example`` s at difficulty
1 (easy) to 3 (hard) and a verifier ``verify(example, response) -> Reward``.

Splits are leak-free by construction: an example belongs to ``"test"`` iff a
hash of its domain and prompt text falls in the first ``TEST_FRACTION`` of
the hash range, so the same prompt string can never be in both splits,
whatever the seeds. Generators draw candidates from a seeded stream and keep
those whose prompt hashes to the requested split.

Verifiers never raise on a malformed *response* (that scores 0 with a
reason). ``safe_verify`` additionally turns a verifier *exception* (a bug or
an infrastructure failure such as a broken sandbox) into reward 0 with reason
``"verifier_error:..."``, and ``RewardStats`` counts reasons so a trainer can
log them and stop when errors exceed a configured fraction.
"""
from __future__ import annotations

import abc
import collections
import dataclasses
import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from opd.config.fields import check_choice, check_float, check_int, set_field
from opd.tasks.sandbox.api import IsolationUnavailable
from opd.text import parsers

DIFFICULTIES = (1, 2, 3)
SPLITS = ("train", "test")
TEST_FRACTION = 0.2
ROLES = ("system", "user", "assistant", "tool")


def split_of(domain: str, prompt: str) -> str:
  """``"test"`` for a fixed ``TEST_FRACTION`` of prompt strings, else ``"train"``."""
  digest = hashlib.sha256(f"{domain}\x00{prompt}".encode()).digest()
  return "test" if int.from_bytes(digest[:8], "big") < TEST_FRACTION * 2**64 else "train"


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem of a domain.

  Attributes:
    domain: the domain label (``"math"``, ``"code"``, ...); it selects the
      specialist teacher in OPD.
    id: stable id derived from the content.
    split: ``"train"`` or ``"test"``.
    difficulty: 1 (easy) to 3 (hard).
    prompt: the user message.
    reference: the reference continuation as ``(role, content)`` turns, exactly
      in the format the verifier expects: one ``assistant`` turn for
      single-turn domains; alternating ``assistant`` / ``tool`` turns ending
      in an ``assistant`` answer for the agent domain.
    meta: verifier data (answers, hidden tests, constraints, rubric); never
      shown to the policy. JSON-serialisable.
  """
  domain: str
  id: str
  split: str
  difficulty: int
  prompt: str
  reference: tuple[tuple[str, str], ...]
  meta: Mapping[str, Any]

  def prompt_messages(self) -> list[dict[str, str]]:
    return [{"role": "user", "content": self.prompt}]

  def reference_messages(self) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in self.reference]

  def messages(self) -> list[dict[str, str]]:
    """The whole reference conversation: prompt then reference turns."""
    return self.prompt_messages() + self.reference_messages()

  @property
  def reference_text(self) -> str:
    """The reference response of a single-turn example."""
    if len(self.reference) != 1 or self.reference[0][0] != "assistant":
      raise ValueError(f"example {self.id} has a {len(self.reference)}-turn reference; use "
                       "reference_messages() for multi-turn domains")
    return self.reference[0][1]

  def to_json(self) -> str:
    """Canonical JSON (sorted keys): equal examples give identical bytes."""
    return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Reward:
  """A verifier's verdict.

  Attributes:
    reward: task reward in [0, 1] (the format is already folded in: a
      malformed response gets 0).
    format: format reward in [0, 1], reported separately so a trainer can
      weight or log it on its own.
    components: named parts in [0, 1] (e.g. per constraint, per reward layer).
    reason: ``"ok"`` when fully correct, else ``category[:detail]``, e.g.
      ``"wrong_answer"``, ``"malformed:no_answer"``, ``"partial:3/5"``.
  """
  reward: float
  format: float
  components: Mapping[str, float] = dataclasses.field(default_factory=dict)
  reason: str = "ok"

  def __post_init__(self):
    set_field(self, "reward", check_float("Reward", "reward", self.reward, min_value=0.0,
                                          max_value=1.0))
    set_field(self, "format", check_float("Reward", "format", self.format, min_value=0.0,
                                          max_value=1.0))
    set_field(self, "components", {
        k: check_float("Reward", f"components[{k!r}]", v, min_value=0.0, max_value=1.0)
        for k, v in self.components.items()})
    if not isinstance(self.reason, str) or not self.reason:
      raise ValueError(f"Reward.reason must be a non-empty string, got {self.reason!r}")

  @property
  def category(self) -> str:
    return self.reason.split(":", 1)[0]


def malformed(reason: str, **components: float) -> Reward:
  """Reward 0 and format 0 for a response that does not parse."""
  return Reward(0.0, 0.0, components, f"malformed:{reason}")


def response_body(response: Any) -> str | Reward:
  """The answer after any thinking block, stripped; a malformed ``Reward``
  when the thinking block is broken or nothing is left."""
  split = parsers.split_thinking(response)
  if not split.ok:
    return malformed(split.reason)
  body = split.body.strip()
  return body if body else malformed("empty")


@dataclasses.dataclass(frozen=True)
class Draft:
  """What a generator returns before the split and id are attached."""
  prompt: str
  reference: tuple[tuple[str, str], ...]
  meta: dict[str, Any]


class Env(Protocol):
  """The environment of a multi-turn task (``Task.make_env``); knows nothing
  about models. ``reset(example)`` starts an episode and returns the first
  messages; ``step(assistant_text)`` returns ``(tool_result or None, done,
  info)``; ``reward()`` scores the episode so far."""

  def reset(self, example: Example) -> list[dict[str, str]]: ...

  def step(self, assistant_text: Any) -> tuple[str | None, bool, dict[str, Any]]: ...

  def reward(self) -> Reward: ...


class Task(abc.ABC):
  """A domain: seeded generator plus verifier."""

  domain: str = ""
  # A multi-turn task's episodes interleave policy turns with environment
  # turns (tool results); rollout runs them through the task's environment
  # loop instead of one sampler call.
  multi_turn: bool = False

  def examples(self, split: str, n: int, *, seed: int = 0, difficulty: int = 1,
               unique: bool = True, at_most: bool = False) -> list[Example]:
    """``n`` examples of ``split`` at ``difficulty``.

    The same arguments always give byte-identical examples (``to_json``).

    Args:
      split: ``"train"`` or ``"test"``.
      n: how many.
      seed: selects the random stream.
      difficulty: 1 to 3.
      unique: all distinct (for evaluation sets); False draws i.i.d. with
        repeats, for corpora larger than the problem space.
      at_most: with ``unique``, return the distinct problems found when the
        split holds fewer than ``n`` (after the same number of draws that
        would raise), instead of raising.

    Raises:
      ValueError: bad arguments, or ``unique`` and fewer than ``n`` distinct
        problems exist in this split at this difficulty.
    """
    owner = f"{type(self).__name__}.examples"
    check_choice(owner, "split", split, SPLITS)
    difficulty = check_int(owner, "difficulty", difficulty, min_value=DIFFICULTIES[0],
                           max_value=DIFFICULTIES[-1])
    n = check_int(owner, "n", n, min_value=0)
    seed = check_int(owner, "seed", seed)
    rng = random.Random(f"{self.domain}/{split}/{difficulty}/{seed}")
    out: dict[str, Example] = {}
    repeated: list[Example] = []
    attempts, max_attempts = 0, 50 * n + 500
    while len(out) + len(repeated) < n:
      if attempts >= max_attempts:
        if unique and at_most:
          break
        raise ValueError(f"{self.domain}: found only {len(out)} distinct {split} problems at "
                         f"difficulty {difficulty} in {attempts} draws; asked for n={n}")
      attempts += 1
      draft = self.draft(rng, difficulty)
      if split_of(self.domain, draft.prompt) != split:
        continue
      key = json.dumps([draft.prompt, draft.meta], sort_keys=True)
      uid = f"{self.domain}-{split}-d{difficulty}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
      example = Example(self.domain, uid, split, difficulty, draft.prompt, draft.reference,
                        draft.meta)
      if not unique:
        repeated.append(example)
      elif uid not in out:
        out[uid] = example
    return repeated if not unique else list(out.values())

  @abc.abstractmethod
  def draft(self, rng: random.Random, difficulty: int) -> Draft:
    """One random problem (prompt, reference, meta) drawn from ``rng``."""

  @abc.abstractmethod
  def verify(self, example: Example, response: Any) -> Reward:
    """Scores ``response`` (text; the agent domain also takes its turns)."""

  def verify_batch(self, examples: Sequence[Example], responses: Sequence[Any]) -> list[Reward]:
    """``verify`` over pairs; domains with slow verifiers parallelise this."""
    check_batch(examples, responses)
    return [self.verify(e, r) for e, r in zip(examples, responses)]

  def make_env(self) -> "Env":
    """A fresh environment for one episode of a multi-turn task.

    Raises:
      ValueError: the task is single-turn (``multi_turn`` is False).
    """
    raise ValueError(f"task {self.domain!r} is single-turn (multi_turn=False): it has no "
                     "environment; sample its responses in one call")

  def check_example(self, example: Any):
    """Raises ValueError unless ``example`` is an Example of this domain."""
    if not isinstance(example, Example):
      raise ValueError(f"example must be an Example, got {type(example).__name__}")
    if example.domain != self.domain:
      raise ValueError(f"example {example.id} is from domain {example.domain!r}, "
                       f"not {self.domain!r}")


def check_batch(examples: Sequence[Any], responses: Sequence[Any]) -> None:
  """ValueError unless there is one response per example."""
  if len(examples) != len(responses):
    raise ValueError(f"got {len(examples)} examples but {len(responses)} responses")


class VerifierFailureError(RuntimeError):
  """Too many verifier errors: the reward signal cannot be trusted."""


@dataclasses.dataclass
class RewardStats:
  """Counts of reward reasons, for metrics and for failing fast.

  ``errors`` counts verifier exceptions (``verifier_error``) and malformed
  prompts (``bad_example``): faults of the pipeline, not of the policy.
  """
  total: int = 0
  errors: int = 0
  reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  ERROR_CATEGORIES = ("verifier_error", "bad_example")

  def add(self, reward: Reward):
    self.total += 1
    self.reasons[reward.category] += 1
    self.errors += reward.category in self.ERROR_CATEGORIES

  @property
  def error_fraction(self) -> float:
    return self.errors / self.total if self.total else 0.0

  def check(self, max_error_fraction: float):
    """Raises VerifierFailureError if the error fraction exceeds the maximum."""
    check_float("RewardStats.check", "max_error_fraction", max_error_fraction, min_value=0.0,
                max_value=1.0)
    if self.error_fraction > max_error_fraction:
      raise VerifierFailureError(
          f"{self.errors}/{self.total} samples ({self.error_fraction:.1%}) failed in the "
          f"verifier, above max_error_fraction={max_error_fraction:.1%}; reasons: "
          f"{dict(self.reasons.most_common())}")

  def metrics(self, prefix: str = "reward_reason/") -> dict[str, float]:
    """Flat ``{name: value}`` for a metrics logger."""
    out = {f"{prefix}{k}": float(v) for k, v in sorted(self.reasons.items())}
    out[f"{prefix}error_fraction"] = self.error_fraction
    return out


def safe_verify(task: Task, example: Any, response: Any,
                stats: RewardStats | None = None) -> Reward:
  """``task.verify`` that never raises for a bad sample: errors score 0 with a counted reason.

  ``IsolationUnavailable`` (the sandbox cannot give the isolation the task
  requires) is re-raised: it is the machine's set-up, not the sample.
  """
  try:
    task.check_example(example)
  except ValueError as e:
    reward = Reward(0.0, 0.0, {}, f"bad_example:{e}"[:300])
  else:
    try:
      reward = task.verify(example, response)
      if not isinstance(reward, Reward):
        raise TypeError(f"verify returned {type(reward).__name__}, not Reward")
    except IsolationUnavailable:
      raise  # the machine cannot run the verifier safely: a set-up error, not a bad sample
    except Exception as e:  # noqa: BLE001 - the whole point: count it, score 0
      reward = Reward(0.0, 0.0, {}, f"verifier_error:{type(e).__name__}: {e}"[:300])
  if stats is not None:
    stats.add(reward)
  return reward


def safe_verify_batch(task: Task, examples: Sequence[Any], responses: Sequence[Any], *,
                      stats: RewardStats | None = None,
                      max_error_fraction: float | None = None) -> list[Reward]:
  """Batch ``safe_verify``; optionally raises once errors exceed a fraction.

  Uses ``task.verify_batch`` (which may run in parallel) and falls back to
  one-by-one ``safe_verify`` if the batch call itself raises.

  Raises:
    VerifierFailureError: ``max_error_fraction`` is given and this batch's
      error fraction exceeds it.
  """
  check_batch(examples, responses)
  batch_stats = RewardStats()
  try:
    for example in examples:
      task.check_example(example)
    rewards = task.verify_batch(examples, responses)
    if len(rewards) != len(examples) or not all(isinstance(r, Reward) for r in rewards):
      raise TypeError("verify_batch must return one Reward per example")
    for r in rewards:
      batch_stats.add(r)
  except IsolationUnavailable:
    raise
  except Exception:  # noqa: BLE001 - isolate the failing sample(s)
    batch_stats = RewardStats()
    rewards = [safe_verify(task, e, r, batch_stats) for e, r in zip(examples, responses)]
  if stats is not None:
    stats.total += batch_stats.total
    stats.errors += batch_stats.errors
    stats.reasons.update(batch_stats.reasons)
  if max_error_fraction is not None:
    batch_stats.check(max_error_fraction)
  return rewards
