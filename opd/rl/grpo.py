"""The GRPO trainer (SPEC §5) on the shared train step and the rollout sampler.

One GRPO step:

1. draw P prompts (``PromptStream`` over a list, or any iterator of
   ``Example``s; malformed prompts score 0 with reason ``bad_example`` and
   are replaced by the next one, so batch shapes never change);
2. repeat each G times and ``opd.rollout.episodes.rollout`` them with a key folded
   from ``seed`` and the step number (a resumed run samples exactly what an
   uninterrupted one would);
3. score: by default ``Episode.reward`` from the task verifiers; or a plain
   ``reward_fn(episodes)`` (a GRM plugs in here, see ``score_episodes``).
   A scorer exception scores 0 with a counted ``verifier_error``; a step
   whose error share exceeds ``max_error_fraction`` raises
   ``VerifierFailureError`` before any update;
4. group-normalised advantages, ``batch_episodes``, reference log-probs
   from the frozen reference params (one jitted forward per batch);
5. ``updates_per_batch`` jitted train steps on that batch with
   ``old_logprobs`` fixed from the sampler (``opd.rl.loss``);
6. metrics to TensorBoard/JSONL (names in ``train_grpo``), a few rollouts as
   text, and a checkpoint of state + prompt position + config.

The config, scoring, advantages and loss live in ``opd.rl.loss`` and
are re-exported here.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import numpy as np

from opd import rollout as rollout_lib
from opd.parallel import sharding as sharding_lib
from opd.training.checkpoints import CheckpointManager
from opd.rl.loss import (  # noqa: F401 - re-exported: opd.rl.grpo is the public entry
    LOSS_AGGREGATIONS, LOSS_FIELDS, GRPOConfig, RewardFn, Score, count_reason, group_advantages,
    grpo_loss, policy_loss, reward_metrics, score_episodes)
from opd.training.metrics_writer import MetricWriter
from opd.models import ModelConfig, forward, token_logprobs
from opd.rollout.episodes import Episode
from opd.tasks import (ALL_DOMAINS, AgentEnv, AgentRewardConfig, Example, RewardStats,
                       VerifierFailureError)
from opd.training.train_step import (NonFiniteError, OptimConfig, TrainState, abstract_train_state,
                            init_train_state, make_optimizer, make_train_step, raise_if_nonfinite,
                            shard_batch)

log = logging.getLogger(__name__)

__all__ = ["GRPOConfig", "GRPORun", "LOSS_AGGREGATIONS", "PromptStream", "Score",
           "group_advantages", "grpo_loss", "policy_loss", "reference_logprobs",
           "reward_metrics", "score_episodes", "train_grpo", "NonFiniteError",
           "VerifierFailureError"]

# ---------------------------------------------------------------------------
# Prompts.


class PromptStream:
  """An endless, resumable iterator over a list of prompts.

  Each epoch visits every item once in an order drawn from ``(seed, epoch)``
  (or in list order with ``shuffle=False``). ``get_state()`` /
  ``set_state()`` save and restore the position, so a checkpointed run
  continues with the prompt it would have drawn next.
  """

  def __init__(self, items: Sequence[Any], *, seed: int = 0, shuffle: bool = True):
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)) or not items:
      raise ValueError(f"items must be a non-empty sequence of prompts, got {type(items).__name__}"
                       f" of length {len(items) if hasattr(items, '__len__') else '?'}")
    self.items, self.seed, self.shuffle = list(items), int(seed), bool(shuffle)
    self.epoch, self.index = 0, 0

  def _order(self) -> np.ndarray:
    if getattr(self, "_order_epoch", None) != self.epoch:
      n = len(self.items)
      self._order_cache = (np.random.default_rng([self.seed, self.epoch]).permutation(n)
                           if self.shuffle else np.arange(n))
      self._order_epoch = self.epoch
    return self._order_cache

  def __iter__(self) -> "PromptStream":
    return self

  def __next__(self):
    if self.index >= len(self.items):
      self.epoch, self.index = self.epoch + 1, 0
    item = self.items[int(self._order()[self.index])]
    self.index += 1
    return item

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "index": self.index, "size": len(self.items)}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if state.get("size") != len(self.items):
      raise ValueError(f"PromptStream state {dict(state)} was saved for {state.get('size')} "
                       f"prompts, this stream has {len(self.items)}")
    epoch, index = state.get("epoch"), state.get("index")
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(index, int)
            and 0 <= index <= len(self.items)):
      raise ValueError(f"PromptStream state {dict(state)} has an invalid epoch/index")
    self.epoch, self.index = epoch, index


def _prompt_problem(ex: Any, tokenizer, cfg: GRPOConfig, *, custom_reward: bool,
                    agent_config: AgentRewardConfig | None) -> str | None:
  """Why ``ex`` cannot be rolled out and trained on, or None."""
  if not isinstance(ex, Example):
    return f"not an Example but {type(ex).__name__}"
  if (ex.domain == "agent" or not custom_reward) and ex.domain not in ALL_DOMAINS:
    return f"no verifier for domain {ex.domain!r} (domains: {ALL_DOMAINS})"
  try:
    if ex.domain == "agent":
      AgentEnv(agent_config).reset(ex)
    n = len(rollout_lib.prompt_ids(tokenizer, ex))
  except Exception as e:  # noqa: BLE001 - a malformed prompt is data, not a crash
    return f"cannot render: {type(e).__name__}: {e}"
  if n + cfg.max_new_tokens - 1 > cfg.seq_len:
    return (f"prompt of {n} tokens + max_new_tokens={cfg.max_new_tokens} does not fit "
            f"seq_len={cfg.seq_len}")
  return None


def _draw(stream: Iterator, n: int, problem: Callable[[Any], str | None],
          stats: RewardStats) -> list[Example] | None:
  """``n`` good prompts (None when the stream ends); bad ones are counted."""
  out, bad = [], []
  while len(out) < n:
    try:
      ex = next(stream)
    except StopIteration:
      return None
    why = problem(ex)
    if why is None:
      out.append(ex)
      continue
    count_reason(stats, f"bad_example:{why}"[:300])
    bad.append(why)
    if len(bad) > 4 * n:  # never loop forever on a stream of garbage
      raise VerifierFailureError(f"{len(bad)} malformed prompts while drawing {n} good ones; "
                                 f"e.g. {bad[0]!r}")
  return out


# ---------------------------------------------------------------------------
# Batches.


def training_length(episodes: Sequence[Episode], cfg: GRPOConfig) -> int:
  """Row length of a step's training arrays: the longest episode (prompt +
  response − 1 targets) rounded up to ``cfg.length_bucket``, capped at
  ``cfg.seq_len``."""
  if not cfg.length_bucket:
    return cfg.seq_len
  longest = max(len(ep.prompt_ids) + len(ep.response_ids) - 1 for ep in episodes)
  return min(cfg.seq_len, cfg.length_bucket * -(-longest // cfg.length_bucket))


def _fit(ep: Episode, seq_len: int) -> tuple[Episode, bool]:
  """Cuts an episode's response so it fits ``seq_len`` (only multi-turn ones can overflow)."""
  room = seq_len + 1 - len(ep.prompt_ids)
  if len(ep.response_ids) <= room:
    return ep, False
  return dataclasses.replace(ep, response_ids=ep.response_ids[:room],
                             policy_mask=ep.policy_mask[:room], logprobs=ep.logprobs[:room]), True


