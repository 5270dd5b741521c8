"""Rollout throughput of one GRPO and one OPD rollout batch, split by stage.

A rollout batch is what ``GRPOSource.next_batch`` / ``OPDSource.next_batch``
build before a training update. This benchmark composes the same library
calls (``opd.rollout.batches.sample_groups`` and ``training_arrays``, the
scoring and advantages, the teacher cache and ``loss_batch``), timing each
stage apart:

* ``sample``: ``opd.rollout.rollout``'s sampler calls (prefill + decode,
  host-side decoding of the completions; multi-turn agent episodes also step
  their environment and score their reward here);
* ``verify``: the single-turn task verifiers (the code domain runs every
  distinct program in the sandbox);
* ``reference`` (GRPO, ``kl_coef > 0``): the frozen reference's log-probs;
* ``teacher`` (OPD): the teachers' hidden states through
  ``FaultTolerantTeachers`` + ``HiddenStateCache`` (one forward per teacher
  over its routed rows);
* ``assembly``: host-side scoring, advantages, padding (``batch_episodes``),
  OPD weights and ``loss_batch``, and the transfer to the mesh.

Sizes are those of ``make demo`` (``experiments/configs/v4.py``): its
specialists stage runs GRPO with P=8 prompts x G=8 samples, N=80 new tokens,
one run per domain; its OPD stage P=8 x G=4, N=80, one teacher per domain
(prompt routing; the prompts here cycle through the domains). The policies
come from a specialists workdir (``--policies``, default ``workdirs/demo``
when ``make demo`` has made it): GRPO samples with each domain's SFT
checkpoint (where the demo's GRPO starts); OPD's teachers are the GRPO
specialists and its student the base (the demo's starts from a cold start of
it, which a specialists workdir does not have). Without one
the models are randomly initialised (``policies: "random"`` in the JSON); a
random policy rarely writes a program that parses, so the sandbox then never
runs and ``verify`` is tiny. ``--quick`` uses the ``:tiny`` config variants.

The ``sampler`` rows break one ``generate`` call of each GRPO batch down
(``_sampler_breakdown``): prefill, decode steps, and the decoder's forward
alone over the same shapes, with the bounds these put on any sampler-side
speedup. They run with ``share_prefill=False`` (a prefill over every row, as
before it was shared), except ``generate_shared_s``; times are CPU seconds
of this process (``time.process_time``: the machine may be shared).

The ``prefill_ab`` rows are the sample stage's before/after in the same run:
each batch's sample stage (``rollout`` without verification) with
``SamplingConfig.share_prefill`` off (before: every row prefilled) and on
(after: each distinct prompt prefilled once), interleaved over
``--ab_reps`` repeats with the same keys; CPU seconds, prompts/s and
tokens/s per CPU second, and the ratio off/on (median and range of the
paired repeats). ``--no_share_prefill`` runs the whole benchmark with
sharing off (the baseline).

Each batch runs with the step seeds 0 .. iters-1 twice: once to compile every
shape they need (``first_call_s`` is step 0's), then timed; the stage times
are medians over the timed iterations.

Same-run baseline: ``--baseline REV`` (default ``BASELINE_COMMIT``, the
commit before the verify-stage optimisation; ``none`` skips it) runs this
very script in a child process whose ``opd`` and ``pallas_kernels`` packages
are REV's (``git archive REV opd pallas_kernels`` into a temporary directory
put first on ``sys.path``; a REV without ``opd/rollout/batches.py``, the
batch assembly this script calls, gets ``BATCHES_BEFORE_POLICY``'s), then
merges its stage times into this run's JSON as ``baseline`` with per-stage ``speedup`` = baseline seconds / these seconds.
Both runs record their commit; ``outputs_match`` says whether the two
produced identical episodes and rewards (a digest of every batch's response
ids and rewards), which is what makes the comparison one of equal work.
``sample_cpu`` (both runs) is the sample stage alone in CPU seconds, median
over the steps; ``sample_cpu_speedups`` compares it with the baseline's,
the comparison that stands on a loaded machine.

  python -m experiments.benchmarks.rollout --policies=workdirs/demo_check
  python -m experiments.benchmarks.rollout --quick          # seconds, smoke test
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import common

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The commit before the sandbox's batched runs (the optimisation this
# benchmark measures); --baseline overrides it.
BASELINE_COMMIT = "9c171e7"
# The last opd/rollout/batches.py written against episodes.rollout(model_cfg,
# params, tokenizer, ...): what a baseline without batches.py runs.
BATCHES_BEFORE_POLICY = "b63ab0e"
GRPO_STAGES = ("sample", "verify", "reference", "assembly")
OPD_STAGES = ("sample", "verify", "teacher", "assembly")


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--policies", default=None,
                 help="a specialists workdir (default workdirs/demo if present; 'random' for "
                      "random inits)")
  p.add_argument("--domains", nargs="+", default=None, help="GRPO domains (default: all)")
  p.add_argument("--iters", type=int, default=3)
  p.add_argument("--baseline", default=None,
                 help=f"git revision to compare with (default {BASELINE_COMMIT}; 'none' skips)")
  p.add_argument("--quick", action="store_true",
                 help="tiny configs, GRPO on math only, one iteration, no baseline")
  p.add_argument("--no_breakdown", action="store_true",
                 help="skip the sampler breakdown (always skipped with --quick)")
  p.add_argument("--ab_reps", type=int, default=3,
                 help="repeats of the shared-prefill before/after (0 skips; 0 with --quick)")
  p.add_argument("--no_share_prefill", action="store_true",
                 help="sample with SamplingConfig.share_prefill=False everywhere (the baseline)")
  p.add_argument("--out", default="benchmark_results")
  p.add_argument("--name", default="rollout", help="JSON file name (without .json)")
  args = p.parse_args(argv)
  if args.quick:
    args.iters = 1
    args.ab_reps = 0
    args.domains = args.domains or ["math"]
    args.baseline = args.baseline or "none"
  if args.iters < 1:
    raise ValueError(f"--iters={args.iters} must be >= 1")
  if args.ab_reps < 0:
    raise ValueError(f"--ab_reps={args.ab_reps} must be >= 0")
  return args


def _commit(cwd=ROOT) -> dict[str, Any]:
  """``{"commit": hash, "dirty": bool}`` of the checkout at ``cwd`` (None outside git)."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "opd", "pallas_kernels"],
                           cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    return {"commit": head, "dirty": bool(dirty)}
  except (OSError, subprocess.CalledProcessError):
    return {"commit": None, "dirty": None}


