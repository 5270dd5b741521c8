"""Job ``sft``: supervised fine-tuning of a model on one or more task domains.

The job wires ``config`` to ``opd.training.sft.train_sft`` (each example is a
task's reference conversation, the loss on the assistant's tokens). Starts
from ``config.init`` (a checkpoint directory, usually the base model's) and
writes checkpoints, metrics and curves.
"""
from __future__ import annotations

import numpy as np

from experiments import common
from opd.config.overrides import config_to_dict
from opd.models import to_model_config
from opd.training import lm_trainer
from opd.training.loop_config import Runtime
from opd.training.checkpoints import load_params
from opd.training.sft import SFTData, train_sft


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
  data = SFTData(domains=tuple(config.data.domains), num_train=config.data.num_train,
                 num_eval=config.data.num_eval, difficulties=tuple(config.data.difficulties),
                 seq_len=config.train.seq_len, batch_size=config.train.batch_size,
                 mode=config.data.mode,
                 replay_domains=tuple(config.data.get("replay_domains", ())),
                 replay_fraction=config.data.get("replay_fraction", 0.0))
  first: dict = {}  # step 1's metrics, restored from the checkpoint on a resume
  params = common.lora_student(params, config.get("lora"), "config.lora",
                               base_checkpoint=config.init)
  state, history = train_sft(model_cfg, params, data, workdir,
                             optim=common.optim_config(config.optim), loop=loop,
                             runtime=Runtime(mesh, rules, seed=config.seed,
                                             tokenizer=common.tokenizer_for(model_cfg, workdir)),
                             run_config={"experiment": config_to_dict(config)},
                             first_metrics=first)
  plot = common.plot_curves(workdir, keys=("loss", "eval/loss"), title="SFT loss")
  evals = [m for _, m in history if "eval/loss" in m]
  losses = [m["loss"] for _, m in history if "loss" in m]
  return {"steps": int(state.step),
          "train_loss_first": first[1]["loss"] if 1 in first else float("nan"),
          "train_loss_final": float(np.mean(losses[-10:])),
          "eval_loss": evals[-1]["eval/loss"] if evals else float("nan"),
          "eval_accuracy": evals[-1].get("eval/accuracy", float("nan")) if evals else float("nan"),
          "wall_s": timer.seconds, "plot": str(plot or "")}
