"""Config → objects wiring shared by the jobs (pretrain, sft, grpo, specialists).

Jobs stay thin: they read their config groups (``ModelConfig`` through
``opd.models.to_model_config``, every other dataclass through
``opd.config.fields.from_group``), call these helpers to get the mesh,
optimizer, tokenizer and writers, and hand everything to library code
in ``opd``. Nothing here holds training logic.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
import uuid
from typing import Any, Mapping, Sequence

import jax
import ml_collections
import numpy as np

from opd.config.fields import from_group
from opd.config.migrations import migrate
from opd.config.overrides import config_mismatches, config_to_dict
from opd.parallel import sharding
from opd.training.files import atomic_write_json, read_json
from opd.training.metrics_writer import MetricWriter, read_metrics
from opd.models import ModelConfig
from opd.models.config import with_added_fields
from opd.tasks.tokenizer import task_tokenizer
from opd.text.bpe import BPETokenizer
from opd.text.tokenizers import ByteTokenizer, check_vocab
from opd.training.train_step import OptimConfig

log = logging.getLogger(__name__)


def optim_config(group, where: str = "config.optim", **overrides) -> OptimConfig:
  """``OptimConfig`` from a config group (``opd.config.fields.from_group``)."""
  return from_group(OptimConfig, group, where, **overrides)


def mesh_and_rules(config) -> tuple[Any, tuple]:
  """The ``(data, fsdp, tensor)`` mesh of ``config.mesh`` and the rule table."""
  rules = tuple(config.get("sharding_rules", None) or sharding.DEFAULT_RULES)
  return sharding.make_mesh(tuple(config.mesh)), sharding.validate_rules(rules)


_TOKENIZERS_BUILT: dict[str, pathlib.Path] = {}  # spec -> where this process built/checked it


def tokenizer_for(model_cfg: ModelConfig, workdir: str | pathlib.Path | None = None
                  ) -> ByteTokenizer | BPETokenizer:
  """The tokenizer ``model_cfg.tokenizer`` names, checked against the model.

  ``"byte"`` needs no files. ``"bpe:<V>"`` lives in
  ``<workdir>/tokenizer/bpe_<V>/`` (``opd.tasks.tokenizer.task_tokenizer``):
  built there once, reused after, and a stage of a pipeline gets a byte-identical
  copy of the one this process already built (BPE training is deterministic, so
  the copy is what a build there would write; its recorded sha256 is checked on
  load). Every stage directory thus holds the exact tokenizer it ran with.
  """
  spec = model_cfg.tokenizer
  if spec == "byte":
    tok = ByteTokenizer()
  else:
    if workdir is None:
      raise ValueError(f"config.model.tokenizer={spec!r} needs a workdir to keep the "
                       "tokenizer in (tokenizer_for(model_cfg, workdir))")
    directory = pathlib.Path(workdir) / "tokenizer" / spec.replace(":", "_")
    built = _TOKENIZERS_BUILT.get(spec)
    if built is not None and built != directory and not directory.exists():
      tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
      shutil.rmtree(tmp, ignore_errors=True)
      shutil.copytree(built, tmp)
      os.replace(tmp, directory)  # both files appear at once
    tok = task_tokenizer(spec, directory, field="config.model.tokenizer")
    _TOKENIZERS_BUILT.setdefault(spec, directory)
  check_vocab(tok, model_cfg)
  return tok


LORA_FIELDS = ("rank", "alpha", "targets", "base_dtype")  # experiments.configs.common.lora_group


def steps_logged(run_dir: str | pathlib.Path) -> int:
  """Training steps a run has logged (distinct steps > 0 of its
  ``metrics.jsonl``). The loop cuts the log back to the checkpoint on a
  resume, so this counts a resumed run's steps as an uninterrupted run's,
  where a launch's own history holds only the steps it ran."""
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  if not path.exists():
    return 0
  return len({int(r["step"]) for r in read_metrics(path) if int(r.get("step", 0)) > 0})


def sft_mode(model_cfg: ModelConfig, mode: str = "pack") -> str:
  """``mode`` for SFT batches of ``model_cfg``: a DeepSeek-V4 model's compressed
  attention needs each row's positions consecutive, so its rows are padded,
  never packed (docs/DESIGN.md §2, "DeepSeek-V4")."""
  return "pad" if model_cfg.v4 is not None else mode