def _policies_dir(arg) -> pathlib.Path | None:
  if arg == "random":
    return None
  path = pathlib.Path(arg or "workdirs/demo")
  if (path / "base" / "checkpoints").is_dir():
    return path
  if arg:
    raise ValueError(f"--policies={arg}: no specialists workdir there (no base/checkpoints)")
  return None


def _params(model_cfg, directory: pathlib.Path | None, seed: int, mesh, rules):
  from opd.models import init_params
  from opd.training.checkpoints import load_params
  if directory is None:
    return init_params(model_cfg, jax.random.key(seed))
  return load_params(directory, model_cfg, mesh=mesh, rules=rules)


class _Stages:
  """Accumulates per-stage seconds of one batch; ``t(name)`` times a block."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  def add(self, name: str, s: float):
    self.seconds[name] = self.seconds.get(name, 0.0) + s

  def timed(self, name: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    self.add(name, time.perf_counter() - t0)
    return out


def _digest(episodes) -> str:
  """Hash of every episode's response ids and reward: equal work across runs."""
  h = hashlib.sha256()
  for ep in episodes:
    h.update(np.asarray(ep.response_ids, np.int32).tobytes())
    h.update(repr(None if ep.reward is None else (round(ep.reward.reward, 9),
                                                  ep.reward.reason)).encode())
  return h.hexdigest()[:16]


def _sample_groups(setup: dict, step: int, sampling, timings: dict[str, float], **kwargs):
  """``opd.rollout.batches.sample_groups`` of the setup's prompts with step
  ``step``'s key, adding ``rollout``'s seconds to ``timings``. A baseline's
  ``opd`` predates ``opd.rollout.Policy`` and ``RolloutLog``: its ``batches``
  (``BATCHES_BEFORE_POLICY``'s) takes the model, params, tokenizer, mesh,
  rules and ``timings`` loose."""
  from opd.rollout import batches
  args = (setup["examples"], setup["rollout"], jax.random.key(0), step, sampling)
  if not hasattr(batches, "Policy"):
    return batches.sample_groups(setup["model_cfg"], setup["params"], setup["tok"], *args,
                                 mesh=setup["mesh"], rules=setup["rules"], timings=timings,
                                 **kwargs)
  from opd.rollout.episodes import RolloutLog
  policy = batches.Policy(setup["model_cfg"], setup["params"], setup["tok"], setup["mesh"],
                          setup["rules"])
  return batches.sample_groups(policy, *args, log=RolloutLog(timings=timings), **kwargs)


def _sample(stages: _Stages, setup: dict, step: int, *, verify: bool):
  """``opd.rollout.batches.sample_groups`` of the setup's prompts (each
  repeated G times) with step ``step``'s key, as the sources call it;
  ``sample`` and ``verify`` seconds from ``rollout``'s timings."""
  timings: dict[str, float] = {}
  t0 = time.perf_counter()
  episodes = _sample_groups(setup, step, setup["sampling"], timings, verify=verify,
                            task_kwargs=setup.get("task_kwargs"))
  total = time.perf_counter() - t0
  stages.add("verify", timings.get("verify", 0.0))
  stages.add("sample", total - timings.get("verify", 0.0))  # sampling + episode building
  return episodes


def _training_arrays(setup: dict, episodes) -> dict:
  from opd.rollout import batches
  ro = setup["rollout"]
  return batches.training_arrays(episodes, seq_len=ro.seq_len, length_bucket=ro.length_bucket,
                                 pad_id=setup["tok"].pad_id)[0]


