"""The GRPO trainer (docs/DESIGN.md §5): a rollout source and a loss composed into the loop.

``train_grpo`` = ``opd.rl.rollout_source.GRPOSource`` (prompts, rollouts,
rewards, group advantages, reference log-probs) + ``opd.rl.loss.make_grpo_loss``
in the shared train step, driven by ``opd.training.loop.run`` (resume,
checkpoints, eval, metrics, NaN stop; ``save_every`` as in every trainer).

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

import pathlib
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax

from opd.config.fields import check_int
from opd.models import ModelConfig
from opd.parallel import sharding as sharding_lib
from opd.rl.config import GRPOConfig
from opd.rl.loss import make_grpo_loss
from opd.rl.rollout_source import GRPOSource
from opd.rl.scoring import RewardFn
from opd.rollout.batches import prompt_stream
from opd.tasks import AgentRewardConfig, Example
from opd.training import loop as train_loop
from opd.training.metrics_writer import MetricWriter
from opd.training.train_step import (OptimConfig, TrainState, init_train_state, make_optimizer,
                                     make_train_step)

__all__ = ["GRPORun", "train_grpo"]


class GRPORun(NamedTuple):
  """What ``train_grpo`` returns: the final state and one metrics dict per step run."""
  state: TrainState
  history: list[dict[str, float]]


def train_grpo(model_cfg: ModelConfig, params, ref_params, prompts: Sequence[Example] | Iterable,
               cfg: GRPOConfig, optim: OptimConfig, *, tokenizer, steps: int, mesh,
               rules=sharding_lib.DEFAULT_RULES, seed: int = 0, reward_fn: RewardFn | None = None,
               agent_config: AgentRewardConfig | None = None,
               task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
               workdir: str | pathlib.Path | None = None, writer: MetricWriter | None = None,
               on_metrics: Callable[[int, dict[str, float]], None] | None = None,
               checkpoint_dir: str | pathlib.Path | None = None, save_every: int = 0,
               keep_checkpoints: int = 2, run_config: Mapping[str, Any] | None = None,
               eval_fn: Callable[[Any], Mapping[str, float]] | None = None, eval_every: int = 0,
               text_every: int = 10, progress: bool = True,
               loss_fn: Callable | None = None,
               batch_extras: Callable | None = None) -> GRPORun:
  """Runs GRPO until ``steps`` rollout batches have been trained on (module docstring).

  Args:
    params: initial policy params (None: random init from ``seed``).
    ref_params: the frozen reference's params (usually the initial policy);
      None only with ``cfg.kl_coef == 0`` (given with 0, the KL is logged).
    prompts: ``Example``s (wrapped in ``prompt_stream(prompts, cfg.rollout, seed=seed)``:
      domain-balanced with ``cfg.domain_balance``) or an iterator of them;
      checkpointing needs ``get_state``/``set_state``.
    steps: total GRPO steps (rollout batches), each ``cfg.updates_per_batch``
      optimizer updates; a resumed run continues to it.
    reward_fn: ``reward_fn(episodes)`` (``opd.rl.scoring.score_episodes``);
      None uses the task verifiers. agent_config, task_kwargs: for rollouts.
    workdir: write ``metrics.jsonl`` and TensorBoard events there (or pass an
      open ``writer``, flushed, not closed). on_metrics: ``(step, metrics)``.
    checkpoint_dir, save_every, keep_checkpoints: resume from and save to
      (``save_every`` 0: only after the last step, as ``training.loop.run``).
    run_config: JSON saved with checkpoints (``model``/``grpo`` added; they
      must match on resume).
    eval_fn, eval_every: ``eval_fn(params)`` every ``eval_every`` steps and
      after the last, logged as ``eval/...``. text_every: rollouts as text
      on the first step and every this many. Others: as their names say.
    loss_fn: ``loss_fn(params, batch, rng) -> (loss, metrics)`` replacing the
      GRPO loss (``make_grpo_loss(model_cfg, cfg)``), e.g. the shared-backbone
      GRM's rule-RL + meta BCE (docs/DESIGN.md §6); it receives the GRPO batch
      plus ``batch_extras``' keys.
    batch_extras: ``batch_extras(episodes, rewards) -> {key: [B, ...]}``, extra
      batch keys from each rollout batch (``GRPOSource``).

  Raises:
    VerifierFailureError: a step's share of verifier errors and malformed
      prompts exceeded ``cfg.max_error_fraction`` (nothing updated or saved).
    NonFiniteError: a NaN/inf loss or gradient; nothing saved for that step.
  """
  for name, value, typ in (("cfg", cfg, GRPOConfig), ("optim", optim, OptimConfig)):
    if not isinstance(value, typ):
      raise ValueError(f"{name} must be a {typ.__name__}, got {type(value).__name__}")
  for name, value, lo in (("steps", steps, 0), ("text_every", text_every, 0),
                          ("keep_checkpoints", keep_checkpoints, 1)):
    check_int("train_grpo", name, value, min_value=lo)
  if ref_params is None and cfg.kl_coef > 0:
    raise ValueError(f"GRPOConfig.kl_coef={cfg.kl_coef} > 0 needs ref_params (e.g. the initial "
                     "policy params)")
  for name, fn in (("reward_fn", reward_fn), ("loss_fn", loss_fn),
                   ("batch_extras", batch_extras)):
    if fn is not None and not callable(fn):
      raise ValueError(f"{name} must be callable or None, got {type(fn).__name__}")
  if jax.process_count() > 1:
    raise ValueError("train_grpo runs in one process (rollouts gather the whole batch on the "
                     f"host); got jax.process_count()={jax.process_count()}")
  rules = sharding_lib.validate_rules(rules)
  stream = (prompt_stream(prompts, cfg.rollout, seed=seed) if isinstance(prompts, Sequence)
            else iter(prompts))
  if checkpoint_dir is not None and not hasattr(stream, "set_state"):
    raise ValueError(f"checkpointing needs a prompt iterator with get_state/set_state; "
                     f"{type(stream).__name__} has none (pass a list or a PromptStream)")

  optimizer = make_optimizer(optim)
  state, shardings = init_train_state(model_cfg, optimizer, mesh, rules, rng=seed, params=params)
  step_fn = make_train_step(loss_fn if loss_fn is not None else make_grpo_loss(model_cfg, cfg),
                            optimizer, mesh, shardings, rules=rules)
  source = GRPOSource(model_cfg, cfg, stream, tokenizer=tokenizer, ref_params=ref_params,
                      param_shardings=shardings.params, mesh=mesh, rules=rules, seed=seed, reward_fn=reward_fn,
                      agent_config=agent_config, task_kwargs=task_kwargs, text_every=text_every,
                      batch_extras=batch_extras)
  state, history = train_loop.run_trainer(
      state, step_fn, source, steps, checkpoint_dir=checkpoint_dir,
      keep_checkpoints=keep_checkpoints, workdir=workdir, writer=writer, on_metrics=on_metrics,
      eval_fn=eval_fn, save_every=save_every,
      config={**dict(run_config or {}), "model": model_cfg.to_dict(), "grpo": cfg.to_dict()},
      match_config=("model", "grpo"), eval_every=eval_every, progress=progress, desc="grpo",
      progress_key="reward/mean")
  return GRPORun(state, history)
