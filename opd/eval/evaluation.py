"""Evaluation: per-domain scores of a model on the task suite's test split.

``evaluate`` runs one model over ``n_per_domain`` test examples of each
domain through ``opd.rollout.rollout`` and scores every response with the
domain's verifier (docs/DESIGN.md §9): a greedy pass (pass@1, reward@1,
format@1) and a sampled pass (mean@N, solved@N, format@N); the metrics are
defined in ``opd.eval.results`` and carry bootstrap standard errors
(``opd.eval.stats``).

Cost: rollout runs chunked (``rollout(chunked=True)``): every sampler call
has exactly ``batch_size`` rows, single-turn prompts share one padded
length, and the sampler is jitted on (shapes, model config, sampling
config), so a whole evaluation compiles a handful of programs (greedy /
sampled × single-turn / agent turns) and later models of the same config
compile nothing. Identical (example, response) pairs are verified once
across both passes, which matters for the code sandbox.

Keys: the greedy pass runs with ``key`` and the sampled one with
``jax.random.fold_in(key, 1)``, where ``key`` is ``rng`` or
``jax.random.key(cfg.seed)``; within a pass chunk c samples with
``fold_in(pass key, c)``.

Reports (tables, JSON, heatmaps) are in ``opd.eval.report``; its functions
are re-exported here for the launchers.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from opd import rollout as rollout_lib
from opd import tasks as tasks_lib
from opd.eval.report import heatmap, heatmap_figure, load_results, results_table, save_results
from opd.eval.results import GREEDY_METRICS, DomainResult, EvalConfig, EvalResult
from opd.eval.stats import Estimate, bootstrap_se, bootstrap_seed, estimate
from opd.models import ModelConfig
from opd.tasks import Example

__all__ = ["GREEDY_METRICS", "DomainResult", "EvalConfig", "EvalResult", "Estimate",
           "bootstrap_se", "bootstrap_seed", "eval_examples", "evaluate", "heatmap",
           "heatmap_figure", "load_results", "results_table", "save_results"]

_SOLVED_EPS = 1e-9  # agent rewards are weighted float sums: 1.0 may come out as 0.9999999999


def eval_examples(cfg: EvalConfig) -> dict[str, list[Example]]:
  """``cfg.n_per_domain`` distinct test examples of each domain (deterministic);
  with ``cfg.all_if_fewer`` a domain holding fewer gets all it has."""
  return {d: tasks_lib.get_task(d).examples("test", cfg.n_per_domain, seed=cfg.seed,
                                            difficulty=cfg.difficulty,
                                            at_most=cfg.all_if_fewer)
          for d in cfg.domains}


def evaluate(model_cfg: ModelConfig, params, tokenizer, cfg: EvalConfig, *, rng=None,
             name: str = "model", mesh=None, rules=None,
             task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
             agent_config: tasks_lib.AgentRewardConfig | None = None) -> EvalResult:
  """Scores one model on ``cfg.domains`` (see the module docstring).

  Args:
    model_cfg, params, tokenizer: the policy.
    cfg: an ``EvalConfig``.
    rng: int seed or ``jax.random.key`` for the sampled pass (default
      ``cfg.seed``). Greedy responses do not depend on it.
    name: the model's row label in tables and plots.
    mesh, rules: passed to the sampler (``batch_size`` must then divide
      over the devices that shard ``batch``).
    task_kwargs: per-domain constructor arguments (e.g. the code sandbox).
    agent_config: agent reward weights.

  Returns:
    An ``EvalResult``.
  """
  if not isinstance(cfg, EvalConfig):
    raise ValueError(f"cfg must be an EvalConfig, got {type(cfg).__name__}")
  if not isinstance(name, str) or not name or "|" in name:
    raise ValueError(f"name must be a non-empty string without '|', got {name!r}")
  t_start = time.perf_counter()
  examples = eval_examples(cfg)
  flat = [ex for d in cfg.domains for ex in examples[d]]
  key = rollout_lib.as_key(cfg.seed if rng is None else rng)
  log = rollout_lib.RolloutLog(timings={"generate": 0.0, "verify": 0.0})
  timings = log.timings
  policy = rollout_lib.Policy(model_cfg, params, tokenizer, mesh, rules)
  task_kwargs = rollout_lib.with_agent_config(task_kwargs, agent_config)

  def run(rows: Sequence[Example], temperature: float, pass_key) -> list[rollout_lib.Episode]:
    sampling = rollout_lib.sampling_for_chat(
        tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=temperature,
        top_p=cfg.top_p if temperature > 0 else 1.0)
    return rollout_lib.rollout(
        policy, rows, pass_key, sampling, log=log, task_kwargs=task_kwargs,
        prompt_bucket=cfg.prompt_bucket, batch_size=cfg.batch_size, chunked=True)

  greedy = run(flat, 0.0, key) if cfg.greedy else None
  sampled = None
  if cfg.num_samples:
    rows = [ex for ex in flat for _ in range(cfg.num_samples)]
    sampled = run(rows, cfg.temperature, jax.random.fold_in(key, 1))
  t_metrics = time.perf_counter()
  domains, start = {}, 0
  for d in cfg.domains:
    n = len(examples[d])
    g = greedy[start:start + n] if greedy is not None else None
    s = (sampled[start * cfg.num_samples:(start + n) * cfg.num_samples]
         if sampled is not None else None)
    domains[d] = _domain_result(d, examples[d], g, s, cfg, tokenizer)
    start += n
  seconds = {**timings, "metrics": time.perf_counter() - t_metrics,
             "total": time.perf_counter() - t_start}
  return EvalResult(name, cfg, domains, seconds)


def _domain_result(domain: str, examples: Sequence[Example], greedy, sampled, cfg: EvalConfig,
                   tokenizer) -> DomainResult:
  n, N = len(examples), cfg.num_samples
  seed = bootstrap_seed(cfg.seed, domain)
  thr = cfg.solved_threshold - _SOLVED_EPS
  metrics: dict[str, Estimate] = {}
  reasons: dict[str, dict[str, int]] = {}

  def score(values) -> Estimate:
    return estimate(values, cfg.bootstrap_samples, seed)

  g_rew = g_fmt = s_rew = s_fmt = None
  if greedy is not None:
    g_rew = [float(ep.reward.reward) for ep in greedy]
    g_fmt = [float(ep.reward.format) for ep in greedy]
    metrics["pass@1"] = score(np.asarray(g_rew) >= thr)
    metrics["reward@1"] = score(g_rew)
    metrics["format@1"] = score(g_fmt)
    reasons["greedy"] = dict(collections.Counter(ep.reward.category for ep in greedy))
  if sampled is not None:
    s_rew = np.asarray([ep.reward.reward for ep in sampled], np.float64).reshape(n, N)
    s_fmt = np.asarray([ep.reward.format for ep in sampled], np.float64).reshape(n, N)
    metrics[f"mean@{N}"] = score(s_rew)
    metrics[f"solved@{N}"] = score(s_rew >= thr)
    metrics[f"format@{N}"] = score(s_fmt)
    reasons["sampled"] = dict(collections.Counter(ep.reward.category for ep in sampled))
    s_rew, s_fmt = s_rew.tolist(), s_fmt.tolist()
  shown = greedy if greedy is not None else sampled[::N]
  transcripts = [{"id": ep.example.id, "prompt": ep.example.prompt,
                  "response": tokenizer.decode(ep.response_ids),
                  "reference": " | ".join(c for _, c in ep.example.reference),
                  "reward": float(ep.reward.reward), "reason": ep.reward.reason}
                 for ep in shown[:cfg.num_transcripts]]
  return DomainResult(domain, metrics, [ex.id for ex in examples], g_rew, g_fmt, s_rew, s_fmt,
                      reasons, transcripts)
