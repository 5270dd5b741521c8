"""GRPO's batch source (docs/DESIGN.md §5): prompts -> rollouts -> scored, advantaged batches.

``GRPOSource`` is a ``opd.training.loop.RolloutSource``. For GRPO step s
(0-based) ``next_batch(state, s)``:

1. draws P prompts (``opd.rollout.batches.draw_prompts`` from a
   ``PromptStream`` over a list, or any iterator of ``Example``s; malformed
   prompts score 0 with reason ``bad_example`` and are replaced by the next
   one, so batch shapes never change);
2. repeats each G times, consecutively, and rolls them out
   (``opd.rollout.batches.sample_groups``) with a key folded from ``seed``
   and s (a resumed run samples exactly what an uninterrupted one would);
3. scores them (``opd.rl.scoring.score_episodes``: the task verifiers or a
   ``reward_fn``); a step whose share of errors exceeds
   ``max_error_fraction`` raises ``VerifierFailureError`` before any update;
4. turns the ``[P, G]`` rewards (row p: prompt p's G samples) into
   group-normalised advantages, the episodes into training arrays
   (``opd.rollout.batches.training_arrays``) and adds the frozen
   reference's log-probs.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np

from opd.models import ModelConfig, forward, token_logprobs
from opd.parallel import sharding as sharding_lib
from opd.rl.advantages import group_advantages
from opd.rl.config import GRPOConfig
from opd.rl.scoring import RewardFn, reward_metrics, score_episodes
from opd.rollout.batches import (PromptPosition, draw_prompts, prompt_problem, sample_groups,
                                 training_arrays)
from opd.rollout.episodes import RolloutLog, with_agent_config
from opd.rollout.policy import Policy
from opd.tasks import AgentRewardConfig, RewardStats, VerifierFailureError
from opd.training.train_step import shard_batch

__all__ = ["GRPOSource", "make_reference_fn", "reference_logprobs"]

# Train-step flags that say nothing once the loop has checked them.
_FLAGS = ("finite", "loss_finite", "grads_finite")


def make_reference_fn(model_cfg: ModelConfig, temperature: float, *, mesh,
                      rules=sharding_lib.DEFAULT_RULES) -> Callable[..., jax.Array]:
  """``fn(params, batch) -> [B, L]`` fp32 ``token_logprobs`` of ``batch['targets']``.

  ``batch`` holds ``tokens``, ``mask``, ``targets`` (host or sharded with
  ``shard_batch``); the output is batch-sharded. Jitted once here; one
  compile per batch shape.
  """
  rules = sharding_lib.validate_rules(rules)

  def logprobs(params, tokens, mask, targets):
    with nn.logical_axis_rules(rules):
      logits = forward(model_cfg, params, tokens, None, mask).logits
    return token_logprobs(logits, targets, temperature)

  jitted = jax.jit(logprobs, out_shardings=sharding_lib.batch_sharding(mesh, rules, 2))

  def fn(params, batch: Mapping[str, Any]) -> jax.Array:
    with jax.set_mesh(mesh):
      return jitted(params, batch["tokens"], batch["mask"], batch["targets"])

  return fn


def reference_logprobs(model_cfg: ModelConfig, params, batch: Mapping[str, Any],
                       temperature: float, *, mesh, rules=sharding_lib.DEFAULT_RULES) -> jax.Array:
  """One-off ``make_reference_fn(...)(params, batch)``. ``[B, L]`` fp32, batch-sharded."""
  return make_reference_fn(model_cfg, float(temperature), mesh=mesh, rules=rules)(params, batch)


def _rollout_text(episodes, scores, tokenizer, n: int, group_size: int) -> str:
  parts = []
  for i in range(0, min(len(episodes), n * group_size), group_size):
    ep, s = episodes[i], scores[i]
    head = (f"**{ep.example.domain}** `{ep.example.id}` reward {s.reward:.3f} ({s.reason})"
            f"{' truncated' if ep.truncated else ''}")
    parts.append(f"{head}\n\n    {ep.example.prompt!r}\n\n    "
                 f"{tokenizer.decode(ep.response_ids)!r}")
  return "\n\n---\n\n".join(parts)


def _place(params, shardings):
  """``params`` (boxed or not) on ``shardings``; ValueError if the trees differ."""
  params = nn.meta.unbox(params)
  if jax.tree.structure(params) != jax.tree.structure(shardings):
    raise ValueError(f"ref_params do not have the model's parameter tree: got "
                     f"{jax.tree.structure(params)}, expected {jax.tree.structure(shardings)}")
  return jax.tree.map(jax.device_put, params, shardings)


def _checked_extras(extras: Mapping[str, Any], host: Mapping[str, Any], rows: int
                    ) -> dict[str, np.ndarray]:
  """``batch_extras``' output as arrays of ``rows`` rows, not shadowing a batch key."""
  out = {}
  for key, value in dict(extras).items():
    if key in host:
      raise ValueError(f"batch_extras returned {key!r}, which the GRPO batch already has")
    value = np.asarray(value)
    if value.ndim == 0 or value.shape[0] != rows:
      raise ValueError(f"batch_extras[{key!r}] has shape {value.shape}; expected [B={rows}, ...]")
    out[key] = value
  return out


