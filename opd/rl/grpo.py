"""The GRPO trainer (docs/DESIGN.md §5): a rollout source and a loss composed into the loop.

``train_grpo`` = ``opd.rl.rollout_source.GRPOSource`` (prompts, rollouts,
rewards, group advantages, reference log-probs) + ``opd.rl.loss.make_grpo_loss``
in the shared train step, driven by ``opd.training.loop.train`` (resume,
checkpoints, eval, metrics, NaN stop; ``LoopConfig`` and ``RunIO`` as in
every trainer).

Metrics per step (also in the returned history): ``reward/{mean,std,min,max}``,
``reward/components/<name>/{mean,std}`` (``format`` and the verifier's
components, e.g. the agent's layers), ``reward/domain/<d>/mean``,
``reward_reason/<category>`` counts and ``reward_reason/error_fraction``,
``groups/zero_std_fraction``, ``advantage/abs_mean``,
``response/{length_mean,length_max,truncation_rate,policy_tokens,overlong_fraction}``,
``train/{loss,policy_loss,kl,entropy,clip_frac_low,clip_frac_high,ratio_mean,ratio_max,
grad_norm,lr,policy_tokens}`` (means over the step's updates),
``perf/{tokens_per_s,sample_tokens_per_s,train_tokens_per_s,step_time_s,rollout_time_s,
reward_time_s,ref_time_s,train_time_s}``, ``eval/...``; text ``rollouts``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax

from opd.models import ModelConfig, moe_balance
from opd.rl.config import GRPOConfig
from opd.rl.loss import make_grpo_loss
from opd.rl.rollout_source import GRPOSource
from opd.rl.scoring import RewardFn
from opd.rollout.batches import prompt_stream
from opd.tasks import AgentRewardConfig, Example
from opd.training import loop as train_loop
from opd.training.lora_state import init_student
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.train_step import OptimConfig, make_train_step

__all__ = ["GRPOExtras", "GRPORun", "train_grpo"]

GRPORun = train_loop.TrainRun  # the final state and one metrics dict per step run


@dataclasses.dataclass(frozen=True)
class GRPOExtras:
  """The optional parts of a GRPO run (all None: task verifiers, the GRPO loss).

  Attributes:
    reward_fn: ``reward_fn(episodes)`` (``opd.rl.scoring.score_episodes``);
      None uses the task verifiers.
    agent_config, task_kwargs: for rollouts (``GRPOSource``).
    loss_fn: ``loss_fn(params, batch, rng) -> (loss, metrics)`` replacing the
      GRPO loss (``make_grpo_loss(model_cfg, cfg)``), e.g. the shared-backbone
      GRM's rule-RL + meta BCE (docs/DESIGN.md §6); it receives the GRPO batch
      plus ``batch_extras``' keys.
    batch_extras: ``batch_extras(episodes, rewards) -> {key: [B, ...]}``, extra
      batch keys from each rollout batch (``GRPOSource``).
  """
  reward_fn: RewardFn | None = None
  agent_config: AgentRewardConfig | None = None
  task_kwargs: Mapping[str, Mapping[str, Any]] | None = None
  loss_fn: Callable | None = None
  batch_extras: Callable | None = None

  def __post_init__(self):
    for name in ("reward_fn", "loss_fn", "batch_extras"):
      fn = getattr(self, name)
      if fn is not None and not callable(fn):
        raise ValueError(f"GRPOExtras.{name} must be callable or None, got {type(fn).__name__}")


def train_grpo(model_cfg: ModelConfig, params, ref_params, prompts: Sequence[Example] | Iterable,
               cfg: GRPOConfig, optim: OptimConfig, loop: LoopConfig, io: RunIO | None = None, *,
               runtime: Runtime, extras: GRPOExtras | None = None) -> GRPORun:
  """Runs GRPO until ``loop.steps`` rollout batches have been trained on (module docstring).

  Args:
    params: initial policy params (None: random init from ``runtime.seed``);
      a ``opd.training.lora_state.LoRAStudent`` trains adapters on its frozen
      base (rollouts, the reference's shardings and ``io.eval_fn`` see the
      merged params).
    ref_params: the frozen reference's params (usually the initial policy);
      None only with ``cfg.kl_coef == 0`` (given with 0, the KL is logged).
    prompts: ``Example``s (wrapped in ``prompt_stream(prompts, cfg.rollout,
      seed=runtime.seed)``: domain-balanced with ``cfg.domain_balance``) or an
      iterator of them; checkpointing needs ``get_state``/``set_state``.
    loop: ``loop.steps`` GRPO steps (rollout batches), each
      ``cfg.updates_per_batch`` optimizer updates (a resumed run continues to
      it); rollouts as text on the first step and every ``loop.text_every``.
    io: metrics, checkpoints, ``config`` (``model``/``grpo`` added; the whole
      of it must match on resume), ``on_metrics`` and ``eval_fn(params)``, as
      in ``opd.training.loop.train``.
    runtime: mesh, rules, seed and the tokenizer (needed: rollouts).
    extras: reward function, agent / task settings, a replacement loss
      (``GRPOExtras``).

  Raises:
    VerifierFailureError: a step's share of verifier errors and malformed
      prompts exceeded ``cfg.max_error_fraction`` (nothing updated or saved).
    NonFiniteError: a NaN/inf loss or gradient; nothing saved for that step.
  """
  for name, value, typ in (("cfg", cfg, GRPOConfig), ("optim", optim, OptimConfig),
                           ("loop", loop, LoopConfig), ("runtime", runtime, Runtime)):
    if not isinstance(value, typ):
      raise ValueError(f"{name} must be a {typ.__name__}, got {type(value).__name__}")
  io, extras = io if io is not None else RunIO(), extras if extras is not None else GRPOExtras()
  if runtime.tokenizer is None:
    raise ValueError("train_grpo samples rollouts: Runtime.tokenizer must be set, got None")
  if ref_params is None and cfg.kl_coef > 0:
    raise ValueError(f"GRPOConfig.kl_coef={cfg.kl_coef} > 0 needs ref_params (e.g. the initial "
                     "policy params)")
  if jax.process_count() > 1:
    raise ValueError("train_grpo runs in one process (rollouts gather the whole batch on the "
                     f"host); got jax.process_count()={jax.process_count()}")
  mesh, rules, seed = runtime.mesh, runtime.rules, runtime.seed
  stream = (prompt_stream(prompts, cfg.rollout, seed=seed) if isinstance(prompts, Sequence)
            else iter(prompts))
  if io.checkpoints and not hasattr(stream, "set_state"):
    raise ValueError(f"checkpointing needs a prompt iterator with get_state/set_state; "
                     f"{type(stream).__name__} has none (pass a list or a PromptStream)")

  student = init_student(model_cfg, optim, runtime, params)
  loss_fn = extras.loss_fn if extras.loss_fn is not None else make_grpo_loss(model_cfg, cfg)
  hook = student.after_update(moe_balance.bias_update_hook(model_cfg))
  step_fn = make_train_step(student.loss(loss_fn), student.optimizer, mesh, student.shardings,
                            rules=rules, after_update=hook)
  source = GRPOSource(model_cfg, cfg, stream, tokenizer=runtime.tokenizer, ref_params=ref_params,
                      param_shardings=student.param_shardings, mesh=mesh, rules=rules, seed=seed,
                      reward_fn=extras.reward_fn, agent_config=extras.agent_config,
                      task_kwargs=extras.task_kwargs, text_every=loop.text_every,
                      batch_extras=extras.batch_extras)
  io = io.replace(eval_fn=student.eval_fn(io.eval_fn)).with_config(
      {"model": model_cfg.to_dict(), "grpo": cfg.to_dict(), **student.config_entries})
  return train_loop.train(student.state, step_fn, student.source(source), loop, io,
                          desc="grpo", progress_key="reward/mean")
