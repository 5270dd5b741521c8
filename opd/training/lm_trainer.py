"""Next-token training (pre-training and SFT) on the shared sharded step.

``train_lm`` wires ``opd.training.objectives.lm_loss`` into ``opd.training.train_step`` and
``opd.training.loop``: sharded init (random or from given params), AdamW,
periodic held-out loss, TensorBoard/JSONL metrics, checkpoints with resume,
and a NaN stop that leaves the last good checkpoint untouched. Pre-training
feeds it raw-text batches, SFT feeds response-masked chat batches; the
batch layout is that of ``opd.training.data``.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from opd.config.fields import check_bool, set_field
from opd.models import ModelConfig, moe_balance
from opd.training import loop as train_loop
from opd.training.checkpoints import CheckpointManager
from opd.training.lora_state import LoRAStudent, init_student
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.objectives import lm_loss
from opd.training.train_step import OptimConfig, TrainState, make_train_step, shard_batch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LMTrainConfig(LoopConfig):
  """``train_lm``'s loop settings: a ``LoopConfig`` (steps, cadence, checkpoints
  kept, plus the best by eval loss) and the loss's form.

  Attributes:
    fused_loss: apply the LM head inside the fused cross-entropy kernel
      (never materialises ``[B, T, V]``; worth it at large V).
  """
  fused_loss: bool = False

  def __post_init__(self):
    super().__post_init__()
    set_field(self, "fused_loss", check_bool("LMTrainConfig", "fused_loss", self.fused_loss))


def _jit_eval(loss_fn):
  return jax.jit(lambda p, b: loss_fn(p, b, jax.random.key(0)))


def evaluate_loss(loss_fn, params, batches: Sequence[Mapping[str, np.ndarray]], mesh, rules, *,
                  jitted: Callable | None = None) -> dict[str, float]:
  """Token-weighted mean loss (and accuracy, if reported) over ``batches``.

  ``jitted``: ``jax.jit`` of ``loss_fn`` with a fixed rng, built by the caller
  to reuse one compile across calls (by default compiled for this call).
  """
  fn = jitted if jitted is not None else _jit_eval(loss_fn)
  total = weighted = acc = 0.0
  for batch in batches:
    loss, metrics = fn(params, shard_batch(batch, mesh, rules))
    n = float(metrics["tokens"])
    total += n
    weighted += float(loss) * n
    acc += float(metrics.get("accuracy", np.nan)) * n
  if total == 0:
    return {"loss": float("nan")}
  out = {"loss": weighted / total}
  if not np.isnan(acc):
    out["accuracy"] = acc / total
  return out


def _one_document_rows(prepare, batch):
  """A DeepSeek-V4 model's batch (``ModelConfig.v4``): its compressed attention
  needs each row's positions consecutive, so a packed row (segment ids > 1)
  is refused on the host before the step; a padded row's segment ids (1 on
  its tokens) say nothing the mask does not, and are dropped."""
  seg = batch.get("segment_ids")
  if seg is not None and np.size(seg) and int(np.max(seg)) > 1:
    raise ValueError("a packed batch (segment_ids up to "
                     f"{int(np.max(seg))}) reached a ModelConfig.v4 model: its compressed "
                     "windows would mix documents; build the batches with mode='pad'")
  return prepare({k: v for k, v in batch.items() if k != "segment_ids"})


def train_lm(model_cfg: ModelConfig, batches: Iterator[Mapping[str, np.ndarray]],
             optim: OptimConfig, loop: LMTrainConfig, io: RunIO | None = None, *,
             runtime: Runtime, params: Any | LoRAStudent | None = None,
             eval_batches: Sequence[Mapping[str, np.ndarray]] = ()) -> TrainState:
  """Trains ``model_cfg`` on ``batches`` for ``loop.steps`` updates.

  Args:
    model_cfg: the model.
    batches: host batches in the ``opd.training.data`` layout, per-process rows (a
      grain iterator's position is checkpointed with the state).
    optim: optimizer settings (``grad_accum_steps`` included).
    loop: loop settings (``LMTrainConfig``, a ``LoopConfig``).
    io: ``opd.training.loop.RunIO``: ``checkpoint_dir`` (None: no
      checkpoints; the manager also keeps the best by ``eval/loss``),
      ``on_metrics``, ``eval_fn(params) -> metrics`` run with the held-out
      loss (e.g. generation-based task scores during SFT), ``config`` (the
      whole of it must match the checkpoint's on resume; ``model`` added) and
      ``first_metrics`` (step 1's metrics at key 1, the original run's after
      a resume), as in ``opd.training.loop.train``.
    runtime: the mesh, rules and seed (init and per-step randomness).
    params: start from these parameters (SFT from a base, a specialist
      from SFT) instead of a random init; a ``LoRAStudent`` trains adapters on
      its frozen base (``opd.training.lora_state``: the state's params are
      the adapters, evaluation sees them merged).
    eval_batches: held-out batches for ``eval/loss``.

  Returns:
    The final ``TrainState``.

  Raises:
    ValueError: ``optim.warmup_steps`` exceeds ``loop.steps`` (the run would
      end before its learning rate reaches ``optim.lr``).
  """
  if optim.warmup_steps > loop.steps:
    raise ValueError(f"OptimConfig.warmup_steps={optim.warmup_steps} exceeds LMTrainConfig.steps="
                     f"{loop.steps}: the run would end before the warmup does (the rate never "
                     f"reaches lr={optim.lr})")
  io = io if io is not None else RunIO()
  mesh, rules = runtime.mesh, runtime.rules
  loss_fn = lm_loss(model_cfg, fused=loop.fused_loss)
  student = init_student(model_cfg, optim, runtime, params)
  hook = student.after_update(moe_balance.bias_update_hook(model_cfg))
  step_fn = make_train_step(student.loss(loss_fn), student.optimizer, mesh, student.shardings,
                            rules=rules, after_update=hook)

  prepare = functools.partial(shard_batch, mesh=mesh, rules=rules)
  if model_cfg.v4 is not None:  # one document per row; segment ids dropped
    prepare = functools.partial(_one_document_rows, prepare)
    eval_batches = [_one_document_rows(lambda b: b, b) for b in eval_batches or ()]
  jitted_eval = _jit_eval(loss_fn)  # one compile for every eval of this run
  io_eval = io.eval_fn

  def eval_fn(p) -> dict[str, float]:
    p, out = student.view(p), {}
    if eval_batches:
      out.update(evaluate_loss(loss_fn, p, eval_batches, mesh, rules, jitted=jitted_eval))
    if io_eval is not None:
      out.update(io_eval(p))
    return out

  manager = None
  if io.checkpoint_dir is not None:
    manager = CheckpointManager(io.checkpoint_dir, max_to_keep=loop.keep_checkpoints,
                                keep_best=1 if eval_batches else 0, best_metric="eval/loss")
  config = dict(io.config or {})
  config.setdefault("model", model_cfg.to_dict())
  config.update(student.config_entries)
  has_eval = bool(eval_batches) or io_eval is not None
  loop = loop.replace(save_every=loop.save_every if manager is not None or
                      io.checkpoint_manager is not None else 0,
                      eval_every=loop.eval_every if has_eval else 0)
  try:
    state = train_loop.train(
        student.state, step_fn, batches, loop,
        io.replace(checkpoint_dir=None, checkpoint_manager=manager or io.checkpoint_manager,
                   config=config, eval_fn=eval_fn if has_eval else None),
        prepare_batch=prepare).state
  finally:
    if manager is not None:
      manager.close()
  return state