class GRPOSource(PromptPosition):
  """GRPO rollout batches for ``opd.training.loop.train`` (module docstring).

  Args:
    model_cfg: the policy's model.
    cfg: GRPO settings.
    prompts: an iterator of ``Example``s (e.g. a ``PromptStream``);
      checkpointing needs its ``get_state``/``set_state``.
    tokenizer: renders prompts, decodes text samples.
    ref_params: the frozen reference's params, placed on ``param_shardings``
      (the policy's) here (None: no ``ref_logprobs`` in the batch; only
      with ``kl_coef == 0``).
    mesh, rules: the mesh and validated logical rules.
    seed: the per-step sampling keys are ``fold_in(key(seed), step)``.
    reward_fn, agent_config, task_kwargs: as ``opd.rl.grpo.train_grpo``.
    text_every: ``texts`` returns rollouts for the first step taken and every
      this many steps (0: the first only).
    batch_extras: ``batch_extras(episodes, rewards) -> {key: [B, ...] array}``,
      extra per-row batch keys computed from the rollouts and their ``[B]``
      rewards (e.g. the shared-backbone GRM's ``meta_labels``, docs/DESIGN.md
      §6) for a custom ``loss_fn`` of ``train_grpo``.
  """

  def __init__(self, model_cfg: ModelConfig, cfg: GRPOConfig, prompts: Iterator, *, tokenizer,
               ref_params, param_shardings, mesh, rules, seed: int = 0, reward_fn: RewardFn | None = None,
               agent_config: AgentRewardConfig | None = None,
               task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
               text_every: int = 10,
               batch_extras: Callable[[Sequence[Any], np.ndarray], Mapping[str, Any]] | None = None):
    if batch_extras is not None and not callable(batch_extras):
      raise ValueError(f"batch_extras must be callable or None, got {type(batch_extras).__name__}")
    self.batch_extras = batch_extras
    self.model_cfg, self.cfg, self.prompts, self.tokenizer = model_cfg, cfg, prompts, tokenizer
    self.mesh, self.rules = mesh, rules
    self.ref_params = _place(ref_params, param_shardings) if ref_params is not None else None
    self.reward_fn = reward_fn
    self.task_kwargs = with_agent_config(task_kwargs, agent_config)  # the agent's weights merged
    self.updates_per_batch, self.text_every = cfg.updates_per_batch, text_every
    self._key = jax.random.key(seed)
    self._reference = (make_reference_fn(model_cfg, cfg.temperature, mesh=mesh, rules=rules)
                       if ref_params is not None else None)
    self._sampling = cfg.rollout.sampling(tokenizer)
    self._problem = functools.partial(prompt_problem, tokenizer=tokenizer, cfg=cfg.rollout,
                                      custom_reward=reward_fn is not None)
    self._last = None  # (episodes, scores, real tokens) of the latest batch
    self._texts_written = False

  def next_batch(self, state, step: int):
    """``(batch, host_metrics)`` for 0-based GRPO ``step``; None when prompts run out."""
    cfg, t0 = self.cfg, time.perf_counter()
    stats = RewardStats()
    examples = draw_prompts(self.prompts, cfg.prompts_per_step, self._problem, stats)
    if examples is None:
      return None
    # Row p * G + g is sample g of prompt p: the reshape to [P, G] below
    # relies on this order to normalise within same-prompt groups.
    custom = self.reward_fn is not None
    policy = Policy(self.model_cfg, state.params, self.tokenizer, self.mesh, self.rules)
    episodes = sample_groups(
        policy, examples, cfg.rollout, self._key, step, self._sampling,
        log=RolloutLog(stats=None if custom else stats), task_kwargs=self.task_kwargs,
        verify=not custom)
    t1 = time.perf_counter()
    scores = score_episodes(episodes, self.reward_fn, stats=stats if custom else None)
    t2 = time.perf_counter()
    try:
      stats.check(cfg.max_error_fraction)
    except VerifierFailureError as e:
      raise VerifierFailureError(f"GRPO step {step + 1}: {e}") from e
    rewards = np.asarray([s.reward for s in scores]).reshape(cfg.prompts_per_step,
                                                            cfg.group_size)
    adv = group_advantages(rewards, scale_by_std=cfg.scale_advantages_by_std,
                           eps=cfg.advantage_eps)
    host, cut = training_arrays(episodes, seq_len=cfg.seq_len, length_bucket=cfg.length_bucket,
                                pad_id=self.tokenizer.pad_id)
    host["advantages"] = adv.reshape(-1)
    if self.batch_extras is not None:
      host.update(_checked_extras(self.batch_extras(episodes, rewards.reshape(-1)), host,
                                  len(episodes)))
    batch = shard_batch(host, self.mesh, self.rules)
    if self._reference is not None:
      batch["ref_logprobs"] = jax.block_until_ready(self._reference(self.ref_params, batch))
    metrics = reward_metrics(scores, episodes, cfg.group_size)
    metrics.update(stats.metrics())
    metrics.update({"advantage/abs_mean": float(np.abs(adv).mean()),
                    "response/overlong_fraction": float(np.mean(cut)),
                    "perf/rollout_time_s": t1 - t0, "perf/reward_time_s": t2 - t1,
                    "perf/ref_time_s": time.perf_counter() - t2})
    self._last = (episodes, scores, float(host["mask"].sum()))
    return batch, metrics

  def step_metrics(self, host_metrics, train_metrics, *, batch_time_s: float,
                   train_time_s: float) -> dict[str, float]:
    """Host metrics, ``train/<k>`` means over the updates, ``perf/...`` rates."""
    metrics = dict(host_metrics)
    metrics.update({f"train/{k}": v for k, v in train_metrics.items() if k not in _FLAGS})
    sampled, step_time = metrics["response/policy_tokens"], batch_time_s + train_time_s
    metrics.update({
        "perf/step_time_s": step_time, "perf/train_time_s": train_time_s,
        "perf/tokens_per_s": sampled / max(step_time, 1e-9),
        "perf/sample_tokens_per_s": sampled / max(metrics["perf/rollout_time_s"], 1e-9),
        "perf/train_tokens_per_s":
            self._last[2] * self.updates_per_batch / max(train_time_s, 1e-9)})
    return metrics

  def texts(self, step: int) -> dict[str, str]:
    """A few rollouts of the latest batch on the first step taken and every ``text_every``."""
    due = not self._texts_written or (self.text_every and step % self.text_every == 0)
    if not (self.cfg.num_text_samples and due and self._last is not None):
      return {}
    self._texts_written = True
    episodes, scores, _ = self._last
    return {"rollouts": _rollout_text(episodes, scores, self.tokenizer,
                                      self.cfg.num_text_samples, self.cfg.group_size)}