def lora_student(params, group, field: str, base_checkpoint=None):
  """``params``, or a ``LoRAStudent`` over them when ``group.rank`` > 0 (the
  trainers then train only the adapters; ``field`` names the group in errors).
  ``base_checkpoint``: the checkpoint root ``params`` were loaded from (the
  job's ``init``), recorded in the run's LoRA checkpoints so that
  ``load_params`` can restore their base (None or "": not from a checkpoint)."""
  if group is None or not group.get("rank"):
    return params
  from opd.models.lora import LoRAConfig  # noqa: PLC0415
  from opd.training.lora_state import LoRAStudent  # noqa: PLC0415
  unknown = sorted(set(group) - set(LORA_FIELDS))
  if unknown:
    raise ValueError(f"{field} has unknown field(s) {unknown}; known: {LORA_FIELDS}")
  cfg = LoRAConfig(rank=group.rank, alpha=group.get("alpha", LoRAConfig.alpha),
                   targets=tuple(group.get("targets", LoRAConfig.targets)))
  return LoRAStudent(params, cfg, base_dtype=group.get("base_dtype", "bfloat16"),
                     base_checkpoint=base_checkpoint or None)


def model_at_width(model, width, field: str):
  """``model`` (a config group) at residual width ``width`` D: F scaled by the
  same factor, heads kept (so the head dimension grows with D); ``width`` 0 or
  the model's own D gives ``model`` itself. ``field`` names the config field in
  errors (e.g. ``config.student_width``)."""
  import ml_collections  # noqa: PLC0415
  if not isinstance(width, int) or isinstance(width, bool) or width < 0:
    raise ValueError(f"{field}={width!r}: expected an int >= 0 (0: the model's own width "
                     f"{model.d_model})")
  if width in (0, model.d_model):
    return model
  if model.get("head_dim") is not None or width % model.n_heads:
    raise ValueError(f"{field}={width}: must be a multiple of n_heads={model.n_heads} "
                     "(and the model's head_dim unset)")
  if (width // model.n_heads) % 2:
    raise ValueError(f"{field}={width}: the head dimension {width // model.n_heads} "
                     f"(= {width} / n_heads {model.n_heads}) must be even for RoPE")
  out = ml_collections.ConfigDict(model.to_dict())
  out.d_model, out.d_ff = width, max(1, round(model.d_ff * width / model.d_model))
  return out


@dataclasses.dataclass
class JobContext:
  """What every stage of a single-model job reads (the grm, mathv2 and
  gencluster jobs): the config, the run directory, the model config, the
  tokenizer and the mesh with its rule table."""
  config: Any
  root: pathlib.Path
  model_cfg: ModelConfig
  tok: ByteTokenizer
  mesh: Any
  rules: tuple

  @classmethod
  def for_run(cls, config, workdir) -> "JobContext":
    """``config.model``'s model config, its tokenizer and ``config.mesh``'s mesh."""
    from opd.models import to_model_config  # noqa: PLC0415
    model_cfg = to_model_config(config.model)
    mesh, rules = mesh_and_rules(config)
    return cls(config, pathlib.Path(workdir), model_cfg, tokenizer_for(model_cfg, workdir),
               mesh, rules)


def per_process_batch(global_batch: int, what: str = "config.train.batch_size") -> int:
  n = jax.process_count()
  if global_batch % n:
    raise ValueError(f"{what}={global_batch} is not divisible by the {n} processes")
  return global_batch // n


class Logger:
  """Writes step metrics every ``every`` steps (eval metrics always)."""

  def __init__(self, writer: MetricWriter, every: int = 1):
    self.writer, self.every = writer, max(1, int(every))
    self.history: list[tuple[int, dict[str, float]]] = []

  def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
    is_eval = any(k.startswith("eval/") for k in metrics)
    self.history.append((step, dict(metrics)))
    if is_eval or step % self.every == 0 or step == 1:
      self.writer.write_scalars(step, metrics)


def curve_summary(history, key: str = "loss", points: int = 6) -> list[dict[str, float]]:
  """A few evenly spaced points of a metric curve, for a printed table."""
  rows = [(s, m[key]) for s, m in history if key in m]
  if not rows:
    return []
  idx = sorted({round(i) for i in np.linspace(0, len(rows) - 1, min(points, len(rows)))})
  return [{"step": rows[i][0], key: rows[i][1]} for i in idx]


def plot_curves(workdir: str | pathlib.Path, keys=("loss", "eval/loss"),
                filename: str = "curves.png", title: str = "") -> pathlib.Path | None:
  """Plots metrics from ``workdir/metrics.jsonl``; returns the PNG path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  path = pathlib.Path(workdir)
  if not (path / "metrics.jsonl").exists():
    return None
  rows = read_metrics(path)
  fig, ax = plt.subplots(figsize=(6, 3.5))
  plotted = False
  for key in keys:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    if pts:
      ax.plot(*zip(*pts), label=key, marker="o" if len(pts) < 20 else None)
      plotted = True
  if not plotted:
    plt.close(fig)
    return None
  ax.set_xlabel("step")
  ax.legend()
  ax.set_title(title)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  out = path / filename
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


class Timer:
  def __init__(self):
    self.start = time.perf_counter()

  @property
  def seconds(self) -> float:
    return time.perf_counter() - self.start


def write_json(path: str | pathlib.Path, obj) -> None:
  """``obj`` as JSON at ``path``, written atomically by the main process only."""
  if jax.process_index() == 0:
    atomic_write_json(path, obj, default=float)


def enable_compilation_cache(path: str | None = None) -> str | None:
  """Turns on jax's persistent compilation cache (default ``~/.cache/opd/jax``).

  Stages of one pipeline compile identical programs (same shapes, same
  computation, new Python closures); with the cache the second stage loads
  the executable instead of recompiling, and re-runs start warm. Set
  ``OPD_JAX_CACHE=off`` to disable, or to a directory to move it.
  """
  import os
  choice = path or os.environ.get("OPD_JAX_CACHE") or os.path.expanduser("~/.cache/opd/jax")
  if choice == "off":
    return None
  jax.config.update("jax_compilation_cache_dir", choice)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return choice


FINAL = "final_metrics.json"  # a finished stage's metrics (as the launcher writes)
RECORD = "stage.json"  # a stage's record: its config's digest and its inputs' records' digests


# Fields added to a stage config after stages were written, with the value
# that reproduces what those stages did: a saved ``config.json`` without the
# field matches a stage config holding exactly that value (and no other).
# Paths are today's: a saved config is first brought to today's layout
# (``opd.config.migrations.migrate``: fields that moved, e.g. the flat OPD
# group's ``opd.teacher_temperature`` -> ``opd.loss.teacher_temperature``).
ADDED_FIELDS = {"opd.loss.teacher_temperature": 1.0, "generator.refine_fraction": 0.0,
                "eval.all_if_fewer": False, "opd.weighting.anneal_to": "uniform",
                "sft.principles": 2, "sft.critique": True, "data.keep_rating1_n1": 1.0}


def _added(key: str, want) -> bool:
  """A field missing from a saved config that was added later at ``want``:
  one of :data:`ADDED_FIELDS`, or a ``ModelConfig`` field under any model
  group (``model``, ``student.model``, ``teachers.<name>.model``, ...) at its
  "off" default (``opd.models.config.with_added_fields``)."""
  if key in ADDED_FIELDS:
    return ADDED_FIELDS[key] == want
  parts = key.split(".")
  if len(parts) < 2 or parts[-2] != "model":
    return False
  defaults = with_added_fields({})
  return parts[-1] in defaults and _plain(defaults[parts[-1]]) == want


def _plain(value):
  """A dataclass default as ``config_to_dict`` writes it (None and scalars as they are)."""
  return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


# ``--rerun_downstream`` (experiments.launch): a stage whose inputs changed is
# moved aside and rerun instead of refused.
_RERUN_DOWNSTREAM = contextvars.ContextVar("rerun_downstream", default=False)


@contextlib.contextmanager
def stage_options(*, rerun_downstream: bool = False):
  """Within the block, stale stages are rerun (``True``) or refused (``False``)."""
  token = _RERUN_DOWNSTREAM.set(bool(rerun_downstream))
  try:
    yield
  finally:
    _RERUN_DOWNSTREAM.reset(token)


class StaleStageError(ValueError):
  """A finished (or started) stage read inputs that have changed since."""


def stage_mismatches(saved, cfg) -> list[tuple[str, Any, Any]]:
  """``config_mismatches`` of a saved stage config, brought to today's layout
  (``opd.config.migrations.migrate``), against ``cfg``, except fields added
  later (``_added``) missing from the saved one at their reproducing value.
  A field only the saved config holds is not a mismatch (a stage config
  that stops holding a field it never read still matches its old runs)."""
  bad = config_mismatches(migrate(saved), config_to_dict(cfg))
  return [(k, have, want) for k, have, want in bad
          if not (have == "<missing>" and _added(k, want))]


def cached_json(path: pathlib.Path, make) -> dict:
  """``make()``'s JSON result, saved to ``path`` once; later calls read it (a
  rerun of an interrupted stage skips the parts that finished)."""
  if path.exists():
    return read_json(path)
  out = make()
  write_json(path, out)
  return out


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def record_digest(stage_dir: pathlib.Path) -> str | None:
  """The digest downstream stages record for a finished stage, None if unfinished.

  It hashes the stage's record (its config digest, its own inputs' digests and
  a run id drawn when it finished), so a rerun of the stage, even under the
  same config, or of anything upstream of it, changes it. A stage finished
  before records existed hashes its final metrics and their write time.
  """
  done = stage_dir / FINAL
  if not done.exists():
    return None
  rec = stage_dir / RECORD
  if rec.exists() and read_json(rec, expect=dict).get("run_id"):
    return _sha256(rec.read_bytes())
  return "legacy:" + _sha256(done.read_bytes() + str(done.stat().st_mtime_ns).encode())


def _write_record(stage_dir: pathlib.Path, name: str, cfg, inputs: Mapping[str, str | None],
                  finished: bool) -> None:
  cfg_text = json.dumps(config_to_dict(cfg), sort_keys=True)
  write_json(stage_dir / RECORD, {
      "name": name, "config_sha256": _sha256(cfg_text.encode()), "inputs": dict(inputs),
      "run_id": uuid.uuid4().hex if finished else None,
      "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) if finished else None})


def stale_inputs(stage_dir: pathlib.Path, inputs: Sequence[pathlib.Path]) -> list[str]:
  """The inputs (upstream stage directories) that changed since ``stage_dir`` read them.

  A stage's record lists the digest of every input as it was when the stage
  started; an input whose digest differs now was rerun (or deleted) since. A
  stage finished before records existed is stale when an input finished
  after it. A stage never started has nothing stale.
  """
  rec_path = stage_dir / RECORD
  if rec_path.exists():
    seen = read_json(rec_path, expect=dict).get("inputs", {})
    return [str(p) for p in inputs if str(p) in seen and seen[str(p)] != record_digest(p)]
  done = stage_dir / FINAL
  if not done.exists():
    return []
  return [str(p) for p in inputs if (p / FINAL).exists()
          and (p / FINAL).stat().st_mtime_ns > done.stat().st_mtime_ns]


def _check_saved_config(name: str, cfg, workdir: pathlib.Path) -> None:
  saved_path = workdir / "config.json"
  if saved_path.exists():
    bad = stage_mismatches(read_json(saved_path, expect=dict), cfg)
    if bad:
      detail = "; ".join(f"{k}: was {have!r}, now {want!r}" for k, have, want in bad[:5])
      more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
      raise ValueError(f"{workdir} holds the '{name}' stage of a run with another config "
                       f"({detail}{more}); use a new --workdir or delete that directory")


def _refuse_or_move_aside(name: str, workdir: pathlib.Path, stale: Sequence[str]) -> None:
  if not _RERUN_DOWNSTREAM.get():
    raise StaleStageError(
        f"stage '{name}' ({workdir}) was built on upstream stage(s) {', '.join(stale)} that "
        "changed since (rerun or rebuilt): its results are stale; launch with "
        "--rerun_downstream to rerun it and the stages after it")
  aside = workdir.with_name(f"{workdir.name}.stale-{time.strftime('%Y%m%dT%H%M%S')}-"
                            f"{uuid.uuid4().hex[:6]}")
  workdir.rename(aside)
  print(f"[stage] {name}: upstream {', '.join(stale)} changed; old results moved to {aside}, "
        "rerunning (--rerun_downstream)", flush=True)


def stage_config(config, job: str, **groups) -> ml_collections.ConfigDict:
  """The config of job ``job`` run as a pipeline's stage: the pipeline's ``seed``,
  ``model``, ``mesh`` and ``sharding_rules``, plus ``groups`` (name -> value)."""
  c = ml_collections.ConfigDict()
  c.job = job
  c.seed = config.seed
  c.model = config.model
  c.mesh = config.mesh
  c.sharding_rules = config.sharding_rules
  for name, value in groups.items():
    setattr(c, name, value)
  return c


def run_stage(name: str, fn, cfg, workdir: pathlib.Path,
              inputs: Sequence[str | pathlib.Path] = ()) -> dict:
  """Runs one stage unless it already finished; returns its final metrics.

  A stage directory left by an earlier run (finished or interrupted) is
  reused only when its ``config.json`` matches this run's stage config
  (else a ``ValueError`` names the differing fields and nothing is touched)
  and the records of its ``inputs`` (the upstream stage directories it reads)
  are those it was built on (else ``StaleStageError`` names them; under
  ``stage_options(rerun_downstream=True)`` the old directory is moved aside
  and the stage reruns). Every file is written atomically.
  """
  workdir = pathlib.Path(workdir)
  inputs = [pathlib.Path(p) for p in inputs]
  _check_saved_config(name, cfg, workdir)
  stale = stale_inputs(workdir, inputs)
  if stale:
    _refuse_or_move_aside(name, workdir, stale)
  done = workdir / FINAL
  seen = {str(p): record_digest(p) for p in inputs}
  if done.exists():
    if not (workdir / RECORD).exists():  # finished before records: adopt its inputs as read
      _write_record(workdir, name, cfg, seen, finished=True)
    print(f"[stage] {name}: done earlier ({done})", flush=True)
    return read_json(done, expect=dict)
  print(f"[stage] {name} → {workdir}", flush=True)
  workdir.mkdir(parents=True, exist_ok=True)
  write_json(workdir / "config.json", config_to_dict(cfg))
  if not (workdir / RECORD).exists():  # a resumed stage keeps the inputs it started on
    _write_record(workdir, name, cfg, seen, finished=False)
  metrics = fn(cfg, str(workdir))
  write_json(done, metrics)
  _write_record(workdir, name, cfg, read_json(workdir / RECORD, expect=dict)["inputs"],
                finished=True)
  return metrics


def stage_matches(workdir: pathlib.Path, cfg, inputs: Sequence[pathlib.Path] = ()) -> bool:
  """``workdir`` holds a finished stage whose ``config.json`` matches ``cfg``,
  built on the current records of ``inputs``."""
  saved = workdir / "config.json"
  if not (saved.exists() and (workdir / FINAL).exists()):
    return False
  return (not stage_mismatches(read_json(saved, expect=dict), cfg)
          and not stale_inputs(workdir, inputs))


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of a pipeline, for :meth:`Stages.run_all`.

  Attributes:
    name: the stage's name; its directory is ``root / name`` and its final
      metrics come back as ``name/<metric>``.
    fn: ``fn(cfg, workdir) -> dict`` of final metrics.
    cfg: the stage config (only the groups the stage reads).
    upstream: names of the earlier stages whose outputs it reads.
    check: ``check(cfg)`` raising ``ValueError`` on a bad stage config; run
      for every stage before the first one starts.
  """
  name: str
  fn: Any
  cfg: Any
  upstream: tuple[str, ...] = ()
  check: Any = None