def _info(episodes) -> dict[str, Any]:
  return {"prompts": len(episodes),
          "policy_tokens": int(sum(ep.num_policy_tokens for ep in episodes)),
          "digest": _digest(episodes)}


def _grpo_batch(setup: dict, step: int) -> tuple[dict[str, float], dict[str, Any]]:
  """One GRPO rollout batch (``GRPOSource.next_batch`` without the prompt stream)."""
  from opd.rl.advantages import group_advantages
  from opd.rl.scoring import score_episodes
  from opd.training.train_step import shard_batch
  cfg, stages = setup["cfg"], _Stages()
  episodes = _sample(stages, setup, step, verify=True)

  def assemble():
    rewards = np.asarray([s.reward for s in score_episodes(episodes)])
    adv = group_advantages(rewards.reshape(cfg.prompts_per_step, cfg.group_size),
                           scale_by_std=cfg.scale_advantages_by_std, eps=cfg.advantage_eps)
    host = _training_arrays(setup, episodes)
    host["advantages"] = adv.reshape(-1)
    return shard_batch(host, setup["mesh"], setup["rules"])

  batch = stages.timed("assembly", assemble)
  if setup["reference"] is not None:
    stages.timed("reference", setup["reference"], setup["params"], batch)
  return stages.seconds, _info(episodes)


def _opd_batch(setup: dict, step: int) -> tuple[dict[str, float], dict[str, Any]]:
  """One OPD rollout batch (``OPDSource.next_batch`` without diagnostics)."""
  from opd.distill.cache import loss_batch
  from opd.training.train_step import shard_batch
  cfg, stages = setup["cfg"], _Stages()
  episodes = _sample(stages, setup, step, verify=cfg.verifies)
  domains = [ep.example.domain for ep in episodes]

  def pad():
    host = _training_arrays(setup, episodes)
    return host, setup["routing"](domains, setup["teacher_domains"], host["tokens"].shape[1])

  host, w = stages.timed("assembly", pad)
  routed = np.asarray(w)[:, 0, :].argmax(axis=1).astype(np.int32)  # one-hot routing
  t0 = time.perf_counter()
  cached = setup["cache"].get(("bench", step, t0), host["tokens"], host["mask"], routed)
  jax.block_until_ready(cached.hidden)
  stages.add("teacher", time.perf_counter() - t0)

  def assemble():
    opd, row_ok = loss_batch(host, cached, w)
    opd["loss_mask"] = host["loss_mask"] * row_ok[:, None]
    hidden, weights = opd.pop("teacher_hidden"), opd.pop("teacher_weights")
    batch = shard_batch({**opd, "teacher_weights": np.asarray(weights)}, setup["mesh"],
                        setup["rules"])
    batch["teacher_hidden"] = hidden
    return batch

  stages.timed("assembly", assemble)
  return stages.seconds, _info(episodes)


def _configs(quick: bool):
  """``(specialists config, v4 config)`` of ``make demo`` (``:tiny`` with ``quick``)."""
  from experiments.configs import v4 as v4_config
  c = v4_config.get_config("tiny" if quick else None)
  return c.specialists, c


def _rollout_config(cfg):
  """``cfg.rollout``. A baseline's ``opd`` (``BASELINE_COMMIT``) predates it:
  then ``cfg`` itself, which holds what ``sample_groups`` reads (``group_size``,
  ``batch_size``)."""
  return cfg.rollout if hasattr(cfg, "rollout") else cfg


def _opd_config(group):
  """``config.opd`` as the library's ``OPDConfig``. A baseline's flat one
  (before the nesting of #24) gets today's group flattened by the inverse
  of ``opd.config.migrations.MOVED``, read from this checkout (the
  baseline's ``opd`` has no migrations); fields it does not have are left
  out (they hold their old defaults, ``FILLED``)."""
  import importlib.util
  from opd.config.fields import from_group
  from opd.distill import OPDConfig
  names = {f.name for f in dataclasses.fields(OPDConfig)}
  if "loss" in names:
    return from_group(OPDConfig, group, "config.opd")
  spec = importlib.util.spec_from_file_location("_migrations",
                                                ROOT / "opd" / "config" / "migrations.py")
  migrations = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(migrations)
  back = {new: old for old, new in migrations.MOVED["opd"].items()}
  flat = {}
  for key, value in group.to_dict().items():
    for path, v in (value.items() if isinstance(value, dict) else [("", value)]):
      name = back.get(f"{key}.{path}") if path else key
      if name in names:
        flat[name] = v
  return OPDConfig(**flat)


def _routing_weights():
  """``opd.distill.teacher_weighting.routing_weights`` (``schedule`` in a
  baseline's ``opd`` before the module was renamed)."""
  try:
    from opd.distill import teacher_weighting
  except ImportError:
    from opd.distill import schedule as teacher_weighting
  return teacher_weighting.routing_weights


