"""Test inputs: generators, validators and the 75% rule (docs/DESIGN.md §7, GENCLUSTER).

Per subtask, ``n_generators`` generator slots and ``n_validators`` validator
slots. The policy writes each one as a function (``problems.generator_prompt``
/ ``validator_prompt``):

* a model generator ``f(i)`` is called for ``i = 0 .. per_generator - 1`` in
  the sandbox; it is used when it parses, its run completes and it returns at
  least two distinct plain values; otherwise the slot falls back to the
  seeded random generator of the problem's signature
  (``problems.fallback_inputs``);
* a model validator ``f(<args>)`` accepts an input iff it returns exactly
  ``True``. It is used when it parses, runs, and returns only booleans on a
  probe of fallback inputs (which meet the constraints) accepting at least
  half of them; otherwise the slot takes the rule-based validator of the
  subtask's constraints (``problems.rule_accepts``).

An input is kept iff at least ``KEEP_SHARE`` (75%) of the validators accept
it (``keep_mask``). Counts of model vs fallback generators and validators
and of removed inputs are returned for the report.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from grm.gencluster import execution
from grm.gencluster.problems import Problem, Subtask, as_args, fallback_inputs, rule_accepts
from opd.text import parsers

KEEP_SHARE = 0.75


def keep_mask(accepts: np.ndarray, share: float = KEEP_SHARE) -> np.ndarray:
  """``[N]`` bool: input n kept iff ``accepts[:, n]`` ([V, N] bool, validator x input)
  holds for at least ``share`` of the V validators (``ceil(share * V)``)."""
  accepts = np.asarray(accepts)
  if accepts.ndim != 2 or accepts.dtype != bool:
    raise ValueError(f"accepts must be a [V, N] bool array, got {accepts.shape=} {accepts.dtype=}")
  if accepts.shape[0] < 1:
    raise ValueError(f"accepts has {accepts.shape[0]} validators; need >= 1")
  if not 0.0 < share <= 1.0:
    raise ValueError(f"share={share!r} must be in (0, 1]")
  need = math.ceil(share * accepts.shape[0] - 1e-9)
  return accepts.sum(0) >= need


@dataclasses.dataclass
class SubtaskInputs:
  """``inputs``: all generated inputs (deduplicated); ``removed``: how many of them the
  75% rule removed; ``kept``: the first ``max_inputs`` of those it keeps;
  ``sources``: "model"/"fallback" per generator and validator slot."""
  inputs: list[tuple]
  kept: list[tuple]
  removed: int
  generator_sources: list[str]
  validator_sources: list[str]

  def counts(self) -> dict[str, int]:
    return {"inputs": len(self.inputs), "kept": len(self.kept), "removed": self.removed,
            "generators_model": self.generator_sources.count("model"),
            "generators_fallback": self.generator_sources.count("fallback"),
            "validators_model": self.validator_sources.count("model"),
            "validators_fallback": self.validator_sources.count("fallback")}


def _source(text: str, n_args: int) -> str | None:
  code = parsers.extract_python_function(text, "f", n_args)
  return code.source if code.ok else None


def _is_plain(v, depth: int = 0) -> bool:
  if depth > 20:
    return False
  if type(v) in (int, bool, str, float) or v is None:
    return True
  return type(v) is list and all(_is_plain(x, depth + 1) for x in v)


def generator_values(outputs: execution.Outputs) -> list | None:
  """The plain values a generator run returned, or None when the generator failed
  (run failed, or fewer than two distinct values)."""
  if not outputs.ok:
    return None
  values = [execution.value_of(o) for o in outputs.values if o.startswith("ok:")]
  values = [v for v in values if _is_plain(v)]
  return values if len({repr(v) for v in values}) >= 2 else None


def validator_accepts(outputs: execution.Outputs) -> list[bool] | None:
  """Per input: the validator returned exactly True; None when the run failed."""
  if not outputs.ok:
    return None
  return [o == "ok:True" for o in outputs.values]


def _validator_usable(outputs: execution.Outputs) -> bool:
  """On the probe (all valid inputs): only booleans, at least half accepted."""
  if not outputs.ok or not outputs.values:
    return False
  if not all(o in ("ok:True", "ok:False") for o in outputs.values):
    return False
  return 2 * sum(o == "ok:True" for o in outputs.values) >= len(outputs.values)


def build_inputs(sandbox, problem: Problem, subtask: Subtask, generator_texts: Sequence[str],
                 validator_texts: Sequence[str], *, per_generator: int, n_probe: int, seed,
                 max_inputs: int, run_kwargs: dict | None = None) -> SubtaskInputs:
  """The subtask's test inputs (module docstring).

  Args:
    sandbox: runs the model's generators and validators.
    problem, subtask: what the inputs are for.
    generator_texts: one policy response per generator slot.
    validator_texts: one policy response per validator slot.
    per_generator: calls of each generator (and size of a fallback's draw).
    n_probe: fallback inputs each model validator is probed on.
    seed: seeds the fallback generators and the probe.
    max_inputs: at most this many kept inputs (first ones, in generator order).
    run_kwargs: passed to ``execution.run_functions`` (workers, chunk, stats).
  """
  run_kwargs = dict(run_kwargs or {})
  gen_src = [_source(t, 1) for t in generator_texts]
  val_src = [_source(t, problem.n_args) for t in validator_texts]
  probe = fallback_inputs(subtask, n_probe, (seed, "probe"))
  todo_g = [i for i, s in enumerate(gen_src) if s is not None]
  todo_v = [i for i, s in enumerate(val_src) if s is not None]
  outs = execution.run_functions(
      sandbox, [gen_src[i] for i in todo_g] + [val_src[i] for i in todo_v],
      [[(k,) for k in range(per_generator)]] * len(todo_g) + [probe] * len(todo_v),
      desc="generators+validators", **run_kwargs)
  g_out = dict(zip(todo_g, outs[:len(todo_g)]))
  v_out = dict(zip(todo_v, outs[len(todo_g):]))

  inputs, gen_sources = [], []
  for slot in range(len(generator_texts)):
    values = generator_values(g_out[slot]) if slot in g_out else None
    if values is None:
      gen_sources.append("fallback")
      inputs += fallback_inputs(subtask, per_generator, (seed, "generator", slot))
    else:
      gen_sources.append("model")
      inputs += [as_args(v, problem.n_args) for v in values]
  seen, unique = set(), []
  for args in inputs:
    if repr(args) not in seen:
      seen.add(repr(args))
      unique.append(args)

  usable = [slot for slot in todo_v if _validator_usable(v_out[slot])]
  val_sources = ["model" if slot in usable else "fallback" for slot in range(len(validator_texts))]
  rows = {}
  if usable and unique:
    runs = execution.run_functions(sandbox, [val_src[s] for s in usable], [unique] * len(usable),
                                   desc="validators", **run_kwargs)
    rows = {s: validator_accepts(o) for s, o in zip(usable, runs)}
  rule = [rule_accepts(subtask, a) for a in unique]
  accepts = np.array([rows.get(s) or ([False] * len(unique)) if s in rows else rule
                      for s in range(len(validator_texts))], bool).reshape(len(validator_texts),
                                                                          len(unique))
  keep = keep_mask(accepts) if len(validator_texts) else np.ones(len(unique), bool)
  kept = [a for a, k in zip(unique, keep) if k][:max_inputs]
  return SubtaskInputs(unique, kept, int(np.sum(~keep)), gen_sources, val_sources)
