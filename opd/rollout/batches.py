"""Rollout batches shared by every on-policy trainer (docs/DESIGN.md §11).

GRPO (``opd.rl.rollout_source``), OPD (``opd.distill.source``), off-policy
KD (``opd.distill.offpolicy``) and the rollout benchmark build their
batches from the same pieces, which live here, below all of them:

* ``RolloutConfig``: the rollout settings they share (P prompts per step, G
  samples per prompt, sampling, the training row length L and its bucket).
  ``GRPOConfig`` keeps these fields flat and exposes them as one typed
  ``RolloutConfig`` through its ``rollout`` property; ``OPDConfig`` holds a
  ``RolloutConfig`` (``config.opd.rollout.*``); ``check_rollout_fields`` is
  the one validator of those fields;
* ``PromptStream`` (an endless, resumable prompt iterator),
  ``DomainBalancedStream`` (the same, drawing the domains in turn, so every
  batch holds each domain equally; ``RolloutConfig.domain_balance``),
  ``prompt_stream`` (the one a config asks for) and ``PromptPosition`` (a
  batch source whose whole state is that position);
* ``prompt_problem`` and ``draw_prompts``: P good prompts, bad ones counted
  as ``bad_example`` and replaced, so batch shapes never change;
* ``sample_groups``: each prompt repeated G times, consecutively (row
  ``p * G + g`` is sample g of prompt p), rolled out with the step's key
  ``fold_in(key(seed), step)`` so a resumed run samples what an
  uninterrupted one would;
* ``fit_episode``, ``training_length`` and ``training_arrays``: episodes cut
  to L and padded only to the longest one rounded up to the bucket.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from opd.config import fields
from opd.rollout import episodes as episodes_lib
from opd.rollout import policy as policy_lib
from opd.rollout.policy import Episode, Policy
from opd.rollout.sampler import SamplingConfig
from opd.tasks import (ALL_DOMAINS, Example, Reward, RewardStats, VerifierFailureError, get_task,
                       is_multi_turn)

__all__ = ["DomainBalancedStream", "PromptPosition", "PromptStream", "RolloutConfig",
           "check_rollout_fields", "draw_prompts", "fit_episode", "prompt_problem",
           "prompt_stream", "sample_groups", "training_arrays", "training_length"]


def check_rollout_fields(cfg: Any, owner: str, *, min_group_size: int = 1) -> None:
  """Validates and normalises the shared rollout fields stored on ``cfg``.

  ``cfg`` is a (frozen) dataclass holding ``prompts_per_step``,
  ``group_size``, ``temperature``, ``max_new_tokens``, ``seq_len`` and
  ``length_bucket``: a ``RolloutConfig`` or ``GRPOConfig``.

  Raises:
    ValueError: ``"{owner}.{field} must be ..., got value"``, or a ``seq_len``
      that leaves no room for a prompt token plus a full turn.
  """
  fields.check_fields(cfg, owner, ints={"prompts_per_step": 1, "group_size": min_group_size,
                                        "max_new_tokens": 1, "seq_len": 2, "length_bucket": 0},
                      positive=("temperature",))
  if cfg.seq_len < cfg.max_new_tokens + 1:
    raise ValueError(f"{owner}.seq_len={cfg.seq_len} must be >= max_new_tokens + 1 = "
                     f"{cfg.max_new_tokens + 1} (a prompt token plus a full turn)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """What a rollout batch looks like; hashable and JSON-ready.

  Attributes:
    prompts_per_step: P, prompts per rollout batch; the batch has B = P * G rows.
    group_size: G, samples per prompt.
    temperature: sampling temperature T > 0.
    top_k, top_p: sampling truncation (0 and 1: off).
    max_new_tokens: N, tokens per sampled turn.
    seq_len: L, the longest training row; a prompt must leave room for a full
      turn (``len(prompt) + N - 1 <= L``), longer agent episodes are cut.
    length_bucket: rows are padded to the batch's longest episode rounded up
      to a multiple of this (at most L; 0: always L), so short responses do
      not pay for L and only a few shapes compile.
    domain_balance: draw prompts through a ``DomainBalancedStream`` (the
      domains in turn: every batch of P holds each of the K domains
      ``P // K`` or ``P // K + 1`` times, exactly P / K when K divides P)
      instead of one ``PromptStream`` over the whole list.
  """
  prompts_per_step: int = 8
  group_size: int = 8
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 64
  seq_len: int = 256
  length_bucket: int = 32
  domain_balance: bool = False

  def __post_init__(self):
    check_rollout_fields(self, "RolloutConfig")
    fields.check_fields(self, "RolloutConfig", ints={"top_k": 0}, bools=("domain_balance",))
    fields.set_field(self, "top_p", fields.check_float(
        "RolloutConfig", "top_p", self.top_p, min_value=0, max_value=1, min_exclusive=True))

  @property
  def batch_size(self) -> int:
    """B = prompts_per_step * group_size."""
    return self.prompts_per_step * self.group_size

  def sampling(self, tokenizer) -> SamplingConfig:
    """The sampler's settings for chat prompts rendered by ``tokenizer``."""
    return policy_lib.sampling_for_chat(tokenizer, max_new_tokens=self.max_new_tokens,
                                          temperature=self.temperature, top_k=self.top_k,
                                          top_p=self.top_p)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


class PromptStream:
  """An endless, resumable iterator over a list of prompts.

  Each epoch visits every item once in an order drawn from ``(seed, epoch)``
  (or in list order with ``shuffle=False``). ``get_state()`` /
  ``set_state()`` save and restore the position, so a checkpointed run
  continues with the prompt it would have drawn next.
  """

  def __init__(self, items: Sequence[Any], *, seed: int = 0, shuffle: bool = True):
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)) or not items:
      raise ValueError(f"items must be a non-empty sequence of prompts, got {type(items).__name__}"
                       f" of length {len(items) if hasattr(items, '__len__') else '?'}")
    self.items, self.seed, self.shuffle = list(items), int(seed), bool(shuffle)
    self.epoch, self.index = 0, 0
    self._order_epoch, self._order_cache = None, None

  def _order(self) -> np.ndarray:
    if self._order_epoch != self.epoch:
      n = len(self.items)
      self._order_cache = (np.random.default_rng([self.seed, self.epoch]).permutation(n)
                           if self.shuffle else np.arange(n))
      self._order_epoch = self.epoch
    return self._order_cache

  def __iter__(self) -> "PromptStream":
    return self

  def __next__(self):
    if self.index >= len(self.items):
      self.epoch, self.index = self.epoch + 1, 0
    item = self.items[int(self._order()[self.index])]
    self.index += 1
    return item

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "index": self.index, "size": len(self.items)}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if state.get("size") != len(self.items):
      raise ValueError(f"PromptStream state {dict(state)} was saved for {state.get('size')} "
                       f"prompts, this stream has {len(self.items)}")
    epoch, index = state.get("epoch"), state.get("index")
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(index, int)
            and 0 <= index <= len(self.items)):
      raise ValueError(f"PromptStream state {dict(state)} has an invalid epoch/index")
    self.epoch, self.index = epoch, index


