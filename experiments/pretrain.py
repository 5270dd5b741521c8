"""Job ``pretrain``: the tiny base model, next-token trained on task text.

The corpus is ``opd.tasks.mixture_corpus`` — train-split conversations of
all five domains, each with its reference response with probability
``config.data.response_fraction`` and as the bare prompt otherwise — fed by
``opd.training.data.lm_dataset`` (grain). The held-out loss is measured on test-split
text. Writes checkpoints, TensorBoard events, ``metrics.jsonl``,
``curves.png`` and returns the final metrics. See
``experiments/configs/pretrain.py``.
"""
from __future__ import annotations

import logging
import random

import jax

from experiments import common
from opd.training import data as data_lib
from opd import rollout
from opd.training import lm_trainer
from opd.training.loop_config import RunIO, Runtime
from opd import tasks as tasks_lib
from opd.config.overrides import config_to_dict
from opd.models import to_model_config
from opd.training.metrics_writer import MetricWriter

log = logging.getLogger(__name__)


def corpus(n: int, seed: int, response_fraction: float, split: str = "train") -> list[str]:
  """``n`` documents; a ``response_fraction`` share carries the reference answer."""
  if not 0.0 <= response_fraction <= 1.0:
    raise ValueError(f"config.data.response_fraction must be in [0, 1], got {response_fraction!r}")
  n_full = round(n * response_fraction)
  docs = (tasks_lib.mixture_corpus(n_full, seed=seed, responses=True, split=split)
          + tasks_lib.mixture_corpus(n - n_full, seed=seed + 1, responses=False, split=split))
  random.Random(seed).shuffle(docs)
  return docs


def lm_batches(texts, tok, model_cfg, config, *, seed, num_epochs=None, batch_size=None):
  data = data_lib.DataConfig(
      seq_len=config.train.seq_len,
      batch_size=batch_size or common.per_process_batch(config.train.batch_size),
      seed=seed, mode=config.data.mode, num_epochs=num_epochs, pad_id=tok.pad_id,
      vocab_size=model_cfg.vocab_size)
  return data_lib.lm_dataset(texts, tok.encode, data, bos_id=tok.bos_id, eos_id=tok.eos_id)


def sample_text(model_cfg, params, tok, seed: int, mesh, rules, n: int = 4) -> str:
  """Greedy continuations of ``n`` held-out prompts, as markdown for TensorBoard."""
  examples = [tasks_lib.get_task(d).examples("test", 1, seed=seed)[0]
              for d in tasks_lib.ALL_DOMAINS[:n]]
  sampling = rollout.sampling_for_chat(tok, max_new_tokens=48, temperature=0.0)
  comps = rollout.sample(rollout.Policy(model_cfg, params, tok, mesh, rules),
                         [rollout.prompt_ids(tok, e) for e in examples], seed, sampling)
  return "\n\n".join(f"**{e.domain}** `{e.prompt}` → `{c.text}`" for e, c in zip(examples, comps))


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  model_cfg = to_model_config(config.model)
  tok = common.tokenizer_for(model_cfg, workdir)
  mesh, rules = common.mesh_and_rules(config)
  optim = common.optim_config(config.optim)
  texts = corpus(config.data.num_docs, config.seed, config.data.response_fraction)
  held_out = corpus(config.data.num_eval_docs, config.seed + 7, config.data.response_fraction,
                    split="test")
  train_iter = iter(lm_batches(texts, tok, model_cfg, config, seed=config.seed))
  eval_batches = list(lm_batches(held_out, tok, model_cfg, config, seed=0, num_epochs=1))
  loop = lm_trainer.LMTrainConfig(
      steps=config.train.steps, eval_every=config.train.eval_every,
      save_every=config.train.save_every, keep_checkpoints=config.train.keep_checkpoints,
      fused_loss=config.train.fused_loss)
  log.info("pretrain: %s params, %d docs, %d held-out batches", f"{model_cfg.num_params():,}",
           len(texts), len(eval_batches))
  first: dict = {}  # step 1's metrics, restored from the checkpoint on a resume
  with MetricWriter(workdir) as writer:
    logger = common.Logger(writer, every=config.train.log_every)
    state = lm_trainer.train_lm(
        model_cfg, train_iter, optim, loop,
        RunIO(checkpoint_dir=f"{workdir}/checkpoints", on_metrics=logger,
              config={"model": model_cfg.to_dict(), "experiment": config_to_dict(config)},
              first_metrics=first),
        runtime=Runtime(mesh, rules, seed=config.seed), eval_batches=eval_batches)
    final_eval = lm_trainer.evaluate_loss(lm_trainer.lm_loss(model_cfg), state.params,
                                          eval_batches, mesh, rules)
    step = int(state.step)
    writer.write_scalars(step, {f"eval/{k}": v for k, v in final_eval.items()})
    writer.write_histograms(step, {"params/" + "/".join(str(getattr(k, "key", k)) for k in path): v
                                   for path, v in jax.tree_util.tree_flatten_with_path(
                                       jax.device_get(state.params))[0] if v.ndim >= 2})
    writer.write_texts(step, {"samples": sample_text(model_cfg, state.params, tok, config.seed,
                                                     mesh, rules)})
  train_losses = [m["loss"] for _, m in logger.history if "loss" in m]
  tail = train_losses[-10:] or [float("nan")]
  summary = common.curve_summary(logger.history, "loss")
  plot = common.plot_curves(workdir, keys=("loss", "eval/loss"), title="pre-training loss")
  result = {
      "steps": int(state.step),
      "params": model_cfg.num_params(),
      "train_loss_first": first[1]["loss"] if 1 in first else float("nan"),
      "train_loss_final": sum(tail) / len(tail),
      "eval_loss": final_eval["loss"],
      "eval_accuracy": final_eval.get("accuracy", float("nan")),
      "wall_s": timer.seconds,
      "curve": summary,
      "plot": str(plot) if plot else "",
  }
  return result