def _grpo_setups(spec, policies, domains, mesh, rules) -> list[tuple[str, dict]]:
  from experiments import common as job_common
  from opd.tasks import domain_examples
  from opd import rollout as rollout_lib
  from opd.config.fields import from_group
  from opd.models import to_model_config
  from opd.rl import GRPOConfig
  from opd.rl.rollout_source import make_reference_fn
  from opd.tasks import AgentRewardConfig
  model_cfg = to_model_config(spec.model)
  tok = job_common.tokenizer_for(model_cfg)
  cfg = from_group(GRPOConfig, spec.grpo, "config.grpo")
  sampling = rollout_lib.sampling_for_chat(tok, max_new_tokens=cfg.max_new_tokens,
                                           temperature=cfg.temperature, top_k=cfg.top_k,
                                           top_p=cfg.top_p)
  agent = {"agent": {"config": from_group(AgentRewardConfig, spec.agent_reward,
                                          "config.agent_reward")}}
  reference = (make_reference_fn(model_cfg, cfg.temperature, mesh=mesh, rules=rules)
               if cfg.kl_coef > 0 else None)
  out = []
  for d in domains:
    ckpt = None if policies is None else policies / d / "sft" / "checkpoints"
    examples = domain_examples((d,), "train", cfg.prompts_per_step, spec.seed,
                               tuple(spec.grpo_data.difficulties))
    out.append((f"grpo/{d}", dict(
        cfg=cfg, rollout=_rollout_config(cfg), model_cfg=model_cfg, tok=tok,
        sampling=sampling, examples=examples,
        params=_params(model_cfg, ckpt, spec.seed, mesh, rules), mesh=mesh, rules=rules,
        reference=reference, task_kwargs=agent if d == "agent" else None)))
  return out