class DomainBalancedStream:
  """An endless, resumable iterator that draws the domains in turn.

  The items are grouped by their ``domain`` attribute (domains in order of
  first appearance); draw n comes from domain ``n mod K``, out of that
  domain's own ``PromptStream`` (seed ``seed + 1_000_003 · k`` for the k-th
  domain, each with its own epochs). So any P consecutive draws hold every
  domain ``P // K`` or ``P // K + 1`` times, and the remainder rotates over
  the domains from batch to batch (exactly P / K each when K divides P).
  ``get_state()`` / ``set_state()`` save and restore the draw count and every
  domain's position.

  A prompt ``draw_prompts`` rejects is replaced by the next draw, which comes
  from the next domain: the balance is exact for streams of good prompts.
  """

  def __init__(self, items: Sequence[Any], *, seed: int = 0, shuffle: bool = True):
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)) or not items:
      raise ValueError(f"items must be a non-empty sequence of prompts, got {type(items).__name__}"
                       f" of length {len(items) if hasattr(items, '__len__') else '?'}")
    groups: dict[str, list] = {}
    for i, item in enumerate(items):
      domain = getattr(item, "domain", None)
      if not isinstance(domain, str):
        raise ValueError(f"DomainBalancedStream needs items with a str .domain; item {i} is a "
                         f"{type(item).__name__} with domain {domain!r}")
      groups.setdefault(domain, []).append(item)
    self.domains, self.seed, self.size = tuple(groups), int(seed), len(items)
    self.streams = [PromptStream(groups[d], seed=self.seed + 1_000_003 * k, shuffle=shuffle)
                    for k, d in enumerate(self.domains)]
    self.draws = 0

  def __iter__(self) -> "DomainBalancedStream":
    return self

  def __next__(self):
    item = next(self.streams[self.draws % len(self.streams)])
    self.draws += 1
    return item

  def get_state(self) -> dict:
    return {"draws": self.draws, "domains": list(self.domains), "size": self.size,
            "streams": [s.get_state() for s in self.streams]}

  def set_state(self, state: Mapping[str, Any]) -> None:
    domains, draws, streams = state.get("domains"), state.get("draws"), state.get("streams")
    if domains is None or list(domains) != list(self.domains) or state.get("size") != self.size:
      raise ValueError(f"DomainBalancedStream state was saved for domains {domains} over "
                       f"{state.get('size')} prompts, this stream has {list(self.domains)} over "
                       f"{self.size}")
    if not (isinstance(draws, int) and draws >= 0 and isinstance(streams, Sequence)
            and len(streams) == len(self.streams)):
      raise ValueError(f"DomainBalancedStream state {dict(state)} has an invalid draws/streams")
    for stream, s in zip(self.streams, streams):
      stream.set_state(s)
    self.draws = draws


