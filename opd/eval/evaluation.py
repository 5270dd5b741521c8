"""Evaluation: per-domain scores of a model on the task suite's test split.

``evaluate`` runs one model over ``n_per_domain`` test examples of each
domain and scores every response with the domain's verifier (SPEC §9):

  greedy (temperature 0), one response per example:
    pass@1    % of examples solved (reward >= ``solved_threshold``)
    reward@1  mean reward in % (several domains give partial credit)
    format@1  mean format reward in %
  sampled (``temperature``/``top_p``), N = ``num_samples`` per example:
    mean@N    mean reward over the N samples, averaged over examples, in %
    solved@N  % of the N samples that solve the example, averaged over
              examples (the sampled estimate of pass@1)
    format@N  mean format reward in %

Every score carries a bootstrap standard error over examples: examples are
resampled with replacement (an example's N samples stay together, so the
SE reflects the spread between problems, not only sampling noise), and the
SE is the standard deviation of the resampled means (``bootstrap_se``).
Scores and SEs are on a 0-100 scale everywhere (results, JSON, tables).

Cost: the examples of all domains go through the sampler in chunks of
exactly ``batch_size`` rows (the last chunk padded), single-turn prompts are
left-padded to one common length, and the sampler is jitted on (shapes,
model config, sampling config), so a whole evaluation compiles a handful of
programs (greedy/sampled × single-turn/agent turns) and later models of the
same config compile nothing. Identical (example, response) pairs are
verified once, which matters for the code sandbox.

``results_table`` renders models × domains as markdown (``mean ± se``),
``save_results``/``load_results`` round-trip JSON, and ``heatmap`` draws a
PNG of one metric.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import time
import zlib
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from opd.rollout import episodes as rl
from opd import tasks as tasks_lib
from opd.models import ModelConfig
from opd.tasks import ALL_DOMAINS, DIFFICULTIES, Example, Reward

GREEDY_METRICS = ("pass@1", "reward@1", "format@1")
_SOLVED_EPS = 1e-9  # agent rewards are weighted float sums: 1.0 may come out as 0.9999999999


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What to evaluate and how.

  Attributes:
    domains: domains to score, a subset of ``opd.tasks.ALL_DOMAINS``.
    n_per_domain: distinct test-split examples per domain.
    difficulty: 1 to 3.
    seed: selects the examples, the sampling key (unless ``evaluate`` gets
      ``rng``) and the bootstrap resamples; >= 0.
    greedy: run the greedy pass (pass@1, reward@1, format@1).
    num_samples: N for mean@N/solved@N/format@N; 0 skips the sampled pass.
    temperature: sampling temperature of the sampled pass, > 0.
    top_p: nucleus mass of the sampled pass, in (0, 1].
    max_new_tokens: tokens per response (per assistant turn for agent).
    bootstrap_samples: resamples for the standard errors, >= 2.
    batch_size: rows per sampler call; every call has exactly this many.
    prompt_bucket: prompts are left-padded to a multiple of this; all
      single-turn prompts share one padded length.
    solved_threshold: reward at or above which an example counts as solved,
      in (0, 1].
    num_transcripts: example transcripts kept per domain for the report.
  """
  domains: tuple[str, ...] = ALL_DOMAINS
  n_per_domain: int = 20
  difficulty: int = 1
  seed: int = 0
  greedy: bool = True
  num_samples: int = 4
  temperature: float = 1.0
  top_p: float = 1.0
  max_new_tokens: int = 64
  bootstrap_samples: int = 1000
  batch_size: int = 64
  prompt_bucket: int = 64
  solved_threshold: float = 1.0
  num_transcripts: int = 2

  def __post_init__(self):
    domains = self.domains
    if isinstance(domains, str) or not isinstance(domains, Sequence) or not domains:
      raise ValueError(f"EvalConfig.domains must be a non-empty sequence of domain names, "
                       f"got {domains!r}")
    unknown = [d for d in domains if d not in ALL_DOMAINS]
    if unknown:
      raise ValueError(f"EvalConfig.domains has unknown domain(s) {unknown} in {domains!r}; "
                       f"known: {ALL_DOMAINS}")
    if len(set(domains)) != len(domains):
      raise ValueError(f"EvalConfig.domains has duplicates: {domains!r}")
    object.__setattr__(self, "domains", tuple(domains))
    for name, minimum in (("n_per_domain", 1), ("seed", 0), ("num_samples", 0),
                          ("max_new_tokens", 1), ("bootstrap_samples", 2), ("batch_size", 1),
                          ("prompt_bucket", 1), ("num_transcripts", 0)):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"EvalConfig.{name} must be an int >= {minimum}, got {value!r}")
      object.__setattr__(self, name, int(value))
    if self.difficulty not in DIFFICULTIES:
      raise ValueError(f"EvalConfig.difficulty must be one of {DIFFICULTIES}, "
                       f"got {self.difficulty!r}")
    if not isinstance(self.greedy, bool):
      raise ValueError(f"EvalConfig.greedy must be a bool, got {self.greedy!r}")
    if not self.greedy and self.num_samples == 0:
      raise ValueError("EvalConfig has nothing to evaluate: greedy=False and num_samples=0")
    for name, lo, hi, lo_open in (("temperature", 0.0, math.inf, True), ("top_p", 0.0, 1.0, True),
                                  ("solved_threshold", 0.0, 1.0, True)):
      value = getattr(self, name)
      if (isinstance(value, bool) or not isinstance(value, (int, float, np.number))
          or not math.isfinite(value) or value <= lo or value > hi):
        raise ValueError(f"EvalConfig.{name} must be a finite number in ({lo}, {hi}], "
                         f"got {value!r}")
      object.__setattr__(self, name, float(value))

  @property
  def sampled_metrics(self) -> tuple[str, ...]:
    N = self.num_samples
    return (f"mean@{N}", f"solved@{N}", f"format@{N}") if N else ()

  @property
  def metrics(self) -> tuple[str, ...]:
    return (GREEDY_METRICS if self.greedy else ()) + self.sampled_metrics


