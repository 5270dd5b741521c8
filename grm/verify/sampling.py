"""A model as the batched ``prompts -> texts`` callable the §7 pipelines take (docs/DESIGN.md §7).

``sampler_fn`` renders each prompt as one user turn with the assistant turn
opened (``grm.format.user_prompt_ids``), samples through
``opd.rollout.policy.sample`` in chunks of ``batch_size`` rows (so every
call reuses one compiled sampler), and decodes. Each chunk of each call draws
its own key, ``fold_in(key(seed), running chunk count)``: calling twice with
the same prompts gives fresh samples, and a run is reproducible from
``seed``. A sample cut at the token budget gets the line ``TRUNCATED``
appended, so no parser of ``grm.verify.format`` reads it as complete (a cut
``Score: 0.5`` must not read as ``Score: 0``). ``constrained=True`` decodes
under ``grm.verify.format.SCORE_PATTERN`` (the last line a valid
``Score: s``; ``opd.rollout.constraint``); ``constrained=<pattern>`` under
that regular expression, e.g. a role's whole grammar (``ANALYSIS_PATTERN``,
``META_PATTERN``), under which every finished sample parses valid.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import jax

from grm.format import user_prompt_ids
from grm.verify.format import SCORE_PATTERN
from opd.models import ModelConfig
from opd.rollout.constraint import compile_patterns
from opd.rollout.policy import Policy, sample
from opd.rollout.sampler import SamplingConfig

TRUNCATED = "[truncated]"


def sampler_fn(model_cfg: ModelConfig, params, tokenizer, sampling: SamplingConfig, *,
               seed: int = 0, batch_size: int | None = None, prompt_bucket: int = 32, mesh=None,
               rules=None, constrained: bool | str = False
               ) -> Callable[[Sequence[str]], list[str]]:
  """A callable ``fn(prompts) -> texts`` sampling one completion per prompt.

  Args:
    model_cfg, params, tokenizer: the model (generator, verifier or meta-verifier).
    sampling: e.g. ``opd.rollout.episodes.sampling_for_chat(tok, max_new_tokens=...)``.
    seed: base seed of every call's keys.
    batch_size: rows per sampler call (None: each call's prompt count).
    prompt_bucket, mesh, rules: passed to ``opd.rollout.policy.sample``.
    constrained: False; True (``SCORE_PATTERN``); or the regular expression a
      sample's whole text follows (module docstring).
  """
  if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                 or batch_size < 1):
    raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 or None")
  base = jax.random.key(int(seed))
  if not isinstance(constrained, (bool, str)) or constrained == "":
    raise ValueError(f"constrained={constrained!r} must be a bool or a non-empty pattern")
  pattern = SCORE_PATTERN if constrained is True else constrained
  automaton = compile_patterns([pattern], tokenizer, end_ids=sampling.end_ids,
                               vocab_size=model_cfg.vocab_size) if pattern else None
  chunks = itertools.count()
  policy = Policy(model_cfg, params, tokenizer, mesh, rules)

  def fn(prompts: Sequence[str]) -> list[str]:
    if isinstance(prompts, str):
      raise ValueError("prompts must be a sequence of str, got one str")
    ids = [user_prompt_ids(tokenizer, p) for p in prompts]
    rows = batch_size or max(len(ids), 1)
    out = []
    for start in range(0, len(ids), rows):
      key = jax.random.fold_in(base, next(chunks))
      for c in sample(policy, ids[start:start + rows], key, sampling, batch_size=rows,
                      prompt_bucket=prompt_bucket, constraint=automaton):
        out.append(c.text if c.finished else f"{c.text}\n{TRUNCATED}")
    return out

  return fn