def prompt_stream(items: Sequence[Any], cfg: RolloutConfig, *,
                  seed: int = 0) -> PromptStream | DomainBalancedStream:
  """The prompt stream ``cfg`` asks for: a ``DomainBalancedStream`` with
  ``cfg.domain_balance``, else a ``PromptStream``."""
  if not isinstance(cfg, RolloutConfig):
    raise ValueError(f"cfg must be a RolloutConfig, got {type(cfg).__name__}")
  cls = DomainBalancedStream if cfg.domain_balance else PromptStream
  return cls(items, seed=seed)


class PromptPosition:
  """``get_state``/``set_state`` of a batch source whose whole state is the
  position of its prompt iterator ``self.prompts`` (GRPO's, OPD's)."""

  prompts: Iterator

  def get_state(self) -> dict:
    if not hasattr(self.prompts, "get_state"):
      raise ValueError(f"the prompt iterator {type(self.prompts).__name__} has no get_state()")
    return {"prompts": self.prompts.get_state()}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if not hasattr(self.prompts, "set_state") or "prompts" not in state:
      raise ValueError(f"cannot restore prompt position {dict(state)} into "
                       f"{type(self.prompts).__name__}")
    self.prompts.set_state(state["prompts"])


def prompt_problem(ex: Any, tokenizer, cfg: RolloutConfig, *, custom_reward: bool) -> str | None:
  """Why ``ex`` cannot be rolled out and trained on, or None.

  ``custom_reward``: the rewards come from the caller (or are not needed),
  so a domain without a verifier is fine.
  """
  if not isinstance(ex, Example):
    return f"not an Example but {type(ex).__name__}"
  known = ex.domain in ALL_DOMAINS
  if not known and not custom_reward:
    return f"no verifier for domain {ex.domain!r} (domains: {ALL_DOMAINS})"
  try:
    if known and is_multi_turn(ex.domain):
      get_task(ex.domain).make_env().reset(ex)  # the environment accepts its prompt
    n = len(policy_lib.prompt_ids(tokenizer, ex))
  except Exception as e:  # noqa: BLE001 - a malformed prompt is data, not a crash
    return f"cannot render: {type(e).__name__}: {e}"
  if n + cfg.max_new_tokens - 1 > cfg.seq_len:
    return (f"prompt of {n} tokens + max_new_tokens={cfg.max_new_tokens} does not fit "
            f"seq_len={cfg.seq_len}")
  return None