@functools.lru_cache(maxsize=8)
def _reference_fn(model_cfg: ModelConfig, temperature: float, mesh, rules):
  def fn(params, tokens, mask, targets):
    with nn.logical_axis_rules(rules):
      logits = forward(model_cfg, params, tokens, None, mask).logits
    return token_logprobs(logits, targets, temperature)
  return jax.jit(fn, out_shardings=sharding_lib.batch_sharding(mesh, rules, 2))


def reference_logprobs(model_cfg: ModelConfig, params, batch: Mapping[str, Any],
                       temperature: float, *, mesh, rules=sharding_lib.DEFAULT_RULES) -> jax.Array:
  """``token_logprobs`` of ``batch['targets']`` under ``params``. ``[B, L]`` fp32, batch-sharded.

  ``batch`` holds ``tokens``, ``mask``, ``targets`` (host or already sharded
  with ``shard_batch``). One compile per (config, T, mesh, rules, shape).
  """
  rules = sharding_lib.validate_rules(rules)
  fn = _reference_fn(model_cfg, float(temperature), mesh, rules)
  with jax.set_mesh(mesh):
    return fn(params, batch["tokens"], batch["mask"], batch["targets"])


_STEPS: dict[tuple, tuple] = {}


def _train_step(model_cfg: ModelConfig, cfg: GRPOConfig, optim: OptimConfig, mesh, rules):
  """Optimizer, state shardings and the jitted step, shared across ``train_grpo``
  calls whose loss settings agree (a notebook re-run, a resume or a config
  that only changes sampling sizes does not recompile)."""
  key = (model_cfg, tuple(getattr(cfg, f) for f in LOSS_FIELDS), optim, mesh, rules)
  if key not in _STEPS:
    if len(_STEPS) >= 4:
      _STEPS.pop(next(iter(_STEPS)))
    optimizer = make_optimizer(optim)
    _, shardings = abstract_train_state(model_cfg, optimizer, mesh, rules)
    step = make_train_step(grpo_loss(model_cfg, cfg), optimizer, mesh, shardings, rules=rules,
                           grad_accum_steps=optim.grad_accum_steps)
    _STEPS[key] = (optimizer, shardings, step)
  return _STEPS[key]