def _opd_setup(v4, policies, mesh, rules) -> dict:
  from experiments import common as job_common
  from opd.tasks import domain_examples
  from opd import rollout as rollout_lib
  from opd.distill import Teacher, TeacherPool
  from opd.distill.cache import HiddenStateCache
  from opd.distill.faults import FaultTolerantTeachers
  from opd.models import to_model_config
  from opd.parallel import sharding
  model_cfg = to_model_config(v4.specialists.model)
  tok = job_common.tokenizer_for(model_cfg)
  cfg = _opd_config(v4.opd)
  ro = _rollout_config(cfg)
  domains = list(v4.specialists.domains)  # one teacher per specialist, as the v4 job
  teachers = [Teacher(d, model_cfg, _params(
      model_cfg, None if policies is None else policies / d / "grpo" / "checkpoints", 100 + i,
      mesh, rules), d) for i, d in enumerate(domains)]
  pool = TeacherPool(teachers, model_cfg.vocab_size, mesh, rules=rules)
  asked = FaultTolerantTeachers.from_pool(pool, deadline_s=cfg.deadline_s)
  per = -(-ro.prompts_per_step // len(domains))
  by_domain = [domain_examples((d,), "train", per, v4.seed, tuple(v4.data.difficulties))
               for d in domains]
  examples = [ex for group in zip(*by_domain) for ex in group][:ro.prompts_per_step]
  # The v4 student starts from its cold start; a specialists workdir has the base.
  ckpt = None if policies is None else policies / "base" / "checkpoints"
  sampling = rollout_lib.sampling_for_chat(tok, max_new_tokens=ro.max_new_tokens,
                                           temperature=ro.temperature)
  return dict(cfg=cfg, rollout=ro, model_cfg=model_cfg, tok=tok,
              examples=examples, mesh=mesh, rules=rules,
              params=_params(model_cfg, ckpt, v4.seed, mesh, rules), teacher_domains=domains,
              routing=_routing_weights(), sampling=sampling, cache=HiddenStateCache(asked, dtype=cfg.cache_dtype,
                                     sharding=sharding.batch_sharding(mesh, rules, 3)))


def _measure(name: str, fn, setup: dict, stage_names, iters: int) -> dict[str, Any]:
  """Compile run, then ``iters`` timed batches; the row of medians."""
  t0 = time.perf_counter()
  fn(setup, 0)
  first = time.perf_counter() - t0
  # Warm pass over the timed steps first: every shape they meet (prompt and
  # length buckets, agent turns) is compiled once, as in a long run.
  for step in range(1, iters):
    fn(setup, step)
  runs = [fn(setup, step) for step in range(iters)]
  seconds = {s: float(np.median([r[0].get(s, 0.0) for r in runs])) for s in stage_names}
  total = float(np.median([sum(r[0].values()) for r in runs]))
  prompts = runs[0][1]["prompts"]
  tokens = float(np.median([r[1]["policy_tokens"] for r in runs]))
  return {"batch": name, "stages": seconds, "total_s": total, "first_call_s": first,
          "prompts": prompts, "policy_tokens": tokens, "prompts_per_s": prompts / total,
          "tokens_per_s": tokens / total,
          "share": {s: v / total for s, v in seconds.items()},
          "digests": [r[1]["digest"] for r in runs]}


def _sampler_breakdown(name: str, setup: dict, reps: int) -> dict[str, Any]:
  """Where one GRPO batch's sampler time goes (CPU seconds, min over ``reps`` runs).

  ``generate_s``: one ``generate`` call on the batch's prompts (as
  ``rollout`` makes it) taking ``steps`` decode steps, every row prefilled
  (``share_prefill=False``); ``prefill_s``: the same call with
  ``max_new_tokens=1``; ``forward_only_s``: the decoder alone over the same
  shapes (prefill, then ``steps - 1`` one-token forwards against the cache;
  no head, no sampling, no bookkeeping). ``sampler_own_share`` =
  1 - forward_only / generate is what the sampler's own per-step work
  (head, sampling, end-of-row tests, output buffers) costs.
  ``generate_shared_s`` / ``prefill_shared_s``: the same two calls with
  each distinct prompt prefilled once; ``speedup_shared`` = generate_s /
  generate_shared_s, against its bound ``bound_prefill_once``.
  """
  from opd.models import forward, init_cache
  from opd.rollout import prompt_ids
  from opd.rollout.sampler import generate
  cfg, tok = setup["model_cfg"], setup["tok"]
  sampling = setup["sampling"].replace(share_prefill=False)
  prompts = [prompt_ids(tok, ex) for ex in setup["examples"]
             for _ in range(setup["rollout"].group_size)]
  P = 32 * -(-max(len(p) for p in prompts) // 32)  # policy.sample's default bucket
  tokens = np.full((len(prompts), P), tok.pad_id, np.int32)
  mask = np.zeros((len(prompts), P), bool)
  for i, p in enumerate(prompts):
    tokens[i, P - len(p):], mask[i, P - len(p):] = p, True
  B, N = tokens.shape[0], sampling.max_new_tokens

  @jax.jit
  def decoder_only(params, tokens, mask, new_tokens, steps):
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    out = forward(cfg, params, tokens, positions, mask, init_cache(cfg, B, P + N),
                  return_logits=False, return_hidden=True)

    def step(t, carry):
      cache, acc = carry
      o = forward(cfg, params, new_tokens[:, t][:, None], (positions[:, -1] + 1 + t)[:, None],
                  jnp.ones((B, 1), bool), cache, return_logits=False, return_hidden=True)
      return o.cache, acc + o.hidden[:, 0]

    return jax.lax.fori_loop(0, steps - 1, step, (out.cache, out.hidden[:, -1]))[1]

  params = setup["params"]
  out = generate(cfg, params, tokens, mask, 0, sampling)
  steps = int(out.steps)
  shared, one = sampling.replace(share_prefill=True), dict(max_new_tokens=1)
  fns = (lambda: generate(cfg, params, tokens, mask, 0, sampling).tokens,
         lambda: generate(cfg, params, tokens, mask, 0, sampling.replace(**one)).tokens,
         lambda: decoder_only(params, tokens, mask, out.tokens, steps),
         lambda: generate(cfg, params, tokens, mask, 0, shared).tokens,
         lambda: generate(cfg, params, tokens, mask, 0, shared.replace(**one)).tokens)
  times = [[] for _ in fns]
  for rep in range(reps + 1):  # interleaved, so that load on a shared machine hits all of them
    for fn, got in zip(fns, times):
      t0 = time.process_time()
      jax.block_until_ready(fn())
      if rep:  # the first round compiles
        got.append(time.process_time() - t0)
  full, prefill, alone, full_shared, prefill_shared = (min(t) for t in times)
  G = setup["rollout"].group_size
  return {"batch": name, "rows": B, "prompt_len": P, "steps": steps, "generate_s": full,
          "prefill_s": prefill, "prefill_share": prefill / full,
          "decode_ms_per_step": 1e3 * (full - prefill) / max(steps - 1, 1),
          "forward_only_s": alone, "sampler_own_share": 1 - alone / full,
          # Upper bounds on a sampler-side speedup: its own per-step work free,
          # or each prompt's prefill run once for its G samples.
          "bound_free_sampler": full / alone,
          "bound_prefill_once": 1 / (1 - prefill / full * (1 - 1 / G)),
          "generate_shared_s": full_shared, "prefill_shared_s": prefill_shared,
          "speedup_shared": full / full_shared}


def _sample_stage(setup: dict, share: bool | None, step: int) -> dict[str, Any]:
  """One batch's sample stage alone (``rollout`` without verification):
  wall and CPU seconds, prompts, policy tokens and the episodes' digest.
  ``share``: ``share_prefill`` (None: the setup's sampling as it is, for a
  baseline whose ``SamplingConfig`` may predate the field)."""
  sampling = setup["sampling"]
  if share is not None:
    sampling = sampling.replace(share_prefill=share)
  wall, cpu = time.perf_counter(), time.process_time()
  episodes = _sample_groups(setup, step, sampling, {}, verify=False,
                            task_kwargs=setup.get("task_kwargs"))
  return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
          "prompts": len(episodes), "policy_tokens": sum(ep.num_policy_tokens for ep in episodes),
          "digest": _digest(episodes)}


def _prefill_ab(name: str, setup: dict, reps: int) -> dict[str, Any]:
  """The sample stage with ``share_prefill`` off (before) and on (after).

  Both are compiled first; then ``reps`` rounds, each running both with the
  step-``r`` key, in alternating order. Medians of CPU seconds; ``ratio`` is
  the median of the paired ``off / on`` CPU ratios (``ratio_min``,
  ``ratio_max`` their range); ``outputs_match``: equal episodes every round.
  """
  if reps < 1:
    raise ValueError(f"_prefill_ab needs reps >= 1, got {reps}")
  for share in (False, True):
    _sample_stage(setup, share, 0)
  runs = {False: [], True: []}
  for r in range(reps):
    for share in ((False, True) if r % 2 == 0 else (True, False)):
      runs[share].append(_sample_stage(setup, share, r))
  off, on = runs[False], runs[True]
  med = lambda rs, k: float(np.median([x[k] for x in rs]))
  ratios = [a["cpu_s"] / b["cpu_s"] for a, b in zip(off, on)]
  prompts, tokens = off[0]["prompts"], med(off, "policy_tokens")
  row = {"batch": name, "prompts": prompts, "policy_tokens": tokens, "reps": reps,
         "off_cpu_s": med(off, "cpu_s"), "on_cpu_s": med(on, "cpu_s"),
         "off_wall_s": med(off, "wall_s"), "on_wall_s": med(on, "wall_s")}
  for k in ("off", "on"):
    row[f"{k}_prompts_per_cpu_s"] = prompts / row[f"{k}_cpu_s"]
    row[f"{k}_tokens_per_cpu_s"] = tokens / row[f"{k}_cpu_s"]
  row.update(ratio=float(np.median(ratios)), ratio_min=min(ratios), ratio_max=max(ratios),
             ratio_wall=row["off_wall_s"] / row["on_wall_s"],
             outputs_match=[a["digest"] for a in off] == [b["digest"] for b in on],
             cpu_s={"off": [x["cpu_s"] for x in off], "on": [x["cpu_s"] for x in on]})
  return row


def _sample_cpu(name: str, setup: dict, iters: int) -> dict[str, Any]:
  """The sample stage alone in CPU seconds, as configured (baseline runs
  too): a compile run, then the median over steps 0 .. iters-1."""
  _sample_stage(setup, None, 0)
  runs = [_sample_stage(setup, None, step) for step in range(iters)]
  return {"batch": name, "cpu_s": float(np.median([r["cpu_s"] for r in runs])),
          "wall_s": float(np.median([r["wall_s"] for r in runs])),
          "digests": [r["digest"] for r in runs]}


def _ab_total(rows) -> dict[str, Any]:
  """Sum over batches, repeat by repeat: ``off / on`` CPU seconds (median, range)."""
  reps = min(r["reps"] for r in rows)
  ratios = [sum(r["cpu_s"]["off"][i] for r in rows) / sum(r["cpu_s"]["on"][i] for r in rows)
            for i in range(reps)]
  return {"batches": [r["batch"] for r in rows], "off_cpu_s": sum(r["off_cpu_s"] for r in rows),
          "on_cpu_s": sum(r["on_cpu_s"] for r in rows), "ratio": float(np.median(ratios)),
          "ratio_min": min(ratios), "ratio_max": max(ratios),
          "outputs_match": all(r["outputs_match"] for r in rows)}


def _aggregate(rows, stage_names) -> dict[str, Any]:
  seconds = {s: sum(r["stages"].get(s, 0.0) for r in rows) for s in stage_names}
  total = sum(r["total_s"] for r in rows)
  return {"stages": seconds, "total_s": total,
          "share": {s: v / total for s, v in seconds.items()},
          "largest_stage": max(seconds, key=seconds.get)}


def measure(args, breakdown: bool = True) -> dict[str, Any]:
  """This checkout's figures (no baseline); ``breakdown``: add ``sampler``;
  ``--ab_reps`` > 0: add ``prefill_ab``."""
  from opd.tasks import ALL_DOMAINS
  from opd.parallel import sharding
  spec, v4 = _configs(args.quick)
  policies = _policies_dir(args.policies)
  rules = sharding.validate_rules(tuple(spec.sharding_rules))
  # Data parallel over as many devices as divide both batches (all of them
  # at the default sizes; the tiny OPD batch has 4 rows).
  batches = (spec.grpo.prompts_per_step * spec.grpo.group_size,
             v4.opd.rollout.prompts_per_step * v4.opd.rollout.group_size)
  n = math.gcd(jax.device_count(), *batches)
  mesh = sharding.make_mesh((n, 1, 1), jax.devices()[:n])
  domains = args.domains or list(ALL_DOMAINS)
  setups = _grpo_setups(spec, policies, domains, mesh, rules)
  opd_setup = _opd_setup(v4, policies, mesh, rules)
  if args.no_share_prefill:
    for setup in [s for _, s in setups] + [opd_setup]:
      setup["sampling"] = setup["sampling"].replace(share_prefill=False)
  grpo = [_measure(name, _grpo_batch, setup, GRPO_STAGES, args.iters) for name, setup in setups]
  sampler = ([_sampler_breakdown(name, setup, max(7, args.iters)) for name, setup in setups]
             if breakdown else [])
  opd = _measure("opd", _opd_batch, opd_setup, OPD_STAGES, args.iters)
  sample_cpu = [_sample_cpu(name, setup, args.iters)
                for name, setup in setups + [("opd", opd_setup)]]
  ab = ([_prefill_ab(name, setup, args.ab_reps) for name, setup in setups + [("opd", opd_setup)]]
        if args.ab_reps else [])
  g, o = spec.grpo, opd_setup["rollout"]
  return {
      **_commit(),
      "policies": str(policies) if policies else "random", "mesh": dict(mesh.shape),
      "sizes": {"quick": args.quick, "iters": args.iters, "grpo_domains": domains,
                "grpo": {"prompts_per_step": g.prompts_per_step, "group_size": g.group_size,
                         "max_new_tokens": g.max_new_tokens, "seq_len": g.seq_len},
                "opd": {"prompts_per_step": o.prompts_per_step, "group_size": o.group_size,
                        "max_new_tokens": o.max_new_tokens, "seq_len": o.seq_len,
                        "teachers": list(opd_setup["teacher_domains"])},
                "model": spec.model.to_dict()},
      "rows": grpo + [opd],
      "grpo_total": _aggregate(grpo, GRPO_STAGES),
      "sampler": sampler,
      "sample_cpu": sample_cpu,
      "share_prefill": not args.no_share_prefill,
      "prefill_ab": ab,
      "prefill_ab_grpo_total": _ab_total(ab[:-1]) if ab else None,
  }


def run_baseline(rev: str, args) -> dict[str, Any]:
  """This script's figures with the ``opd`` / ``pallas_kernels`` packages of ``rev``."""
  with tempfile.TemporaryDirectory(prefix="rollout-baseline-") as tmp:
    archive = subprocess.run(["git", "archive", rev, "opd", "pallas_kernels"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    batches = pathlib.Path(tmp, "opd", "rollout", "batches.py")
    if not batches.exists():
      # This script assembles batches with the library's opd.rollout.batches
      # (as the sources do); a rev that predates it gets the last one that
      # still called the rollout of its time (before opd.rollout.Policy).
      batches.write_bytes(subprocess.run(
          ["git", "show", f"{BATCHES_BEFORE_POLICY}:opd/rollout/batches.py"], cwd=ROOT,
          capture_output=True, check=True).stdout)
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    policies = _policies_dir(args.policies)
    # The baseline's opd may predate SamplingConfig.share_prefill: no A/B there.
    argv = ["--baseline", "none", "--ab_reps", "0", "--iters", str(args.iters), "--out", tmp,
            "--name", "child", "--policies", str(policies.resolve()) if policies else "random"]
    if args.domains:
      argv += ["--domains", *args.domains]
    if args.quick:
      argv.append("--quick")
    code = ("import sys; sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]; "
            "from experiments.benchmarks import rollout; rollout.child_main(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, tmp, str(ROOT), *argv], cwd=tmp,
                          capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode:
      raise RuntimeError(f"baseline at {rev} failed:\n{proc.stderr[-4000:]}")
    result = json.loads((pathlib.Path(tmp) / "child.json").read_text())
  result.update(commit=commit, dirty=False)
  return result


def merge(current: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
  """Per-batch, per-stage ``speedup`` = baseline seconds / current seconds."""
  base_rows = {r["batch"]: r for r in baseline["rows"]}
  speedups = []
  for r in current["rows"]:
    b = base_rows.get(r["batch"])
    if b is None:
      continue
    row = {"batch": r["batch"], "total": b["total_s"] / r["total_s"],
           "outputs_match": b["digests"] == r["digests"]}
    for s, v in r["stages"].items():
      if v > 0 and b["stages"].get(s, 0) > 0:
        row[s] = b["stages"][s] / v
    speedups.append(row)
  agg_b, agg_c = baseline["grpo_total"], current["grpo_total"]
  stage = agg_b["largest_stage"]
  # The sample stage alone in CPU seconds (robust to a shared machine's load).
  cpu_b = {r["batch"]: r for r in baseline.get("sample_cpu", [])}
  cpu = [{"batch": r["batch"], "baseline_cpu_s": cpu_b[r["batch"]]["cpu_s"],
          "current_cpu_s": r["cpu_s"], "speedup": cpu_b[r["batch"]]["cpu_s"] / r["cpu_s"],
          "outputs_match": cpu_b[r["batch"]]["digests"] == r["digests"]}
         for r in current.get("sample_cpu", []) if r["batch"] in cpu_b]
  grpo_cpu = [r for r in cpu if r["batch"].startswith("grpo/")]
  cpu_total = None
  if grpo_cpu:
    b, c = (sum(r[k] for r in grpo_cpu) for k in ("baseline_cpu_s", "current_cpu_s"))
    cpu_total = {"baseline_cpu_s": b, "current_cpu_s": c, "speedup": b / c,
                 "outputs_match": all(r["outputs_match"] for r in grpo_cpu)}
  return {"baseline": {k: baseline.get(k) for k in ("commit", "dirty", "rows", "grpo_total",
                                                    "sample_cpu")},
          "sample_cpu_speedups": cpu, "sample_cpu_grpo_total": cpu_total,
          "speedups": speedups,
          "outputs_match": all(s["outputs_match"] for s in speedups) and bool(speedups),
          "largest_stage": {"stage": stage, "baseline_s": agg_b["stages"][stage],
                            "current_s": agg_c["stages"][stage],
                            "speedup": agg_b["stages"][stage] / agg_c["stages"][stage]}}


def _table(rows) -> str:
  flat = []
  for r in rows:
    row = {"batch": r["batch"], "total_s": r["total_s"], "prompts_per_s": r["prompts_per_s"],
           "tokens_per_s": r["tokens_per_s"]}
    for s, v in r["stages"].items():
      row[f"{s}_s"] = v
      row[f"{s}_%"] = 100 * r["share"][s]
    flat.append(row)
  columns = ["batch", "total_s", "prompts_per_s", "tokens_per_s"]
  for s in dict.fromkeys(GRPO_STAGES + OPD_STAGES):
    columns += [f"{s}_s", f"{s}_%"]
  return common.format_table(flat, columns)


def child_main(argv) -> None:
  """Entry point of the baseline child: measure and write JSON only."""
  args = _parse(argv)
  common.write_result(args.name, measure(args, breakdown=False), args.out)


def main(argv=None) -> dict:
  args = _parse(argv)
  payload = measure(args, breakdown=not (args.quick or args.no_breakdown))
  rev = BASELINE_COMMIT if args.baseline is None else args.baseline
  if rev != "none":
    payload.update(merge(payload, run_baseline(rev, args)))
  print(f"rollout batches ({payload['policies']} policies, commit {payload['commit']}"
        f"{' + uncommitted changes' if payload['dirty'] else ''}), "
        f"{jax.devices()[0].device_kind}; stage medians over {args.iters} batches")
  print(_table(payload["rows"]))
  if payload["sampler"]:
    print("\nsampler breakdown (min over runs; forward_only: the decoder alone, same shapes):")
    print(common.format_table(payload["sampler"]))
  if payload["prefill_ab"]:
    print(f"\nsample stage, every row prefilled (off) vs each distinct prompt once (on); "
          f"CPU seconds, medians over {args.ab_reps} paired repeats:")
    print(common.format_table(payload["prefill_ab"], [
        "batch", "prompts", "policy_tokens", "off_cpu_s", "on_cpu_s", "off_prompts_per_cpu_s",
        "on_prompts_per_cpu_s", "off_tokens_per_cpu_s", "on_tokens_per_cpu_s", "ratio",
        "ratio_min", "ratio_max", "ratio_wall", "outputs_match"]))
    t = payload["prefill_ab_grpo_total"]
    print(f"sample stage, GRPO all domains: {t['off_cpu_s']:.3g} -> {t['on_cpu_s']:.3g} CPU s, "
          f"{t['ratio']:.2f}x (range {t['ratio_min']:.2f}-{t['ratio_max']:.2f}); identical "
          f"episodes: {t['outputs_match']}")
  agg = payload["grpo_total"]
  print(f"GRPO, all domains: {agg['total_s']:.3g} s; largest stage {agg['largest_stage']} "
        f"({100 * agg['share'][agg['largest_stage']]:.0f}%)")
  if "baseline" in payload:
    print(f"\nbaseline at {payload['baseline']['commit']}:")
    print(_table(payload["baseline"]["rows"]))
    print("\nspeedup (baseline / current):")
    print(common.format_table(payload["speedups"],
                              ["batch", "total", *dict.fromkeys(GRPO_STAGES + OPD_STAGES),
                               "outputs_match"]))
    ls = payload["largest_stage"]
    print(f"largest stage ({ls['stage']}, GRPO all domains): {ls['baseline_s']:.3g} s -> "
          f"{ls['current_s']:.3g} s, {ls['speedup']:.2f}x; identical episodes and rewards: "
          f"{payload['outputs_match']}")
    if payload["sample_cpu_grpo_total"]:
      print("\nsample stage alone, CPU seconds (median over the steps), baseline vs current:")
      print(common.format_table(payload["sample_cpu_speedups"]))
      t = payload["sample_cpu_grpo_total"]
      print(f"sample stage, GRPO all domains: {t['baseline_cpu_s']:.3g} -> "
            f"{t['current_cpu_s']:.3g} CPU s, {t['speedup']:.2f}x; identical episodes: "
            f"{t['outputs_match']}")
  path = common.write_result(args.name, payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
