"""Shared pieces of the ``grm`` job's stages (``experiments/grm.py``,
``experiments/grm_benchmark.py``; docs/DESIGN.md §6): the run context, the
stage directories' models and groups, and the batched GRM sampler."""
from __future__ import annotations


import jax

from experiments import common
from grm import training as training_lib
from grm.data import PreferenceGroup
from opd.models import init_params, to_model_config
from grm.judge import Chunking
from opd.rollout.episodes import sampling_for_chat
from opd.rollout.policy import Policy
from opd.training.checkpoints import load_params
from opd.training.files import read_json

GRM_STAGES = ("cold_start", "rft", "rule_rl")
GRM_BASE = "grm_base"  # the stage pre-training a GRM of its own width (config.grm_width)


def source_cfg(ctx: common.JobContext):
  """The source models' architecture (``config.model``; the GRM's is ``ctx.model_cfg``)."""
  return to_model_config(ctx.config.model)


def source_models(ctx: common.JobContext) -> dict:
  c = ctx.config
  cfg = source_cfg(ctx)
  if c.tiny_models:
    return {f"tiny{i}": init_params(cfg, jax.random.key(c.seed + i))
            for i in range(c.tiny_models)}
  return {name: load_params(path, cfg, mesh=ctx.mesh, rules=ctx.rules)
          for name, path in c.models.items()}


def control_without_sources(config) -> bool:
  """The positive-control set (``data.source`` "control") without random tiny models:
  no source model to start from, so the GRM pre-trains its own base."""
  return config.data.get("source", "models") == "control" and not config.tiny_models


def base_params(ctx: common.JobContext):
  """What the GRM, BT RM and pairwise judge start from: their own pre-trained base
  (stage ``grm_base``) when ``config.grm_width`` changes the architecture or the
  data is the positive-control set, else ``models.base`` (the tiny variant: its
  first random model)."""
  if control_without_sources(ctx.config) or ctx.model_cfg != source_cfg(ctx):
    return load_params(ctx.root / GRM_BASE / "checkpoints", ctx.model_cfg, mesh=ctx.mesh,
                       rules=ctx.rules)
  if ctx.config.tiny_models:
    return init_params(ctx.model_cfg, jax.random.key(ctx.config.seed))
  return load_params(ctx.config.models.base, ctx.model_cfg, mesh=ctx.mesh, rules=ctx.rules)


def load_groups(ctx: common.JobContext) -> dict[str, list[PreferenceGroup]]:
  """The data stage's ``{"train": [...], "test": [...]}`` preference groups."""
  raw = read_json(ctx.root / "data" / "groups.json")
  return {s: [PreferenceGroup(**{**g, "responses": tuple(g["responses"]),
                                 "ratings": tuple(g["ratings"]), "reasons": tuple(g["reasons"])})
              for g in gs] for s, gs in raw.items()}


def load_test_subsets(ctx: common.JobContext) -> dict[str, list[PreferenceGroup]]:
  """The test groups by benchmark subset (the data stage's ``subsets.json``)."""
  ids = read_json(ctx.root / "data" / "subsets.json")
  by_id = {g.example_id: g for g in load_groups(ctx).get("test", [])}
  return {s: [by_id[i] for i in v] for s, v in ids.items()}


def stage_params(ctx: common.JobContext, stage: str, cfg=None):
  """The final parameters of ``stage`` (``cfg``: its model config, default ``ctx.model_cfg``)."""
  return load_params(ctx.root / stage / "checkpoints", cfg or ctx.model_cfg, mesh=ctx.mesh,
                     rules=ctx.rules)


def grm_sampler(ctx, params, max_new_tokens, temperature, cfg=None, progress=None,
                constrained=False):
  """Batched GRM sampling with the benchmark's chunking (``progress``: a bar label;
  ``constrained``: the scores line decoded under its grammar, ``grm.judge``)."""
  sampling = sampling_for_chat(ctx.tok, max_new_tokens=max_new_tokens, temperature=temperature)
  return training_lib.model_sampler(
      Policy(cfg or ctx.model_cfg, params, ctx.tok, ctx.mesh, ctx.rules), sampling,
      chunking=benchmark_chunking(ctx.config), progress=progress, constrained=constrained)


def benchmark_chunking(config) -> Chunking:
  """The benchmark's sampler chunking (``config.benchmark.batch_size`` and ``length_bucket``)."""
  return Chunking(batch_size=config.benchmark.batch_size,
                  length_bucket=config.benchmark.length_bucket)


SHARED = "shared"


def shared_cfg(ctx: common.JobContext):
  """The shared backbone's model config: the GRM's with a value head."""
  return ctx.model_cfg.replace(scalar_head=True)
