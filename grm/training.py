"""Training the pointwise GRM: cold start, rejective fine-tuning, rule-based RL (docs/DESIGN.md §6).

Three stages, each on train-split ``grm.data.PreferenceGroup``s:

**(a) Cold-start SFT** (``cold_start_pairs``): each group's prompt (responses
in a seeded order) and the rule-based judge's correct judgement
(``grm.data.rule_judgement``) become one chat conversation, a user turn and
an assistant turn; the loss mask covers only the assistant turn (the
judgement and its closing ``<|end|>``), as the task SFT does
(``opd.text.chat.render_for_training``). ``train_judgement_sft`` runs the
shared SFT objective on the one host loop (``opd.training.lm_trainer``).

**(b) Rejective fine-tuning** (``rejective_sample``): N_RFT judgements per
group in one batched sampler call (``grm.judge``). A sample is rejected when
incorrect (``grm.correctness``; invalid and truncated samples included). A
group whose N_RFT samples are *all* correct is dropped as too easy (none of
its samples kept). A group with *no* correct sample gets one hinted sample
(the prompt ends "The best response is: Response j"), kept only when
correct; its SFT target is paired with the same prompt **without** the hint
line, so the model learns to judge without it. Counts of every kind are
returned (``RFT_COUNTS``) and logged by the job; the kept pairs go through
the same SFT as (a).

**(c) Rule-based online RL** (``train_rule_rl``): GRPO (``opd.rl.train_grpo``)
on GRM prompts wrapped as task ``Example``s of domain ``"grm"`` (no task
verifier; rollouts skip verification because a ``reward_fn`` is given).
``RuleReward`` parses each rollout's judgement, maps its scores back to the
original order and returns +1 when correct, -1 otherwise (a truncated
rollout is -1); there is no format reward. The KL coefficient is
``kl_multiplier`` times the policy-RL config's (default 2x): the GRM should
stay near its SFT distribution while learning to be right.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable, Sequence

import numpy as np

from grm import judge as judge_lib
from grm.correctness import best_index, is_correct, rule_reward
from grm.data import PreferenceGroup, rule_judgement
from grm.format import HINT_PREFIX, GRMPrompt, build_prompt, unshuffle
from grm.parse import parse_judgement
from opd.models import ModelConfig
from opd.rl import GRPOConfig, GRPOExtras, train_grpo
from opd.tasks import Example
from opd.text import chat
from opd.training import data as data_lib
from opd.training import lm_trainer
from opd.training.loop_config import LoopConfig, RunIO, Runtime

log = logging.getLogger(__name__)

GRM_DOMAIN = "grm"
RFT_COUNTS = ("groups", "samples", "rejected_incorrect", "rejected_invalid", "too_easy_groups",
              "too_easy_samples", "kept_sampled", "hinted_groups", "hinted_kept",
              "hinted_rejected", "kept")

# sample_fn(groups, k, seed, hints) -> [E][k] SampledJudgement (grm.judge.sample_judgements)
SampleFn = Callable[[Sequence[tuple[str, tuple[str, ...]]], int, int, Sequence[int | None] | None],
                    list[list[judge_lib.SampledJudgement]]]


def judgement_pair(tokenizer, prompt: GRMPrompt | str, text: str
                   ) -> tuple[np.ndarray, np.ndarray]:
  """``(ids [T] int32, loss_mask [T] bool)`` of one SFT conversation.

  ``prompt`` is a ``GRMPrompt`` or a user message (e.g. a pairwise judge's
  prompt). The ids start with exactly ``grm.format.user_prompt_ids`` of it
  (what the sampler is prompted with) and the mask is True only on the
  judgement's tokens and the closing ``<|end|>``.
  """
  user = prompt.text if isinstance(prompt, GRMPrompt) else prompt
  if not isinstance(user, str) or not isinstance(text, str):
    raise ValueError(f"prompt and text must be str (or a GRMPrompt), got "
                     f"{type(prompt).__name__}, {type(text).__name__}")
  messages = [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
  return chat.render_for_training(chat.from_raw(messages), tokenizer)


def cold_start_pairs(groups: Sequence[PreferenceGroup], *, seed: int, noise: float = 0.2,
                     principles: int = 2, critique: bool = True
                     ) -> list[tuple[GRMPrompt, str]]:
  """``(prompt, judgement)`` per group from the rule-based judge; group i uses
  principle/noise seed ``(seed, i, 0)`` and response order ``(seed, i, 1)``;
  ``principles`` and ``critique`` size the judgement (``grm.data.rule_judgement``)."""
  return [rule_judgement(g, seed=(int(seed), i, 0), noise=noise, shuffle_seed=(int(seed), i, 1),
                         principles=principles, critique=critique)
          for i, g in enumerate(groups)]


def sft_batches(tokenizer, model_cfg: ModelConfig, pairs: Sequence[tuple[GRMPrompt | str, str]], *,
                seq_len: int, batch_size: int, seed: int, num_epochs: int | None = None,
                drop_remainder: bool = True):
  """Packed SFT batches (``opd.training.data.sft_dataset``) of ``(prompt, target)``
  pairs (``judgement_pair``)."""
  if not pairs:
    raise ValueError("pairs is empty: nothing to fine-tune on")
  examples = [judgement_pair(tokenizer, p, t) for p, t in pairs]
  return data_lib.sft_dataset(examples, data_lib.DataConfig(
      seq_len=seq_len, batch_size=batch_size, seed=seed, mode="pack", num_epochs=num_epochs,
      pad_id=tokenizer.pad_id, vocab_size=model_cfg.vocab_size, too_long="truncate",
      drop_remainder=drop_remainder))


def train_judgement_sft(model_cfg: ModelConfig, params, pairs: Sequence[tuple[GRMPrompt, str]],
                        *, optim, loop: lm_trainer.LMTrainConfig, io: RunIO | None = None,
                        runtime: Runtime, seq_len: int, batch_size: int,
                        eval_pairs: Sequence[tuple[GRMPrompt, str]] = ()):
  """SFT of the GRM on judgement pairs (stages a and b); returns the ``TrainState``.

  ``runtime.tokenizer`` renders the pairs; ``io`` (checkpoint directory,
  ``on_metrics``, ...) as in ``opd.training.lm_trainer.train_lm``.
  """
  tokenizer, seed = runtime.tokenizer, runtime.seed
  if tokenizer is None:
    raise ValueError("train_judgement_sft renders text: Runtime.tokenizer must be set, got None")
  batches = iter(sft_batches(tokenizer, model_cfg, pairs, seq_len=seq_len,
                             batch_size=batch_size, seed=seed))
  eval_batches = []
  if eval_pairs:
    eval_batches = list(sft_batches(tokenizer, model_cfg, eval_pairs, seq_len=seq_len,
                                    batch_size=min(batch_size, len(eval_pairs)), seed=0,
                                    num_epochs=1, drop_remainder=False))
  return lm_trainer.train_lm(model_cfg, batches, optim, loop, io, runtime=runtime,
                             params=params, eval_batches=eval_batches)


def model_sampler(policy, sampling, **kwargs) -> SampleFn:
  """A ``SampleFn`` backed by ``grm.judge.sample_judgements`` of ``policy`` (an
  ``opd.rollout.Policy``; one batched call; ``kwargs`` go to it, e.g.
  ``chunking`` or a ``progress`` label)."""

  def sample_fn(groups, k, seed, hints):
    return judge_lib.sample_judgements(policy, groups, k=k, seed=seed, sampling=sampling,
                                       hints=hints, **kwargs)

  return sample_fn


def _unhinted(prompt: GRMPrompt) -> GRMPrompt:
  head, sep, _ = prompt.text.rpartition("\n\n" + HINT_PREFIX)
  if not sep:
    raise ValueError(f"prompt has no hint line: {prompt.text[-80:]!r}")
  return dataclasses.replace(prompt, text=head, hint=None)


def rejective_sample(groups: Sequence[PreferenceGroup], sample_fn: SampleFn, *, n_rft: int,
                     seed: int) -> tuple[list[tuple[GRMPrompt, str]], dict[str, int]]:
  """Rejective sampling of stage (b) (module docstring).

  Args:
    groups: train-split preference groups.
    sample_fn: ``sample_fn(pairs, k, seed, hints)`` (``model_sampler``).
    n_rft: samples per group (>= 1).
    seed: the plain samples use ``seed``, the hinted ones ``seed + 1``.

  Returns:
    ``(kept, counts)``: kept ``(prompt, text)`` SFT pairs (hinted ones with
    the hint line removed) and the counts named in ``RFT_COUNTS``.
  """
  if isinstance(n_rft, bool) or not isinstance(n_rft, int) or n_rft < 1:
    raise ValueError(f"n_rft={n_rft!r} must be an int >= 1")
  counts = collections.Counter({k: 0 for k in RFT_COUNTS})
  kept: list[tuple[GRMPrompt, str]] = []
  if not groups:
    return kept, dict(counts)
  pairs = [(g.query, g.responses) for g in groups]
  samples = sample_fn(pairs, n_rft, int(seed), None)
  none_correct = []
  for g, row in zip(groups, samples):
    ok = [is_correct(s.scores, g.ratings) for s in row]
    counts["groups"] += 1
    counts["samples"] += len(row)
    counts["rejected_incorrect"] += ok.count(False)
    counts["rejected_invalid"] += sum(not s.judgement.valid for s in row)
    if all(ok):
      counts["too_easy_groups"] += 1
      counts["too_easy_samples"] += len(row)
    elif not any(ok):
      none_correct.append(g)
    else:
      kept += [(s.prompt, s.text) for s, c in zip(row, ok) if c]
      counts["kept_sampled"] += ok.count(True)
  if none_correct:
    hints = [best_index(g.ratings) for g in none_correct]
    hinted = sample_fn([(g.query, g.responses) for g in none_correct], 1, int(seed) + 1, hints)
    for g, row in zip(none_correct, hinted):
      counts["hinted_groups"] += 1
      s = row[0]
      if is_correct(s.scores, g.ratings):
        counts["hinted_kept"] += 1
        kept.append((_unhinted(s.prompt), s.text))
      else:
        counts["hinted_rejected"] += 1
  counts["kept"] = len(kept)
  return kept, dict(counts)


def rl_examples(groups: Sequence[PreferenceGroup], *, seed: int) -> list[Example]:
  """GRM prompts as ``Example``s of domain ``"grm"`` for ``train_grpo``.

  Group i's responses are shown in the order ``(seed, i)``; ``meta`` holds
  the order and the ratings ``RuleReward`` needs; the reference is the
  rule-based judgement (for logging only).
  """
  out = []
  for i, g in enumerate(groups):
    prompt = build_prompt(g.query, g.responses, seed=(int(seed), i))
    out.append(Example(domain=GRM_DOMAIN, id=f"grm-{g.domain}-{g.example_id}-{i}", split=g.split,
                       difficulty=1, prompt=prompt.text, reference=(),
                       meta={"order": list(prompt.order), "ratings": list(g.ratings),
                             "source_domain": g.domain}))
  return out


class RuleReward:
  """``reward_fn(episodes) -> [B]`` of +1 (correct judgement) / -1 (otherwise).

  The judgement is the episode's last turn; a truncated episode scores -1
  (as ``grm.judge`` marks it invalid). Counts of the parse reasons of the
  last call are kept in ``last_reasons``.
  """
  component_names = None

  def __init__(self):
    self.last_reasons: dict[str, int] = {}

  def __call__(self, episodes) -> np.ndarray:
    out = np.empty(len(episodes), np.float64)
    reasons = collections.Counter()
    for b, ep in enumerate(episodes):
      meta = ep.example.meta
      if "order" not in meta or "ratings" not in meta:
        raise ValueError(f"episode {b} example {ep.example.id!r} is not a GRM example "
                         "(meta needs 'order' and 'ratings'; see rl_examples)")
      order = tuple(meta["order"])
      text = ep.turns[-1] if ep.turns else ""
      j = parse_judgement(text, len(order))
      reason = judge_lib.TRUNCATED if ep.truncated else j.reason
      reasons[reason or "valid"] += 1
      scores = unshuffle(j.scores, order) if reason is None else None
      out[b] = rule_reward(scores, meta["ratings"])
    self.last_reasons = dict(reasons)
    return out


def rule_rl_config(cfg: GRPOConfig, kl_multiplier: float = 2.0) -> GRPOConfig:
  """``cfg`` with ``kl_coef`` scaled by ``kl_multiplier`` (>= 1: the GRM's KL
  is larger than policy RL's)."""
  if not isinstance(cfg, GRPOConfig):
    raise ValueError(f"cfg must be a GRPOConfig, got {type(cfg).__name__}")
  if not np.isfinite(kl_multiplier) or kl_multiplier < 1.0:
    raise ValueError(f"kl_multiplier={kl_multiplier!r} must be a finite number >= 1")
  return dataclasses.replace(cfg, kl_coef=float(cfg.kl_coef) * float(kl_multiplier))


def train_rule_rl(model_cfg: ModelConfig, params, groups: Sequence[PreferenceGroup],
                  cfg: GRPOConfig, optim, loop: LoopConfig, io: RunIO | None = None, *,
                  runtime: Runtime, kl_multiplier: float = 2.0):
  """Stage (c): ``opd.rl.train_grpo`` on ``rl_examples(groups)`` with ``RuleReward``.

  The reference policy is ``params`` (the RFT model). ``loop``, ``io``
  (workdir, checkpoint_dir, on_metrics, ...) and ``runtime`` go to
  ``train_grpo``. Returns its ``GRPORun``.
  """
  rl_cfg = rule_rl_config(cfg, kl_multiplier)
  return train_grpo(model_cfg, params, params, rl_examples(groups, seed=runtime.seed), rl_cfg,
                    optim, loop, io, runtime=runtime, extras=GRPOExtras(reward_fn=RuleReward()))