# ---------------------------------------------------------------------------
# The trainer.


class GRPORun(NamedTuple):
  """What ``train_grpo`` returns: the final state and one metrics dict per step run."""
  state: TrainState
  history: list[dict[str, float]]


def _rollout_text(episodes, scores, tokenizer, n: int, group_size: int) -> str:
  parts = []
  for i in range(0, min(len(episodes), n * group_size), group_size):
    ep, s = episodes[i], scores[i]
    head = (f"**{ep.example.domain}** `{ep.example.id}` reward {s.reward:.3f} ({s.reason})"
            f"{' truncated' if ep.truncated else ''}")
    parts.append(f"{head}\n\n    {ep.example.prompt!r}\n\n    "
                 f"{tokenizer.decode(ep.response_ids)!r}")
  return "\n\n---\n\n".join(parts)


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
               text_every: int = 10, progress: bool = True) -> GRPORun:
  """Runs GRPO until ``steps`` rollout batches have been trained on (see the module docstring).

  Args:
    model_cfg: the policy (and reference) model.
    params: initial policy params (None: random init from ``seed``).
    ref_params: the frozen reference's params (usually the initial policy);
      None is allowed only with ``cfg.kl_coef == 0`` (given with 0, the KL
      is logged but not trained on).
    prompts: a list of ``Example``s (wrapped in ``PromptStream(prompts,
      seed=seed)``) or an iterator of them; checkpointing needs an iterator
      with ``get_state``/``set_state``.
    cfg: GRPO settings; optim: optimizer settings (``grad_accum_steps`` too).
    tokenizer: e.g. ``opd.text.tokenizers.ByteTokenizer()``.
    steps: total GRPO steps (rollout batches); a resumed run continues to it.
      The optimizer takes ``cfg.updates_per_batch`` updates per step.
    mesh, rules: ``opd.parallel.sharding.make_mesh`` mesh and logical rules.
    seed: init, prompt order and per-step sampling keys.
    reward_fn: ``reward_fn(episodes)`` (see ``score_episodes``); None uses
      the task verifiers.
    agent_config, task_kwargs: passed to ``opd.rollout.episodes.rollout``.
    workdir: write ``metrics.jsonl`` and TensorBoard events there (or pass
      an open ``writer``, which is flushed, not closed).
    on_metrics: ``on_metrics(step, metrics)`` after every step.
    checkpoint_dir: resume from and save to (None: neither).
    save_every: checkpoint every this many steps (0: only at the end).
    keep_checkpoints: newest checkpoints kept.
    run_config: JSON dict saved with each checkpoint (``model`` and
      ``grpo`` are added and must match on resume).
    eval_fn: ``eval_fn(params) -> metrics`` every ``eval_every`` steps and at
      the end (logged as ``eval/...``).
    text_every: write ``cfg.num_text_samples`` rollouts as text on the first
      step of the call and every this many steps (0: the first only).
    progress: tqdm bar.

  Metrics (per step; also in the returned history): ``reward/{mean,std,min,max}``,
  ``reward/components/<name>/{mean,std}`` (``format`` and the verifier's
  components, e.g. the agent's layers), ``reward/domain/<d>/mean``,
  ``reward_reason/<category>`` counts and ``reward_reason/error_fraction``,
  ``groups/zero_std_fraction``, ``advantage/abs_mean``,
  ``response/{length_mean,length_max,truncation_rate,policy_tokens,overlong_fraction}``,
  ``train/{loss,policy_loss,kl,entropy,clip_frac_low,clip_frac_high,ratio_mean,ratio_max,
  grad_norm,lr,policy_tokens}`` (means over the step's updates),
  ``perf/{tokens_per_s,sample_tokens_per_s,train_tokens_per_s,step_time_s,rollout_time_s,
  reward_time_s,ref_time_s,train_time_s}``, ``eval/...``; text ``rollouts``.

  Raises:
    VerifierFailureError: a step's share of verifier errors and malformed
      prompts exceeded ``cfg.max_error_fraction`` (nothing was updated or
      saved for that step).
    NonFiniteError: a NaN/inf loss or gradient; the update was discarded,
      nothing saved, ``err.state`` is the state before it.
  """
  if not isinstance(cfg, GRPOConfig):
    raise ValueError(f"cfg must be a GRPOConfig, got {type(cfg).__name__}")
  if not isinstance(optim, OptimConfig):
    raise ValueError(f"optim must be an OptimConfig, got {type(optim).__name__}")
  for name, value in (("steps", steps), ("save_every", save_every), ("eval_every", eval_every),
                      ("text_every", text_every), ("keep_checkpoints", keep_checkpoints)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ValueError(f"{name} must be an int >= 0, got {value!r}")
  if keep_checkpoints < 1:
    raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
  if ref_params is None and cfg.kl_coef > 0:
    raise ValueError(f"GRPOConfig.kl_coef={cfg.kl_coef} > 0 needs ref_params (e.g. the initial "
                     "policy params)")
  if reward_fn is not None and not callable(reward_fn):
    raise ValueError(f"reward_fn must be callable or None, got {type(reward_fn).__name__}")
  if jax.process_count() > 1:
    raise ValueError("train_grpo runs in one process (rollouts gather the whole batch on the "
                     f"host); got jax.process_count()={jax.process_count()}")
  rules = sharding_lib.validate_rules(rules)
  stream = PromptStream(prompts, seed=seed) if isinstance(prompts, Sequence) else iter(prompts)
  if checkpoint_dir is not None and not (hasattr(stream, "get_state")
                                         and hasattr(stream, "set_state")):
    raise ValueError(f"checkpointing needs a prompt iterator with get_state/set_state; "
                     f"{type(stream).__name__} has none (pass a list or a PromptStream)")

  optimizer, shardings, step_fn = _train_step(model_cfg, cfg, optim, mesh, rules)
  state, _ = init_train_state(model_cfg, optimizer, mesh, rules, rng=seed, params=params)
  ref = None
  if ref_params is not None:
    ref_params = nn.meta.unbox(ref_params)
    if jax.tree.structure(ref_params) != jax.tree.structure(shardings.params):
      raise ValueError("ref_params do not have the model's parameter tree: got "
                       f"{jax.tree.structure(ref_params)}, expected "
                       f"{jax.tree.structure(shardings.params)}")
    ref = jax.tree.map(jax.device_put, ref_params, shardings.params)
  sampling = rollout_lib.sampling_for_chat(tokenizer, max_new_tokens=cfg.max_new_tokens,
                                           temperature=cfg.temperature, top_k=cfg.top_k,
                                           top_p=cfg.top_p)
  config = {**dict(run_config or {}), "model": model_cfg.to_dict(), "grpo": cfg.to_dict()}
  manager = None
  done = 0
  if checkpoint_dir is not None:
    manager = CheckpointManager(checkpoint_dir, max_to_keep=keep_checkpoints)
    if manager.latest_step() is not None:
      restored = manager.restore(state, expected_config={"model": config["model"],
                                                         "grpo": config["grpo"]})
      state, done = restored.state, int(restored.data_state["grpo_step"])
      stream.set_state(restored.data_state["prompts"])
      log.info("GRPO resumed from %s at step %d", restored.path, done)
  own_writer = writer is None and workdir is not None
  if own_writer:
    writer = MetricWriter(workdir)
  problem = functools.partial(_prompt_problem, tokenizer=tokenizer, cfg=cfg,
                              custom_reward=reward_fn is not None, agent_config=agent_config)
  bar = None
  if progress and done < steps:
    from tqdm.auto import tqdm
    bar = tqdm(total=steps, initial=done, desc="grpo", dynamic_ncols=True)
  history: list[dict[str, float]] = []
  last_saved = done if manager is not None and manager.latest_step() is not None else None
  base_key = jax.random.key(seed)
  try:
    while done < steps:
      step_no = done + 1
      t0 = time.perf_counter()
      stats = RewardStats()
      examples = _draw(stream, cfg.prompts_per_step, problem, stats)
      if examples is None:
        log.warning("prompt iterator exhausted after %d GRPO steps (asked for %d)", done, steps)
        if manager is not None and last_saved != done:
          manager.save(done, state, data_state={"grpo_step": done, "prompts": stream.get_state()},
                       config=config)
          last_saved = done
        break
      group = [ex for ex in examples for _ in range(cfg.group_size)]
      episodes = rollout_lib.rollout(
          model_cfg, state.params, tokenizer, group, jax.random.fold_in(base_key, done), sampling,
          stats=stats if reward_fn is None else None, agent_config=agent_config,
          task_kwargs=task_kwargs, mesh=mesh, rules=rules, verify=reward_fn is None,
          # Fixed sampler rows: a mixed batch's single-turn and agent parts
          # change size from step to step and would otherwise recompile.
          batch_size=cfg.batch_size)
      t1 = time.perf_counter()
      scores = score_episodes(episodes, reward_fn,
                              stats=stats if reward_fn is not None else None)
      t2 = time.perf_counter()
      try:
        stats.check(cfg.max_error_fraction)
      except VerifierFailureError as e:
        raise VerifierFailureError(f"GRPO step {step_no}: {e}") from e
      rewards = np.asarray([s.reward for s in scores]).reshape(cfg.prompts_per_step,
                                                              cfg.group_size)
      adv = group_advantages(rewards, scale_by_std=cfg.scale_advantages_by_std,
                             eps=cfg.advantage_eps)
      fitted = [_fit(ep, cfg.seq_len) for ep in episodes]
      host = rollout_lib.batch_episodes([f[0] for f in fitted],
                                        seq_len=training_length([f[0] for f in fitted], cfg),
                                        pad_id=tokenizer.pad_id)
      host["advantages"] = adv.reshape(-1)
      batch = shard_batch(host, mesh, rules)
      if ref is not None:
        batch["ref_logprobs"] = reference_logprobs(model_cfg, ref, batch, cfg.temperature,
                                                   mesh=mesh, rules=rules)
        jax.block_until_ready(batch["ref_logprobs"])
      t3 = time.perf_counter()
      update_metrics = []
      for _ in range(cfg.updates_per_batch):
        state, m = step_fn(state, batch)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        try:
          raise_if_nonfinite(m, step_no)  # names the GRPO step
        except NonFiniteError as err:
          err.state = state  # the step discarded the update: the state from before it
          raise
        update_metrics.append(m)
      t4 = time.perf_counter()

      metrics = reward_metrics(scores, episodes, cfg.group_size)
      metrics.update(stats.metrics())
      metrics["advantage/abs_mean"] = float(np.abs(adv).mean())
      metrics["response/overlong_fraction"] = float(np.mean([f[1] for f in fitted]))
      for k in update_metrics[0]:
        if k not in ("finite", "loss_finite", "grads_finite"):
          metrics[f"train/{k}"] = float(np.mean([m[k] for m in update_metrics]))
      sampled = metrics["response/policy_tokens"]
      real_tokens = float(host["mask"].sum()) * cfg.updates_per_batch
      metrics.update({
          "perf/step_time_s": t4 - t0, "perf/rollout_time_s": t1 - t0,
          "perf/reward_time_s": t2 - t1, "perf/ref_time_s": t3 - t2,
          "perf/train_time_s": t4 - t3, "perf/tokens_per_s": sampled / max(t4 - t0, 1e-9),
          "perf/sample_tokens_per_s": sampled / max(t1 - t0, 1e-9),
          "perf/train_tokens_per_s": real_tokens / max(t4 - t3, 1e-9)})
      done = step_no
      if eval_fn is not None and ((eval_every and done % eval_every == 0) or done == steps):
        metrics.update({f"eval/{k}": float(v) for k, v in eval_fn(state.params).items()})
      history.append(metrics)
      if writer is not None:
        writer.write_scalars(done, metrics)
        first = len(history) == 1
        if cfg.num_text_samples and (first or (text_every and done % text_every == 0)):
          writer.write_texts(done, {"rollouts": _rollout_text(
              episodes, scores, tokenizer, cfg.num_text_samples, cfg.group_size)})
      if on_metrics is not None:
        on_metrics(done, metrics)
      if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
      if manager is not None and ((save_every and done % save_every == 0) or done == steps):
        manager.save(done, state, data_state={"grpo_step": done, "prompts": stream.get_state()},
                     config=config, metrics=metrics)
        last_saved = done
  finally:
    if bar is not None:
      bar.close()
    if writer is not None:
      writer.flush()
      if own_writer:
        writer.close()
    if manager is not None:
      manager.wait()
      manager.close()
  return GRPORun(state, history)
