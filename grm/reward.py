"""Reward models as GRPO rewards (docs/DESIGN.md §6, §5).

Both callables follow ``opd.rl.scoring.score_episodes``'s ``reward_fn``
contract: ``reward_fn(episodes)`` returns one ``opd.tasks.Reward`` per
episode. ``opd`` never imports ``grm``; ``experiments/`` passes them to
``opd.rl.train_grpo(..., extras=GRPOExtras(reward_fn=...))``.

``GRMReward``: each episode's response (``response_text``) is judged
pointwise (n = 1) by a GRM, k samples per episode, all B·k prompts in one
sampler call (``grm.judge.sample_judgements``). The valid samples' scores
are voted (``grm.voting.vote``) and the mean score s in 1..10 maps to
``(s - 1) / 9`` in [0, 1]. An episode whose k samples are all invalid gets
``fallback`` with reason ``grm_invalid:<reason of its first sample>`` (so
``train_grpo`` logs ``reward_reason/grm_invalid``); its ``format`` is the
share of valid samples and ``components`` hold ``grm`` (the reward) and
``grm_valid`` (that share). ``last_metrics`` keeps the latest batch's
counts and ``totals`` the counts over every call.

``BTReward``: the Bradley–Terry RM (``grm.scalar_rm``) reads the query's
chat prompt followed by the response (``bt_input_ids``, the same input it is
trained on) and the reward is ``sigmoid(r)``; every episode is scored in
fixed-size batches (one compile).
"""
from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from grm.format import MAX_SCORE, MIN_SCORE, user_prompt_ids
from grm.judge import Chunking, invalid_sample_counts, sample_judgements, score_arrays
from grm.scalar_rm import score_sequences
from grm.voting import vote
from opd.config.fields import check_float, check_int
from opd.models import ModelConfig
from opd.rollout.episodes import Episode
from opd.rollout.policy import Policy
from opd.rollout.sampler import SamplingConfig
from opd.tasks import Reward

__all__ = ["BTReward", "GRMReward", "bt_input_ids", "rating_to_reward", "response_text"]


def response_text(ep: Episode) -> str:
  """What a reward model reads of an episode: its turns joined by blank lines
  (a single-turn episode: the assistant's answer)."""
  return "\n\n".join(ep.turns)


def rating_to_reward(score: float) -> float:
  """A GRM score in ``MIN_SCORE..MAX_SCORE`` (1..10) as a reward in [0, 1]."""
  if not MIN_SCORE <= score <= MAX_SCORE:
    raise ValueError(f"score={score!r} is outside {MIN_SCORE}..{MAX_SCORE}")
  return (float(score) - MIN_SCORE) / (MAX_SCORE - MIN_SCORE)