@dataclasses.dataclass(frozen=True)
class Score:
  """A score and its bootstrap standard error, both on the 0-100 scale."""
  value: float
  se: float

  def __str__(self) -> str:
    return f"{self.value:.1f} ± {self.se:.1f}"


@dataclasses.dataclass
class DomainResult:
  """One model on one domain (n = number of examples, N = num_samples).

  Attributes:
    metrics: name -> Score (see the module docstring).
    example_ids: [n] the evaluated examples, in order.
    greedy_rewards, greedy_format: [n] in [0, 1]; None without a greedy pass.
    sampled_rewards, sampled_format: [n][N] in [0, 1]; None without samples.
    reasons: mode ("greedy"/"sampled") -> reward-reason category -> count.
    transcripts: a few dicts with id, prompt, response, reference, reward,
      reason (greedy responses when there are any).
  """
  domain: str
  metrics: dict[str, Score]
  example_ids: list[str]
  greedy_rewards: list[float] | None
  greedy_format: list[float] | None
  sampled_rewards: list[list[float]] | None
  sampled_format: list[list[float]] | None
  reasons: dict[str, dict[str, int]]
  transcripts: list[dict[str, Any]]


@dataclasses.dataclass
class EvalResult:
  """One model on every domain of ``config``; ``seconds`` splits the wall time."""
  name: str
  config: EvalConfig
  domains: dict[str, DomainResult]
  seconds: dict[str, float]

  def score(self, domain: str, metric: str) -> Score:
    if domain not in self.domains:
      raise ValueError(f"result {self.name!r} has no domain {domain!r}; has {list(self.domains)}")
    metrics = self.domains[domain].metrics
    if metric not in metrics:
      raise ValueError(f"result {self.name!r} has no metric {metric!r}; has {list(metrics)}")
    return metrics[metric]

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["config"] = dataclasses.asdict(self.config)
    return out

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "EvalResult":
    domains = {}
    for name, dr in d["domains"].items():
      dr = dict(dr)
      dr["metrics"] = {k: Score(**v) for k, v in dr["metrics"].items()}
      domains[name] = DomainResult(**dr)
    return cls(d["name"], EvalConfig(**d["config"]), domains, dict(d["seconds"]))


def bootstrap_seed(seed: int, domain: str) -> tuple[int, int]:
  """The ``np.random.default_rng`` seed of a domain's resamples. It does not
  depend on the model, so models are compared on the same resamples."""
  return (int(seed), zlib.crc32(domain.encode()))


