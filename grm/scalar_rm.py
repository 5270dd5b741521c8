"""Scalar-head reward models: the Bradley–Terry baseline and the shared trainer (docs/DESIGN.md §6).

A scalar RM is a decoder of our family with ``scalar_head=True``
(docs/DESIGN.md §2): a linear ``[D, 1]`` head read at each row's last real
token, ``r = value(h_last)``. The Bradley–Terry RM is trained on preference
pairs with::

  L = mean_b  -log sigmoid(r(x, y+_b) - r(x, y-_b)) = mean_b softplus(r-_b - r+_b)

``train_reward_model`` runs any such loss (this one, the meta-RM's BCE in
``grm.meta_rm``) on the shared sharded step and host loop
(``opd.training.train_step``, ``opd.training.loop.train``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd.models import ModelConfig, forward, last_token_values
from opd.training import loop as train_loop
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.train_step import (OptimConfig, TrainState, init_train_state, make_optimizer,
                                     make_train_step, shard_batch)

PAIR_KEYS = ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask")


def _check_cfg(cfg: ModelConfig) -> None:
  if not cfg.scalar_head:
    raise ValueError("ModelConfig.scalar_head=False: a reward model needs scalar_head=True")


def sequence_rewards(cfg: ModelConfig, params, tokens, mask):
  """The scalar head at each row's last real token.

  Args:
    cfg: a config with ``scalar_head=True``.
    params: its parameters.
    tokens: ``[B, T]`` int ids; mask: ``[B, T]`` bool (left or right padding).

  Returns:
    ``[B]`` float32 rewards.
  """
  _check_cfg(cfg)
  out = forward(cfg, params, tokens, mask=mask, return_logits=False)
  return last_token_values(out.values, mask)


def bradley_terry_loss(r_chosen, r_rejected):
  """``mean softplus(r_rejected - r_chosen)`` = mean ``-log sigmoid(r+ - r-)``: [B], [B] -> []."""
  return jnp.mean(jax.nn.softplus(r_rejected - r_chosen))


def bt_loss_fn(cfg: ModelConfig):
  """``loss_fn(params, batch, rng)`` of the Bradley–Terry RM for ``make_train_step``.

  The batch holds ``PAIR_KEYS``, each ``[B, T]`` (``pair_batch``); chosen
  and rejected rows go through one forward pass. Metrics: ``accuracy``
  (share of pairs with ``r+ > r-``) and ``margin`` (mean ``r+ - r-``).
  """
  _check_cfg(cfg)

  def loss_fn(params, batch, rng):
    del rng
    missing = [k for k in PAIR_KEYS if k not in batch]
    if missing:
      raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
    B = batch["chosen_tokens"].shape[0]
    tokens = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]], axis=0)
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
    r = sequence_rewards(cfg, params, tokens, mask.astype(bool))
    r_chosen, r_rejected = r[:B], r[B:]
    loss = bradley_terry_loss(r_chosen, r_rejected)
    return loss, {"accuracy": jnp.mean((r_chosen > r_rejected).astype(jnp.float32)),
                  "margin": jnp.mean(r_chosen - r_rejected)}

  return loss_fn


def pad_rows(seqs: Sequence[Sequence[int]], seq_len: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded ``(tokens [B, T] int32, mask [B, T] bool)``; raises if a row exceeds T."""
  tokens = np.full((len(seqs), seq_len), pad_id, np.int32)
  mask = np.zeros((len(seqs), seq_len), bool)
  for i, s in enumerate(seqs):
    if not 1 <= len(s) <= seq_len:
      raise ValueError(f"row {i} has {len(s)} tokens; rows need 1..seq_len={seq_len}")
    tokens[i, :len(s)], mask[i, :len(s)] = s, True
  return tokens, mask


