"""The GENCLUSTER steps between the policy and the submissions (docs/DESIGN.md §7).

``sample_texts`` draws policy responses in fixed-size sampler batches;
``model_judge`` wraps a model as the tournament's pairwise judge;
``parse_candidates`` drops candidates that do not parse or compile;
``hidden_passes`` judges candidates on the subtasks' hidden tests (the
reference's outputs are the expected ones); ``cluster_and_rank`` clusters a
subtask's candidates on its test inputs and ranks the clusters;
``strategy_rankings`` gives each compared strategy's ranked clusters for
``submission.submit``.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from grm.format import user_prompt_ids
from grm.gencluster import clustering, execution, submission
from grm.gencluster import tournament as tournament_lib
from grm.gencluster.problems import Problem
from grm.pairwise import SCORE_PATTERN
from opd.rollout.constraint import compile_patterns
from opd.text import parsers


def sample_texts(policy, prompts: Sequence[str], *, seed: int, sampling, batch_size: int,
                 desc: str = "sample", constraint=None) -> list[str]:
  """One response of ``policy`` (an ``opd.rollout.Policy``) per user prompt,
  ``batch_size`` rows per sampler call (the last batch padded, and every
  batch's prompts left-padded to the longest prompt of all, so one compiled
  sampler serves every call); ``constraint``: an
  ``opd.rollout.constraint.TokenAutomaton`` whose first pattern every row follows."""
  import jax  # noqa: PLC0415 (jax-heavy; the rest of the module is not)
  from opd.rollout import policy as policy_lib  # noqa: PLC0415
  ids = [user_prompt_ids(policy.tokenizer, p) for p in prompts]
  out: list[str] = []
  if not ids:
    return out
  bucket = 32 * math.ceil(max(len(x) for x in ids) / 32)
  for b, start in enumerate(tqdm(range(0, len(ids), batch_size), desc=desc, leave=False)):
    chunk = ids[start:start + batch_size]
    out += [c.text for c in policy_lib.sample(
        policy, chunk, jax.random.fold_in(jax.random.key(int(seed)), b), sampling,
        batch_size=batch_size, prompt_bucket=bucket, constraint=constraint)]
  return out


def model_judge(policy, sampling, *, batch_size: int,
                constrained: bool = False) -> tournament_lib.JudgeFn:
  """A model (an ``opd.rollout.Policy``) as the pairwise judge: its completion
  for each prompt text (``constrained``: decoded under ``grm.pairwise.SCORE_PATTERN``)."""
  constraint = None
  if constrained:
    constraint = compile_patterns([SCORE_PATTERN], policy.tokenizer, end_ids=sampling.end_ids,
                                  vocab_size=policy.model_cfg.vocab_size)

  def judge(texts: Sequence[str], seed: int) -> list[str]:
    return sample_texts(policy, texts, seed=seed, sampling=sampling, batch_size=batch_size,
                        desc="judge", constraint=constraint)

  return judge


def reasoning_length(text: str) -> int:
  """Characters the policy wrote (thinking block, if any, plus the answer)."""
  return len(text)


def parse_candidates(texts: Sequence[str], n_args: int) -> tuple[list[str | None], dict[str, int]]:
  """Each response's program when it parses (``f`` with ``n_args`` parameters) and
  compiles, else None; counts ``parsed``, ``dropped_parse`` and ``dropped_compile``."""
  out: list[str | None] = []
  counts = {"parsed": 0, "dropped_parse": 0, "dropped_compile": 0}
  for text in texts:
    code = parsers.extract_python_function(text, "f", n_args)
    if not code.ok:
      counts["dropped_parse"] += 1
      out.append(None)
      continue
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        compile(code.source, "<candidate>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
      counts["dropped_compile"] += 1
      out.append(None)
      continue
    counts["parsed"] += 1
    out.append(code.source)
  return out, counts


def hidden_inputs(problem: Problem) -> tuple[list[tuple], list[slice]]:
  """All subtasks' hidden inputs, concatenated, and each subtask's slice."""
  flat, slices = [], []
  for sub in problem.subtasks:
    slices.append(slice(len(flat), len(flat) + len(sub.hidden)))
    flat += list(sub.hidden)
  return flat, slices


def check_reference(problem: Problem, ref: execution.Outputs, test_outputs: execution.Outputs
                    ) -> None:
  """Raises unless the reference ran cleanly on every hidden input and reproduced
  the code task's own expected outputs (``problem.tests``, from its callables)."""
  if not ref.ok or clustering.is_bad(ref):
    raise ValueError(f"problem {problem.id}: the reference failed on a hidden input "
                     f"({ref.failure or [v for v in ref.values if not v.startswith('ok:')][:1]})")
  want = [f"ok:{e!r}" for _, e in problem.tests]
  if not test_outputs.ok or list(test_outputs.values) != want:
    raise ValueError(f"problem {problem.id}: the reference gives {test_outputs.values} on the "
                     f"task's tests, the task's callables {want}")