def bootstrap_se(values, num_resamples: int, seed) -> float:
  """Bootstrap standard error of the mean over examples.

  Args:
    values: ``[n]`` one value per example, or ``[n, N]`` N values per
      example that are resampled together (the row mean is the example's
      value).
    num_resamples: B >= 2 resamples of n examples drawn with replacement.
    seed: anything ``np.random.default_rng`` takes; resample b uses the
      b-th row of ``rng.integers(0, n, size=(B, n))``.

  Returns:
    The standard deviation (ddof=1) of the B resampled means, in the units
    of ``values``.
  """
  x = np.asarray(values, np.float64)
  if x.ndim not in (1, 2) or x.shape[0] == 0 or x.size == 0:
    raise ValueError(f"values must be a non-empty [n] or [n, N] array, got shape {x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError("values must be finite")
  if not isinstance(num_resamples, (int, np.integer)) or num_resamples < 2:
    raise ValueError(f"num_resamples must be an int >= 2, got {num_resamples!r}")
  if x.ndim == 2:
    x = x.mean(axis=1)
  n = x.shape[0]
  rng = np.random.default_rng(seed)
  # Blocks bound memory (B * n indices); rows come off the stream in order.
  rows = max(1, (1 << 22) // n)
  means = np.concatenate([x[rng.integers(0, n, size=(min(rows, num_resamples - b), n))].mean(1)
                          for b in range(0, num_resamples, rows)])
  return float(means.std(ddof=1))


def eval_examples(cfg: EvalConfig) -> dict[str, list[Example]]:
  """``cfg.n_per_domain`` distinct test examples of each domain (deterministic)."""
  return {d: tasks_lib.get_task(d).examples("test", cfg.n_per_domain, seed=cfg.seed,
                                            difficulty=cfg.difficulty)
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
  if rng is None or isinstance(rng, (int, np.integer)):
    key = jax.random.key(cfg.seed if rng is None else int(rng))
  else:
    key = rng
  runner = _Runner(model_cfg, params, tokenizer, cfg, mesh, rules, dict(task_kwargs or {}),
                   agent_config, flat)
  greedy = sampled = None
  if cfg.greedy:
    greedy = runner.run(flat, _sampling(tokenizer, cfg, 0.0), key)
  if cfg.num_samples:
    rows = [ex for ex in flat for _ in range(cfg.num_samples)]
    sampled = runner.run(rows, _sampling(tokenizer, cfg, cfg.temperature),
                         jax.random.fold_in(key, 1))
  t_metrics = time.perf_counter()
  domains, start = {}, 0
  for d in cfg.domains:
    n = len(examples[d])
    g = greedy[start:start + n] if greedy is not None else None
    s = (sampled[start * cfg.num_samples:(start + n) * cfg.num_samples]
         if sampled is not None else None)
    domains[d] = _domain_result(d, examples[d], g, s, cfg, tokenizer)
    start += n
  seconds = {"generate": runner.generate_s, "verify": runner.verify_s,
             "metrics": time.perf_counter() - t_metrics, "total": time.perf_counter() - t_start}
  return EvalResult(name, cfg, domains, seconds)


def _sampling(tokenizer, cfg: EvalConfig, temperature: float):
  return rl.sampling_for_chat(tokenizer, max_new_tokens=cfg.max_new_tokens,
                              temperature=temperature,
                              top_p=cfg.top_p if temperature > 0 else 1.0)


class _Runner:
  """Generates and verifies lists of examples in fixed-size chunks."""

  def __init__(self, model_cfg, params, tokenizer, cfg, mesh, rules, task_kwargs, agent_config,
               all_examples):
    self.model_cfg, self.params, self.tok, self.cfg = model_cfg, params, tokenizer, cfg
    self.mesh, self.rules, self.agent_config = mesh, rules, agent_config
    self.tasks = {d: tasks_lib.get_task(d, **task_kwargs.get(d, {})) for d in cfg.domains}
    self.prompts = {ex.id: rl.prompt_ids(tokenizer, ex) for ex in all_examples}
    single = [len(self.prompts[ex.id]) for ex in all_examples if ex.domain != "agent"]
    # One bucket that holds every single-turn prompt: one prefill shape.
    self.single_bucket = cfg.prompt_bucket * math.ceil(max(single, default=1) / cfg.prompt_bucket)
    self.verified: dict[tuple[str, str], Reward] = {}
    self.generate_s = self.verify_s = 0.0

  def run(self, examples: Sequence[Example], sampling, key) -> list[rl.Episode]:
    B = self.cfg.batch_size
    episodes: list[rl.Episode | None] = [None] * len(examples)
    single = [i for i, ex in enumerate(examples) if ex.domain != "agent"]
    agent = [i for i, ex in enumerate(examples) if ex.domain == "agent"]
    chunk = 0
    for c in range(0, len(single), B):
      idx = single[c:c + B]
      t0 = time.perf_counter()
      comps = rl.sample(self.model_cfg, self.params, self.tok,
                        [self.prompts[examples[i].id] for i in idx],
                        jax.random.fold_in(key, chunk), sampling, batch_size=B,
                        prompt_bucket=self.single_bucket, mesh=self.mesh, rules=self.rules)
      self.generate_s += time.perf_counter() - t0
      chunk += 1
      for i, comp in zip(idx, comps):
        episodes[i] = rl.Episode(examples[i], self.prompts[examples[i].id], comp.ids,
                                 np.ones(len(comp.ids), bool), comp.logprobs, [comp.text],
                                 not comp.finished)
    self._verify([episodes[i] for i in single])
    for c in range(0, len(agent), B):
      idx = agent[c:c + B]
      # rollout_agent samples len(examples) rows per turn: pad to B rows so
      # every chunk reuses the same compiled turn shapes.
      chunk_ex = [examples[i] for i in idx]
      chunk_ex += [chunk_ex[0]] * (B - len(chunk_ex))
      t0 = time.perf_counter()
      eps = rl.rollout_agent(self.model_cfg, self.params, self.tok, chunk_ex,
                             jax.random.fold_in(key, chunk), sampling, config=self.agent_config,
                             prompt_bucket=self.cfg.prompt_bucket, mesh=self.mesh,
                             rules=self.rules)
      self.generate_s += time.perf_counter() - t0
      chunk += 1
      for i, ep in zip(idx, eps):
        episodes[i] = ep
    return episodes  # type: ignore[return-value]

  def _verify(self, episodes: Sequence[rl.Episode]):
    """Sets ``ep.reward``; each distinct (example, response) is verified once."""
    t0 = time.perf_counter()
    todo: dict[str, dict[tuple[str, str], Example]] = collections.defaultdict(dict)
    for ep in episodes:
      k = (ep.example.id, ep.turns[0])
      if k not in self.verified:
        todo[ep.example.domain][k] = ep.example
    for domain, pairs in todo.items():
      got = tasks_lib.safe_verify_batch(self.tasks[domain], list(pairs.values()),
                                        [text for _, text in pairs])
      self.verified.update(zip(pairs, got))
    for ep in episodes:
      ep.reward = self.verified[ep.example.id, ep.turns[0]]
    self.verify_s += time.perf_counter() - t0


def _domain_result(domain: str, examples: Sequence[Example], greedy, sampled, cfg: EvalConfig,
                   tokenizer) -> DomainResult:
  n, N = len(examples), cfg.num_samples
  seed = bootstrap_seed(cfg.seed, domain)
  thr = cfg.solved_threshold - _SOLVED_EPS
  metrics: dict[str, Score] = {}
  reasons: dict[str, dict[str, int]] = {}

  def score(values) -> Score:
    return Score(100.0 * float(np.mean(values)),
                 100.0 * bootstrap_se(values, cfg.bootstrap_samples, seed))

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


def _grid(results: Sequence[EvalResult], metric: str) -> tuple[list[str], list[list[Score | None]]]:
  """Domains (union, first-seen order) and ``[model][domain]`` scores (None if absent)."""
  if not results:
    raise ValueError("results must not be empty")
  domains = list(dict.fromkeys(d for r in results for d in r.domains))
  for r in results:
    have = {m for dr in r.domains.values() for m in dr.metrics}
    if metric not in have:
      raise ValueError(f"metric={metric!r} is not in result {r.name!r}; it has {sorted(have)}")
  return domains, [[r.domains[d].metrics.get(metric) if d in r.domains else None
                    for d in domains] for r in results]


def results_table(results: Sequence[EvalResult], metric: str = "pass@1") -> str:
  """Markdown table, models × domains, cells ``mean ± se`` (0-100).

  The last column averages the domains; its SE treats the domains as
  independent, ``sqrt(sum se^2) / #domains``. Missing cells show ``–``.
  """
  domains, grid = _grid(results, metric)
  lines = [f"| {metric} | " + " | ".join(domains) + " | avg |",
           "|---|" + "---:|" * (len(domains) + 1)]
  for r, row in zip(results, grid):
    cells = [str(s) if s is not None else "–" for s in row]
    if all(s is not None for s in row):
      avg = Score(float(np.mean([s.value for s in row])),
                  float(math.sqrt(sum(s.se ** 2 for s in row)) / len(row)))
      cells.append(str(avg))
    else:
      cells.append("–")
    lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def save_results(results: Sequence[EvalResult], out_dir: str) -> dict[str, str]:
  """Writes ``results.json`` (everything, ``load_results`` reads it back)
  and ``results.md`` (one table per metric, then the transcripts).

  Returns:
    ``{"json": path, "markdown": path}``.
  """
  if not results:
    raise ValueError("results must not be empty")
  os.makedirs(out_dir, exist_ok=True)
  paths = {"json": os.path.join(out_dir, "results.json"),
           "markdown": os.path.join(out_dir, "results.md")}
  with open(paths["json"], "w") as f:
    json.dump({"scale": "0-100", "results": [r.to_dict() for r in results]}, f)
  metrics = list(dict.fromkeys(m for r in results for m in r.config.metrics))
  parts = ["# Evaluation\n", "Scores in %, mean ± bootstrap standard error over examples.\n"]
  for m in metrics:
    if all(m in r.config.metrics for r in results):
      parts += [f"## {m}\n", results_table(results, m)]
  parts.append("## Transcripts\n")
  for r in results:
    for d, dr in r.domains.items():
      for t in dr.transcripts:
        parts.append(f"- **{r.name} / {d}** reward {t['reward']:.2f} ({t['reason']}): "
                     f"{json.dumps(t['prompt'])} → {json.dumps(t['response'])}")
  with open(paths["markdown"], "w") as f:
    f.write("\n".join(parts) + "\n")
  return paths


def load_results(path: str) -> list[EvalResult]:
  """Reads a ``results.json`` written by ``save_results``."""
  with open(path) as f:
    data = json.load(f)
  return [EvalResult.from_dict(r) for r in data["results"]]


def heatmap_figure(results: Sequence[EvalResult], metric: str = "pass@1"):
  """A matplotlib Figure: models × domains, colour = score (0-100), cells
  annotated ``value\\n±se``; missing cells are blank and marked ``–``."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  domains, grid = _grid(results, metric)
  values = np.array([[s.value if s is not None else np.nan for s in row] for row in grid])
  fig = Figure(figsize=(1.3 * len(domains) + 2.5, 0.55 * len(results) + 1.6))
  FigureCanvasAgg(fig)  # no pyplot: nothing global changes, no display needed
  ax = fig.add_subplot()
  im = ax.imshow(values, vmin=0, vmax=100, cmap="viridis", aspect="auto")
  ax.set_xticks(range(len(domains)), domains)
  ax.set_yticks(range(len(results)), [r.name for r in results])
  for i, row in enumerate(grid):
    for j, s in enumerate(row):
      text = "–" if s is None else f"{s.value:.1f}\n±{s.se:.1f}"
      dark = s is not None and s.value < 60
      ax.text(j, i, text, ha="center", va="center", fontsize=8,
              color="white" if dark else "black")
  ax.set_title(f"{metric} (%)")
  fig.colorbar(im, ax=ax)
  fig.tight_layout()
  return fig


def heatmap(results: Sequence[EvalResult], path: str, metric: str = "pass@1") -> str:
  """Saves ``heatmap_figure(results, metric)`` as a PNG at ``path``; returns ``path``."""
  fig = heatmap_figure(results, metric)
  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=100)
  return path