class GRMReward:
  """A pointwise GRM as a batched GRPO ``reward_fn`` (module docstring).

  Args:
    model_cfg, params, tokenizer: the GRM.
    sampling: the GRM's sampling (``opd.rollout.episodes.sampling_for_chat``).
    k: samples voted per episode (>= 1).
    fallback: reward in [0, 1] of an episode with no valid sample.
    seed: base seed; call c samples with seed ``seed + c`` (fresh shuffles
      and draws every batch, reproducible from the start of a run).
    batch_size, prompt_bucket, mesh, rules, constrained: as
      ``grm.judge.sample_judgements`` (``constrained``: the scores line decoded
      under its grammar).
  """

  def __init__(self, model_cfg: ModelConfig, params, tokenizer, *, sampling: SamplingConfig,
               k: int = 1, fallback: float = 0.0, seed: int = 0, batch_size: int | None = None,
               prompt_bucket: int = 32, mesh=None, rules=None, constrained: bool = False):
    check_int("GRMReward", "k", k, min_value=1)
    check_int("GRMReward", "seed", seed, min_value=0)
    self.fallback = check_float("GRMReward", "fallback", fallback, min_value=0.0, max_value=1.0)
    self.model_cfg, self.params, self.tokenizer = model_cfg, params, tokenizer
    self.sampling, self.k, self.seed = sampling, int(k), int(seed)
    self.policy = Policy(model_cfg, params, tokenizer, mesh, rules)
    self._kw = dict(chunking=Chunking(batch_size=batch_size, prompt_bucket=prompt_bucket),
                    constrained=bool(constrained))
    self.calls = 0
    self.last_samples: list = []
    self.last_metrics: dict[str, float] = {}
    self.totals: collections.Counter = collections.Counter()

  def __call__(self, episodes: Sequence[Episode]) -> list[Reward]:
    groups = [(ep.example.prompt, (response_text(ep),)) for ep in episodes]
    if not groups:
      return []
    samples = sample_judgements(self.policy, groups, k=self.k, seed=self.seed + self.calls,
                                sampling=self.sampling, **self._kw)
    self.calls += 1
    out = []
    for row in samples:
      scores, valid = score_arrays(row)
      result = vote(scores, valid)
      share = result.num_valid / self.k
      if result.num_valid:
        r = rating_to_reward(result.mean_scores[0])
        out.append(Reward(r, share, {"grm": r, "grm_valid": share}, "ok"))
      else:
        reason = f"grm_invalid:{row[0].judgement.reason}"
        out.append(Reward(self.fallback, 0.0, {"grm": self.fallback, "grm_valid": 0.0}, reason))
    flat = [s for row in samples for s in row]
    counts = invalid_sample_counts(flat)
    self.last_samples = samples
    self.last_metrics = {"samples": float(len(flat)),
                         "invalid_samples": float(sum(counts.values())),
                         "fallback_episodes": float(sum(r.reason != "ok" for r in out)),
                         **{f"invalid/{k}": float(v) for k, v in counts.items()}}
    self.totals.update(self.last_metrics)
    return out


def bt_input_ids(tokenizer, query: str, response: str) -> np.ndarray:
  """``[P + R]`` int32 ids the BT RM reads: the query's chat prompt
  (``grm.format.user_prompt_ids``), then the response's tokens."""
  return np.concatenate([user_prompt_ids(tokenizer, query),
                         np.asarray(tokenizer.encode(response), np.int32)])


class BTReward:
  """A Bradley–Terry scalar RM as a GRPO ``reward_fn``: ``sigmoid(r)`` per episode.

  Args:
    model_cfg, params, tokenizer: the RM (``scalar_head=True``).
    seq_len: its input length; longer inputs keep their first ``seq_len``
      tokens (the response cut as the sampler would cut it).
    batch_size: rows per forward pass.
  """

  def __init__(self, model_cfg: ModelConfig, params, tokenizer, *, seq_len: int,
               batch_size: int = 32):
    if not model_cfg.scalar_head:
      raise ValueError("BTReward: ModelConfig.scalar_head=False; a BT RM needs a scalar head")
    check_int("BTReward", "seq_len", seq_len, min_value=1)
    check_int("BTReward", "batch_size", batch_size, min_value=1)
    self.model_cfg, self.params, self.tokenizer = model_cfg, params, tokenizer
    self.seq_len, self.batch_size = int(seq_len), int(batch_size)

  def raw_scores(self, episodes: Sequence[Episode]) -> np.ndarray:
    """``[B]`` float32 scalar-head outputs r (before the sigmoid)."""
    seqs = [bt_input_ids(self.tokenizer, ep.example.prompt, response_text(ep))[:self.seq_len]
            for ep in episodes]
    return score_sequences(self.model_cfg, self.params, seqs, seq_len=self.seq_len,
                           pad_id=self.tokenizer.pad_id, batch_size=self.batch_size)

  def __call__(self, episodes: Sequence[Episode]) -> list[Reward]:
    r = 1.0 / (1.0 + np.exp(-self.raw_scores(episodes).astype(np.float64)))
    return [Reward(float(x), 1.0, {"bt": float(x)}, "ok") for x in r]

