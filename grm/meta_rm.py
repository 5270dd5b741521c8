"""The meta-RM: a scalar-head model that judges a GRM judgement (docs/DESIGN.md §6).

Its input is the GRM's conversation, prompt and sampled judgement text
(``meta_input_ids``); its output a logit ``m`` that the judgement is correct
(``grm.correctness``). It is trained with binary cross-entropy on those
labels::

  L = mean_b  -[y_b log sigmoid(m_b) + (1 - y_b) log(1 - sigmoid(m_b))]
    = mean_b  softplus(m_b) - y_b m_b

and guides voting (``grm.voting.meta_vote`` keeps the top k_meta samples;
``weighted_vote`` with ``sigmoid(m)`` weights). Its training rows are the
*valid* judgements only (``training_rows``): voting ranks valid samples
alone, and an invalid one, labelled wrong, would teach it validity, which
parsing already decides. It is a decoder of our family
with ``scalar_head=True``; ``add_scalar_head`` starts one from a GRM's
parameters with a fresh head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grm.correctness import is_correct
from grm.format import GRMPrompt, prompt_ids
from grm.scalar_rm import pad_rows, score_sequences, sequence_rewards
from opd.models import ModelConfig, init_params

META_KEYS = ("tokens", "mask", "labels")


def add_scalar_head(cfg: ModelConfig, params, rng) -> tuple[ModelConfig, dict]:
  """``(cfg with scalar_head=True, params + a freshly initialised value head)``.

  The decoder trunk and LM head are kept as given (e.g. a trained GRM's).
  """
  if cfg.scalar_head:
    raise ValueError("ModelConfig.scalar_head is already True")
  new_cfg = cfg.replace(scalar_head=True)
  fresh = init_params(new_cfg, rng)
  out = dict(params)
  out["value_head"], out["value_bias"] = fresh["value_head"], fresh["value_bias"]
  return new_cfg, out


def binary_cross_entropy(logits, labels):
  """Mean BCE of logits against labels in [0, 1], ``softplus(m) - y m``: [B], [B] -> []."""
  return jnp.mean(jax.nn.softplus(logits) - labels * logits)


def meta_loss_fn(cfg: ModelConfig):
  """``loss_fn(params, batch, rng)`` of the meta-RM for ``make_train_step``.

  The batch holds ``tokens``, ``mask`` (``[B, T]``) and ``labels`` (``[B]``
  float, 1 = the judgement was correct). Metrics: ``accuracy`` (``m > 0``
  agrees with the label) and ``positive_rate`` (mean label).
  """

  def loss_fn(params, batch, rng):
    del rng
    missing = [k for k in META_KEYS if k not in batch]
    if missing:
      raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
    logits = sequence_rewards(cfg, params, batch["tokens"], batch["mask"].astype(bool))
    labels = batch["labels"].astype(jnp.float32)
    agree = (logits > 0).astype(jnp.float32) == labels
    return binary_cross_entropy(logits, labels), {
        "accuracy": jnp.mean(agree.astype(jnp.float32)), "positive_rate": jnp.mean(labels)}

  return loss_fn


def training_rows(groups, samples) -> list[tuple]:
  """``(sample, label)`` for every valid judgement of ``samples`` (``[E][k]``
  ``grm.judge.SampledJudgement``s of the E ``groups``), label 1.0 when it is
  correct (``grm.correctness.is_correct``) else 0.0; invalid ones are left out."""
  if len(groups) != len(samples):
    raise ValueError(f"groups ({len(groups)}) and samples ({len(samples)}) differ in length")
  return [(s, float(is_correct(s.scores, g.ratings))) for g, row in zip(groups, samples)
          for s in row if s.judgement.valid]


def meta_input_ids(tokenizer, prompt: GRMPrompt, judgement_text: str) -> np.ndarray:
  """``[T]`` int32 ids the meta-RM reads: the GRM prompt, then the judgement.

  The text is re-encoded as the sampler decoded it (special-token strings
  become their ids again), so the meta-RM reads what the GRM wrote; its value
  is read after the last judgement token.
  """
  if not isinstance(judgement_text, str):
    raise ValueError(f"judgement_text must be a str, got {type(judgement_text).__name__}")
  body = tokenizer.encode(judgement_text)
  ids = np.concatenate([prompt_ids(tokenizer, prompt), np.asarray(body, np.int32)])
  return ids.astype(np.int32)


def meta_batch(tokenizer, prompts, texts, labels, *, seq_len: int) -> dict[str, np.ndarray]:
  """A host batch for ``meta_loss_fn`` from GRM prompts, judgement texts and 0/1 labels."""
  if not (len(prompts) == len(texts) == len(labels)) or not prompts:
    raise ValueError(f"prompts ({len(prompts)}), texts ({len(texts)}) and labels "
                     f"({len(labels)}) must be non-empty and of equal length")
  tokens, mask = pad_rows([meta_input_ids(tokenizer, p, t) for p, t in zip(prompts, texts)],
                          seq_len, tokenizer.pad_id)
  return {"tokens": tokens, "mask": mask, "labels": np.asarray(labels, np.float32)}


def meta_scores(cfg: ModelConfig, params, tokenizer, samples, *, seq_len: int,
                batch_size: int = 32, length_bucket: int | None = None) -> np.ndarray:
  """``[N]`` meta-RM logits of ``grm.judge.SampledJudgement``s (batched;
  ``length_bucket`` as ``grm.scalar_rm.score_sequences``)."""
  seqs = [meta_input_ids(tokenizer, s.prompt, s.text) for s in samples]
  return score_sequences(cfg, params, seqs, seq_len=seq_len, pad_id=tokenizer.pad_id,
                         batch_size=batch_size, length_bucket=length_bucket)
