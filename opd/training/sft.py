"""Supervised fine-tuning on the task suite's reference conversations (docs/DESIGN.md §5).

Each training example is a task's reference conversation rendered by
``opd.text.chat`` with the loss masked to the assistant's tokens
(``render_for_training``); agent examples keep their tool turns as
(untrained) context. ``train_sft`` draws the examples of some domains
(``opd.tasks.domain_examples``), batches them (``opd.training.data``) and
runs ``opd.training.lm_trainer.train_lm``; the ``sft`` job, the distillation
job's teacher building and the baselines' specialists all call it.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from opd import tasks as tasks_lib
from opd.config.fields import check_int, set_field
from opd.models import ModelConfig
from opd.text import chat
from opd.text.tokenizers import ByteTokenizer, check_vocab
from opd.training import data as data_lib
from opd.training import lm_trainer
from opd.training.loop_config import RunIO, Runtime
from opd.training.metrics_writer import MetricWriter
from opd.training.train_step import OptimConfig, TrainState


def sft_pairs(examples: Sequence[tasks_lib.Example], tok) -> list[tuple[np.ndarray, np.ndarray]]:
  """``(ids, loss_mask)`` per example: BOS + rendered conversation, assistant spans trained."""
  return [chat.render_for_training(chat.from_raw(ex.messages()), tok) for ex in examples]


def sft_batches(pairs, tok, model_cfg: ModelConfig, *, seq_len: int, batch_size: int, seed: int,
                mode: str = "pack", num_epochs: int | None = None, drop_remainder: bool = True):
  """Padded or packed SFT batches; packing is exact (the model masks
  attention by ``segment_ids``) and wastes far less compute on short chats."""
  return data_lib.sft_dataset(pairs, data_lib.DataConfig(
      seq_len=seq_len, batch_size=batch_size, seed=seed, mode=mode, num_epochs=num_epochs,
      pad_id=tok.pad_id, vocab_size=model_cfg.vocab_size, too_long="truncate",
      drop_remainder=drop_remainder))


@dataclasses.dataclass(frozen=True)
class SFTData:
  """What ``train_sft`` trains and evaluates on.

  Attributes:
    domains: task domains (``opd.tasks.ALL_DOMAINS``).
    num_train: train examples per domain (i.i.d. draws).
    num_eval: held-out test examples per domain (unique).
    difficulties: the levels the examples spread over.
    seq_len: tokens per row (longer conversations are truncated).
    batch_size: global rows per step (divisible by the process count).
    mode: "pack" or "pad" (``opd.training.data.sft_dataset``).
    replay_domains: other domains whose examples are mixed into the train set
      (experience replay against forgetting; docs/RESULTS.md, "A stronger toy
      world"); held-out examples stay those of ``domains``.
    replay_fraction: the share of the train examples drawn from
      ``replay_domains`` (evenly), in [0, 1); 0 trains ``domains`` only.
  """
  domains: tuple[str, ...]
  num_train: int
  num_eval: int
  difficulties: tuple[int, ...]
  seq_len: int
  batch_size: int
  mode: str = "pack"
  replay_domains: tuple[str, ...] = ()
  replay_fraction: float = 0.0

  @property
  def num_replay(self) -> int:
    """Train examples per replay domain: ``f / (1 − f)`` of the trained
    domains' examples, split evenly over ``replay_domains``."""
    if not self.replay_domains or not self.replay_fraction:
      return 0
    own = self.num_train * len(self.domains)
    total = own * self.replay_fraction / (1.0 - self.replay_fraction)
    return max(1, round(total / len(self.replay_domains)))

  def __post_init__(self):
    set_field(self, "domains", tuple(self.domains))
    set_field(self, "difficulties", tuple(int(d) for d in self.difficulties))
    if not self.domains or not self.difficulties:
      raise ValueError(f"SFTData.domains={self.domains} and difficulties={self.difficulties} "
                       "must be non-empty")
    for name in ("num_train", "num_eval", "seq_len", "batch_size"):
      set_field(self, name, check_int("SFTData", name, getattr(self, name), min_value=1))
    set_field(self, "replay_domains", tuple(self.replay_domains))
    f = self.replay_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
      raise ValueError(f"SFTData.replay_fraction={f!r}: expected a float in [0, 1)")
    if f and not self.replay_domains:
      raise ValueError(f"SFTData.replay_fraction={f} needs replay_domains (the domains to "
                       "replay)")
    overlap = set(self.replay_domains) & set(self.domains)
    if overlap:
      raise ValueError(f"SFTData.replay_domains={self.replay_domains} repeats the trained "
                       f"domains {sorted(overlap)}")
    if self.mode not in ("pack", "pad"):
      raise ValueError(f"SFTData.mode={self.mode!r}: expected 'pack' or 'pad'")
    if self.batch_size % jax.process_count():
      raise ValueError(f"SFTData.batch_size={self.batch_size} is not divisible by the "
                       f"{jax.process_count()} processes")


def train_sft(model_cfg: ModelConfig, params, data: SFTData, workdir: str | pathlib.Path, *,
              optim: OptimConfig, loop: lm_trainer.LMTrainConfig, runtime: Runtime,
              run_config: Mapping[str, Any] | None = None, first_metrics: dict | None = None
              ) -> tuple[TrainState, list[tuple[int, dict[str, float]]]]:
  """SFT ``params`` on ``data``'s domains, checkpointed and logged under ``workdir``.

  ``params`` may be a ``opd.training.lora_state.LoRAStudent`` (adapters on a
  frozen base, as in ``train_lm``). Text is encoded with ``runtime.tokenizer``
  (None: the byte tokenizer).
  Train examples are drawn with ``runtime.seed``, held-out ones with ``seed + 1``;
  step metrics reach ``workdir``'s ``MetricWriter`` every ``loop.steps // 50``
  steps (eval metrics and step 1 always). ``first_metrics`` gets step 1's
  metrics at key 1, the original run's after a resume (``opd.training.loop.train``).

  Returns:
    ``(state, history)``: the final state and every ``(step, metrics)``.
  """
  tok = runtime.tokenizer if runtime.tokenizer is not None else ByteTokenizer()
  check_vocab(tok, model_cfg)
  d, seed = data, runtime.seed
  examples = tasks_lib.domain_examples(d.domains, "train", d.num_train, seed, d.difficulties)
  if d.num_replay:  # shuffled in with the trained domains by sft_batches
    examples += tasks_lib.domain_examples(d.replay_domains, "train", d.num_replay, seed + 2,
                                          d.difficulties)
  train = sft_pairs(examples, tok)
  held = sft_pairs(tasks_lib.domain_examples(d.domains, "test", d.num_eval, seed + 1,
                                             d.difficulties, unique=True), tok)
  train_iter = iter(sft_batches(train, tok, model_cfg, seq_len=d.seq_len, mode=d.mode,
                                batch_size=d.batch_size // jax.process_count(), seed=seed))
  eval_batches = list(sft_batches(held, tok, model_cfg, seq_len=d.seq_len, mode=d.mode,
                                  batch_size=min(d.batch_size, len(held)), seed=0, num_epochs=1,
                                  drop_remainder=False))
  every = max(1, loop.steps // 50)
  history: list[tuple[int, dict[str, float]]] = []
  with MetricWriter(workdir) as writer:

    def on_metrics(step: int, metrics: Mapping[str, float]) -> None:
      history.append((step, dict(metrics)))
      if any(k.startswith("eval/") for k in metrics) or step % every == 0 or step == 1:
        writer.write_scalars(step, metrics)

    io = RunIO(checkpoint_dir=pathlib.Path(workdir) / "checkpoints", on_metrics=on_metrics,
               config={"model": model_cfg.to_dict(), **(run_config or {})},
               first_metrics=first_metrics)
    state = lm_trainer.train_lm(model_cfg, train_iter, optim, loop, io, runtime=runtime,
                                params=params, eval_batches=eval_batches)
  return state, history