def draw_prompts(stream: Iterator, n: int, problem: Callable[[Any], str | None],
                 stats: RewardStats) -> list[Example] | None:
  """``n`` good prompts (None when the stream ends); bad ones are counted in
  ``stats`` as ``bad_example`` (a pipeline error, not a policy failure)."""
  out, bad = [], []
  while len(out) < n:
    try:
      ex = next(stream)
    except StopIteration:
      return None
    why = problem(ex)
    if why is None:
      out.append(ex)
      continue
    stats.add(Reward(0.0, 0.0, {}, f"bad_example:{why}"[:300]))
    bad.append(why)
    if len(bad) > 4 * n:  # never loop forever on a stream of garbage
      raise VerifierFailureError(f"{len(bad)} malformed prompts while drawing {n} good ones; "
                                 f"e.g. {bad[0]!r}")
  return out


def sample_groups(policy: Policy, examples: Sequence[Example], cfg: RolloutConfig,
                  key: jax.Array, step: int, sampling: SamplingConfig,
                  **rollout_kwargs: Any) -> list[Episode]:
  """``opd.rollout.rollout`` of each example ``cfg.group_size`` times.

  Row ``p * G + g`` is sample g of ``examples[p]`` (group advantages and
  GRPO terms reshape to ``[P, G]`` relying on it). The key is
  ``fold_in(key, step)``; the sampler runs ``cfg.batch_size`` rows per call
  (fixed, so a batch mixing single-turn and agent prompts does not
  recompile as its parts change size).

  Args:
    rollout_kwargs: passed to ``rollout`` (``log``, ``verify``, ``task_kwargs``).
  """
  group = [ex for ex in examples for _ in range(cfg.group_size)]
  return episodes_lib.rollout(policy, group, jax.random.fold_in(key, step), sampling,
                              batch_size=cfg.batch_size, **rollout_kwargs)


def training_length(episodes: Sequence[Episode], seq_len: int, length_bucket: int) -> int:
  """Row length of a step's training arrays: the longest episode (prompt +
  response − 1 targets) rounded up to ``length_bucket``, capped at ``seq_len``
  (``length_bucket`` 0: always ``seq_len``)."""
  if not length_bucket:
    return seq_len
  longest = max(len(ep.prompt_ids) + len(ep.response_ids) - 1 for ep in episodes)
  return min(seq_len, length_bucket * -(-longest // length_bucket))


def fit_episode(ep: Episode, seq_len: int) -> tuple[Episode, bool]:
  """Cuts an episode's response so it fits ``seq_len`` (only multi-turn ones can overflow)."""
  room = seq_len + 1 - len(ep.prompt_ids)
  if len(ep.response_ids) <= room:
    return ep, False
  return dataclasses.replace(ep, response_ids=ep.response_ids[:room],
                             policy_mask=ep.policy_mask[:room], logprobs=ep.logprobs[:room]), True


def training_arrays(episodes: Sequence[Episode], *, seq_len: int, length_bucket: int,
                    pad_id: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """``(host, cut)``: ``batch_episodes`` of the episodes fitted to ``seq_len``, padded
  to their ``training_length``, and ``cut [B]`` bool, which episodes were cut."""
  fitted = [fit_episode(ep, seq_len) for ep in episodes]
  kept = [f[0] for f in fitted]
  host = episodes_lib.batch_episodes(kept, seq_len=training_length(kept, seq_len, length_bucket),
                                     pad_id=pad_id)
  return host, np.asarray([f[1] for f in fitted], bool)
