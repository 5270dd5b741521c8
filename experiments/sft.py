"""Job ``sft``: supervised fine-tuning of a model on one or more task domains.

Each training example is a task's reference conversation rendered by
``opd.text.chat`` with the loss masked to the assistant's tokens
(``render_for_training``); agent examples keep their tool turns as
(untrained) context. Starts from ``config.init`` (a checkpoint directory,
usually the base model's) and writes checkpoints, metrics and curves.
"""
from __future__ import annotations

import logging
import pathlib
from typing import Sequence

import numpy as np

from experiments import common
from opd.text import chat
from opd.training import data as data_lib
from opd.training import lm_trainer
from opd import tasks as tasks_lib
from opd.training.checkpoints import load_params
from opd.config.overrides import config_to_dict
from opd.models import to_model_config
from opd.training.metrics_writer import MetricWriter

log = logging.getLogger(__name__)


def sft_pairs(examples: Sequence[tasks_lib.Example], tok) -> list[tuple[np.ndarray, np.ndarray]]:
  """``(ids, loss_mask)`` per example: BOS + rendered conversation, assistant spans trained."""
  return [chat.render_for_training(chat.from_raw(ex.messages()), tok) for ex in examples]


def domain_examples(domains: Sequence[str], split: str, n: int, seed: int,
                    difficulties: Sequence[int], unique: bool = False) -> list[tasks_lib.Example]:
  """``n`` examples per domain, spread over ``difficulties``; i.i.d. draws
  (repeats allowed, as the problem space of an easy level can be small)
  unless ``unique``."""
  out = []
  for d in domains:
    task = tasks_lib.get_task(d)
    per = [n // len(difficulties) + (i < n % len(difficulties)) for i in range(len(difficulties))]
    for diff, k in zip(difficulties, per):
      out += task.examples(split, k, seed=seed, difficulty=diff, unique=unique)
  return out


def sft_batches(pairs, tok, model_cfg, *, seq_len, batch_size, seed, mode="pack",
                num_epochs=None, drop_remainder=True):
  """Padded or packed SFT batches; packing is exact (the model masks
  attention by ``segment_ids``) and wastes far less compute on short chats."""
  return data_lib.sft_dataset(pairs, seq_len=seq_len, batch_size=batch_size, seed=seed,
                              mode=mode, num_epochs=num_epochs, pad_id=tok.pad_id,
                              vocab_size=model_cfg.vocab_size, too_long="truncate",
                              drop_remainder=drop_remainder)


def train_sft(model_cfg, params, domains: Sequence[str], workdir: str | pathlib.Path, *,
              optim, loop: lm_trainer.LMTrainConfig, mesh, rules, seed: int, num_train: int,
              num_eval: int, difficulties: Sequence[int], seq_len: int, batch_size: int,
              mode: str = "pack", extra_eval=None, run_config=None):
  """SFT ``params`` on ``domains``; returns ``(state, logger)``."""
  tok = common.tokenizer_for(model_cfg)
  train = sft_pairs(domain_examples(domains, "train", num_train, seed, difficulties), tok)
  held = sft_pairs(domain_examples(domains, "test", num_eval, seed + 1, difficulties,
                                   unique=True), tok)
  train_iter = iter(sft_batches(train, tok, model_cfg, seq_len=seq_len, mode=mode,
                                batch_size=common.per_process_batch(batch_size), seed=seed))
  eval_batches = list(sft_batches(held, tok, model_cfg, seq_len=seq_len, mode=mode,
                                  batch_size=min(batch_size, len(held)), seed=0, num_epochs=1,
                                  drop_remainder=False))
  with MetricWriter(workdir) as writer:
    logger = common.Logger(writer, every=max(1, loop.steps // 50))
    state = lm_trainer.train_lm(
        model_cfg, train_iter, optim, loop, mesh=mesh, rules=rules, seed=seed, params=params,
        eval_batches=eval_batches, checkpoint_dir=pathlib.Path(workdir) / "checkpoints",
        on_metrics=logger, extra_eval=extra_eval,
        run_config={"model": model_cfg.to_dict(), **(run_config or {})})
  return state, logger


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  model_cfg = to_model_config(config.model)
  mesh, rules = common.mesh_and_rules(config)
  if not config.init:
    raise ValueError("config.init must name a checkpoint directory to fine-tune (e.g. the "
                     "base model's WORKDIR/checkpoints)")
  params = load_params(config.init, model_cfg, mesh=mesh, rules=rules)
  loop = lm_trainer.LMTrainConfig(steps=config.train.steps, eval_every=config.train.eval_every,
                                  save_every=config.train.save_every,
                                  keep_checkpoints=config.train.keep_checkpoints)
  state, logger = train_sft(
      model_cfg, params, tuple(config.data.domains), workdir,
      optim=common.optim_config(config.optim),
      loop=loop, mesh=mesh, rules=rules, seed=config.seed, num_train=config.data.num_train,
      num_eval=config.data.num_eval, difficulties=tuple(config.data.difficulties),
      seq_len=config.train.seq_len, batch_size=config.train.batch_size, mode=config.data.mode,
      run_config={"experiment": config_to_dict(config)})
  plot = common.plot_curves(workdir, keys=("loss", "eval/loss"), title="SFT loss")
  evals = [m for _, m in logger.history if "eval/loss" in m]
  losses = [m["loss"] for _, m in logger.history if "loss" in m]
  return {"steps": int(state.step),
          "train_loss_first": losses[0] if losses else float("nan"),
          "train_loss_final": float(np.mean(losses[-10:])),
          "eval_loss": evals[-1]["eval/loss"] if evals else float("nan"),
          "eval_accuracy": evals[-1].get("eval/accuracy", float("nan")) if evals else float("nan"),
          "wall_s": timer.seconds, "plot": str(plot or "")}
