"""What an evaluation measures and what it returns (docs/DESIGN.md §9).

Per domain, on ``EvalConfig.n_per_domain`` test examples:

  greedy (temperature 0), one response per example:
    pass@1    % of examples solved (reward >= ``solved_threshold``)
    reward@1  mean reward in % (several domains give partial credit)
    format@1  mean format reward in %
  sampled (``temperature``/``top_p``), N = ``num_samples`` per example:
    mean@N    mean reward over the N samples, averaged over examples, in %
    solved@N  % of the N samples that solve the example, averaged over
              examples (the sampled estimate of pass@1)
    format@N  mean format reward in %

Every metric is an ``opd.eval.stats.Estimate``: the mean and its bootstrap
standard error over examples, both on a 0-100 scale everywhere (results,
JSON, tables).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from opd.config.fields import check_fields, check_int, set_field
from opd.eval.stats import Estimate
from opd.tasks import ALL_DOMAINS, DIFFICULTIES

GREEDY_METRICS = ("pass@1", "reward@1", "format@1")


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
    all_if_fewer: a domain whose test split holds fewer than ``n_per_domain``
      distinct problems at ``difficulty`` is scored on all of them (at level
      1 writing holds 62, instruct 195) instead of refused.
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
  all_if_fewer: bool = False

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
    set_field(self, "domains", tuple(domains))
    check_fields(self, "EvalConfig",
                 ints={"n_per_domain": 1, "seed": 0, "num_samples": 0, "max_new_tokens": 1,
                       "bootstrap_samples": 2, "batch_size": 1, "prompt_bucket": 1,
                       "num_transcripts": 0},
                 bools=("greedy", "all_if_fewer"))
    set_field(self, "difficulty", check_int("EvalConfig", "difficulty", self.difficulty,
                                            min_value=DIFFICULTIES[0],
                                            max_value=DIFFICULTIES[-1]))
    if not self.greedy and self.num_samples == 0:
      raise ValueError("EvalConfig has nothing to evaluate: greedy=False and num_samples=0")
    check_fields(self, "EvalConfig", positive=("temperature",),
                 floats=dict.fromkeys(("top_p", "solved_threshold"),
                                      dict(min_value=0.0, min_exclusive=True, max_value=1.0)))

  @property
  def sampled_metrics(self) -> tuple[str, ...]:
    N = self.num_samples
    return (f"mean@{N}", f"solved@{N}", f"format@{N}") if N else ()

  @property
  def metrics(self) -> tuple[str, ...]:
    return (GREEDY_METRICS if self.greedy else ()) + self.sampled_metrics


@dataclasses.dataclass
class DomainResult:
  """One model on one domain (n = number of examples, N = num_samples).

  Attributes:
    metrics: name -> Estimate (see the module docstring).
    example_ids: [n] the evaluated examples, in order.
    greedy_rewards, greedy_format: [n] in [0, 1]; None without a greedy pass.
    sampled_rewards, sampled_format: [n][N] in [0, 1]; None without samples.
    reasons: mode ("greedy"/"sampled") -> reward-reason category -> count.
    transcripts: a few dicts with id, prompt, response, reference, reward,
      reason (greedy responses when there are any).
  """
  domain: str
  metrics: dict[str, Estimate]
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

  def score(self, domain: str, metric: str) -> Estimate:
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
      dr["metrics"] = {k: Estimate(**v) for k, v in dr["metrics"].items()}
      domains[name] = DomainResult(**dr)
    return cls(d["name"], EvalConfig(**d["config"]), domains, dict(d["seconds"]))