@dataclasses.dataclass(frozen=True)
class Stages:
  """The one stage runner: where a pipeline's stages live, and finished runs to reuse.

  ``run(name, fn, cfg, rel, inputs)`` returns ``(metrics, directory)``. The
  stage is read from the first root in ``reuse`` whose ``rel`` holds it
  finished under the same stage config and inputs (nothing is written there),
  else it runs (or resumes) in ``root / rel`` through :func:`run_stage`.
  Stage configs name their inputs by path, so a stage is reused only when its
  inputs were too: a lever that changes OPD reruns OPD and what follows it,
  and reads the specialists and the cold start from the run it was started
  from (``--config.reuse_from``). ``run_all`` runs a fixed list of
  :class:`Stage` s in order (the grm, mathv2 and gencluster jobs).
  """
  root: pathlib.Path
  reuse: tuple[pathlib.Path, ...] = ()

  @classmethod
  def of(cls, root, reuse: Sequence[str | pathlib.Path] = ()) -> "Stages":
    root = pathlib.Path(root)
    roots = tuple(pathlib.Path(r) for r in reuse if str(r))
    for r in roots:
      if not r.is_dir():
        raise ValueError(f"reuse_from={str(r)!r} is not a directory (a finished run's workdir)")
      if r.resolve() == root.resolve():
        raise ValueError(f"reuse_from={str(r)!r} is the workdir itself")
    return cls(root, roots)

  def find(self, cfg, rel: str, inputs: Sequence[pathlib.Path] = ()) -> pathlib.Path | None:
    """The reuse root's directory holding stage ``rel`` finished under ``cfg``."""
    for r in self.reuse:
      if stage_matches(r / rel, cfg, [pathlib.Path(p) for p in inputs]):
        return r / rel
    return None

  def run(self, name: str, fn, cfg, rel: str,
          inputs: Sequence[str | pathlib.Path] = ()) -> tuple[dict, pathlib.Path]:
    found = self.find(cfg, rel, inputs)
    if found is not None:
      print(f"[stage] {name}: reused from {found}", flush=True)
      return read_json(found / FINAL, expect=dict), found
    d = self.root / rel
    return run_stage(name, fn, cfg, d, inputs), d

  def plan(self, stages: Sequence[Stage], skip: Sequence[str] = ()) -> list[str]:
    """Checks a stage list before anything runs; returns the names that will run.

    Every stage's ``check`` runs first. A finished stage whose upstream is
    unfinished or stale will be stale once that upstream reruns: refused here
    (before hours of earlier stages) unless ``--rerun_downstream``.
    """
    names = [s.name for s in stages]
    for s in stages:
      bad = [u for u in s.upstream if u not in names[:names.index(s.name)]]
      if bad:
        raise ValueError(f"stage {s.name!r} reads {bad}, which are not earlier stages")
      if s.check is not None:
        s.check(s.cfg)
    will_run: list[str] = []
    for s in stages:
      d = self.root / s.name
      if s.name in skip:
        continue
      if not (d / FINAL).exists():
        will_run.append(s.name)
        continue
      changed = [u for u in s.upstream if u in will_run]
      changed += stale_inputs(d, [self.root / u for u in s.upstream if u not in will_run])
      if changed and not _RERUN_DOWNSTREAM.get():
        raise StaleStageError(
            f"stage '{s.name}' ({d}) is finished but its upstream stage(s) "
            f"{', '.join(map(str, changed))} will rerun or changed since: its results would be "
            "stale; launch with --rerun_downstream to rerun it and the stages after it")
      if changed:
        will_run.append(s.name)
    return will_run

  def run_all(self, stages: Sequence[Stage], skip: Sequence[str] = ()) -> dict[str, float]:
    """Runs ``stages`` in order after :meth:`plan`, except those in ``skip``
    (the caller says why); returns every stage's numeric final metrics as
    ``<stage>/<metric>``."""
    self.plan(stages, skip)
    out = {}
    for s in stages:
      if s.name in skip:
        continue
      metrics, _ = self.run(s.name, s.fn, s.cfg, s.name, [self.root / u for u in s.upstream])
      out.update({f"{s.name}/{k}": v for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def run_stage_table(config, root: pathlib.Path, job: str, table, upstream, ctx) -> dict:
  """Runs a pipeline written as a table of ``(name, fn(ctx, stage_dir), config groups)``.

  Each stage's config holds the groups it names (``stage_config(config,
  f"{job}_{name}", ...)``), its upstream stages come from ``upstream[name]``,
  and the stages run in order through :meth:`Stages.run_all` (the gencluster
  and mathv2 jobs). Returns every stage's numeric final metrics plus
  ``wall_s``.
  """
  timer = Timer()
  out = Stages.of(root).run_all([
      Stage(name, lambda _c, w, fn=fn: fn(ctx, pathlib.Path(w)),
            stage_config(config, f"{job}_{name}", **{g: config[g] for g in groups}),
            upstream.get(name, ()))
      for name, fn, groups in table])
  out["wall_s"] = timer.seconds
  return out