def hidden_passes(sandbox, problems: Sequence[Problem], sources: Sequence[Sequence[str | None]],
                  **run_kwargs) -> list[list[frozenset[int]]]:
  """Per problem and candidate, the subtasks whose hidden tests it passes.

  ``sources[p][c]``: candidate c's program (None: not parsed, passes nothing).
  Every problem's reference runs in the same batch (on the hidden inputs and
  on the task's own tests, ``check_reference``).
  """
  progs, inputs, owner = [], [], []
  for p, prob in enumerate(problems):
    flat, _ = hidden_inputs(prob)
    progs += [prob.reference, prob.reference]
    inputs += [flat, [a for a, _ in prob.tests]]
    owner += [(p, "ref"), (p, "tests")]
    for c, src in enumerate(sources[p]):
      if src is not None:
        progs.append(src)
        inputs.append(flat)
        owner.append((p, c))
  outs = execution.run_functions(sandbox, progs, inputs, desc="hidden tests", **run_kwargs)
  got = dict(zip(owner, outs))
  result = []
  for p, prob in enumerate(problems):
    ref = got[p, "ref"]
    check_reference(prob, ref, got[p, "tests"])
    _, slices = hidden_inputs(prob)
    row = []
    for c, src in enumerate(sources[p]):
      out = got.get((p, c))
      if src is None or out is None or not out.ok:
        row.append(frozenset())
        continue
      row.append(frozenset(s for s, sl in enumerate(slices)
                           if out.values[sl] == ref.values[sl]))
    result.append(row)
  return result


@dataclasses.dataclass
class SubtaskClusters:
  """A subtask's kept clusters (largest first) and the clustering counts."""
  clusters: list[clustering.Cluster]
  counts: dict[str, int]


def cluster_subtask(outputs: Sequence[execution.Outputs | None],
                    reasoning: Sequence[int]) -> SubtaskClusters:
  return SubtaskClusters(*clustering.cluster(outputs, reasoning))


def representatives(clusters: Sequence[clustering.Cluster], texts: Sequence[str],
                    max_clusters: int) -> list[str]:
  """The longest-reasoning member's response of each of the first ``max_clusters``."""
  return [texts[c.members[0]] for c in clusters[:max_clusters]]


def ranked_clusters(clusters: Sequence[clustering.Cluster], ranking: tournament_lib.Ranking | None,
                    max_clusters: int) -> list[list[int]]:
  """Clusters in tournament order (the first ``max_clusters``), then the rest by size."""
  head = list(clusters[:max_clusters])
  order = ranking.order if ranking is not None else tuple(range(len(head)))
  return [list(head[i].members) for i in order] + [list(c.members)
                                                   for c in clusters[max_clusters:]]


def strategy_rankings(name: str, *, candidates: Sequence[int],
                      clusters: Sequence[clustering.Cluster],
                      tournament_order: list[list[int]] | None, seed) -> list[list[int]]:
  """A subtask's ranked clusters under strategy ``name``:

  ``gencluster`` / ``no_validators``: the tournament order (``tournament_order``,
  built on the validated or the unfiltered inputs); ``majority``: the largest
  cluster only; ``random``: the parsed candidates in a seeded random order.
  """
  if name in ("gencluster", "no_validators"):
    if tournament_order is None:
      raise ValueError(f"strategy {name!r} needs tournament_order")
    return tournament_order
  if name == "majority":
    return [list(clusters[0].members)] if clusters else []
  if name == "random":
    return submission.random_ranking(list(candidates), seed)
  raise ValueError(f"unknown strategy {name!r}; known: gencluster, no_validators, majority, "
                   "random")


def solve_curves(per_problem: Sequence[Mapping[str, list[list[list[int]]]]],
                 passes: Sequence[Sequence[frozenset[int]]], *, budget: int,
                 n_subtasks: int = 3) -> dict[str, np.ndarray]:
  """``{strategy: [P, budget]}`` fraction of subtasks solved after b submissions.

  ``per_problem[p][strategy]``: the per-subtask ranked clusters of problem p.
  """
  curves: dict[str, list[np.ndarray]] = {}
  for p, strategies in enumerate(per_problem):
    table = dict(enumerate(passes[p]))
    for name, ranked in strategies.items():
      subs = submission.submit(ranked, table, budget=budget)
      curves.setdefault(name, []).append(submission.score_curve(subs, n_subtasks, budget))
  return {k: np.stack(v) for k, v in curves.items()}


def upper_bound(passes: Sequence[Sequence[frozenset[int]]], n_subtasks: int = 3) -> float:
  """Share of subtasks some candidate of its problem passes (any budget)."""
  if not passes:
    return math.nan
  return float(np.mean([len(frozenset().union(*row)) / n_subtasks if row else 0.0
                        for row in passes]))