def pair_batch(chosen: Sequence[Sequence[int]], rejected: Sequence[Sequence[int]], *,
               seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """A host batch of preference pairs (``PAIR_KEYS``, each ``[B, seq_len]``)."""
  if len(chosen) != len(rejected) or not chosen:
    raise ValueError(f"chosen ({len(chosen)}) and rejected ({len(rejected)}) must be "
                     "non-empty and of equal length")
  ct, cm = pad_rows(chosen, seq_len, pad_id)
  rt, rm = pad_rows(rejected, seq_len, pad_id)
  return {"chosen_tokens": ct, "chosen_mask": cm, "rejected_tokens": rt, "rejected_mask": rm}


def score_sequences(cfg: ModelConfig, params, seqs: Sequence[Sequence[int]], *, seq_len: int,
                    pad_id: int, batch_size: int = 32,
                    length_bucket: int | None = None) -> np.ndarray:
  """``[N]`` float32 rewards of token sequences, in fixed-size batches.

  The last batch is padded with copies of the first row, dropped afterwards.
  ``length_bucket`` None: every batch is ``[batch_size, seq_len]`` (one
  compile). ``length_bucket`` L: rows are scored in order of length and each
  batch is cut to its longest row rounded up to a multiple of L (at most
  ``seq_len``): far fewer pad tokens when lengths vary, at most
  ``seq_len / L`` compiles. The value read is the same either way (the last
  real token's; right padding is masked).
  """
  if not seqs:
    return np.zeros(0, np.float32)
  if length_bucket is not None and (isinstance(length_bucket, bool) or not isinstance(
      length_bucket, (int, np.integer)) or length_bucket < 1):
    raise ValueError(f"length_bucket={length_bucket!r} must be an int >= 1 or None")
  fn = jax.jit(functools.partial(sequence_rewards, cfg))
  lengths = np.asarray([len(s) for s in seqs])
  order = np.arange(len(seqs)) if length_bucket is None else np.argsort(lengths, kind="stable")
  out = np.zeros(len(seqs), np.float32)
  for start in range(0, len(seqs), batch_size):
    idx = order[start:start + batch_size]
    chunk = [seqs[i] for i in idx]
    real = len(chunk)
    chunk += [chunk[0]] * (batch_size - real)
    width = seq_len
    if length_bucket is not None:
      width = min(seq_len, int(length_bucket) * -(-int(lengths[idx].max()) // int(length_bucket)))
    tokens, mask = pad_rows(chunk, width, pad_id)
    out[idx] = np.asarray(fn(params, tokens, mask))[:real]
  return out


def train_reward_model(cfg: ModelConfig, loss_fn: Callable, batches: Iterator[Mapping[str, Any]],
                       optim: OptimConfig, loop: LoopConfig, io: RunIO | None = None, *,
                       runtime: Runtime, params: Any | None = None) -> TrainState:
  """Trains a scalar-head model with ``loss_fn`` on the shared step and loop.

  Args:
    cfg: the model (``scalar_head=True``).
    loss_fn: ``bt_loss_fn(cfg)``, ``grm.meta_rm.meta_loss_fn(cfg)``, ...
    batches: host batches for ``loss_fn``.
    optim: optimizer settings.
    loop: ``loop.steps`` optimizer updates (a resumed run continues to this
      count), cadence, progress bar.
    io: checkpoints, ``on_metrics``, ... as in ``opd.training.loop.train``
      (``model`` added to its config).
    runtime: the mesh, logical rules and seed (init and per-step randomness).
    params: start from these (e.g. a GRM's trunk with a fresh head).

  Returns:
    The final ``TrainState``.
  """
  _check_cfg(cfg)
  mesh, rules = runtime.mesh, runtime.rules
  optimizer = make_optimizer(optim)
  state, shardings = init_train_state(cfg, optimizer, mesh, rules, rng=runtime.seed,
                                      params=params)
  step_fn = make_train_step(loss_fn, optimizer, mesh, shardings, rules=rules)
  io = (io if io is not None else RunIO()).with_config({"model": cfg.to_dict()})
  return train_loop.train(state, step_fn, batches, loop, io,
                          prepare_batch=functools.partial(shard_batch, mesh=mesh, rules=rules)
                          ).state
