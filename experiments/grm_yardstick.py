"""The GRM yardstick on any ``grm`` run's GRM stages (docs/DESIGN.md §6).

  python -m experiments.grm_yardstick --workdir=workdirs/grm_control \\
      [--stages=cold_start,rft,rule_rl] [--ks=1,4] [--out=<workdir>/yardstick] \\
      [--constrained=true|false] [--meta_rm]

For each finished GRM stage of the run: greedy and the first k of
``max(ks)`` samples at the run's ``benchmark.temperature`` on its test groups
and on the content-blind control of them (``grm.yardstick.content_blind``),
as the benchmark stage samples them (``experiments.grm_benchmark.grm_results``,
with the run's ``benchmark`` sampling settings), by default with no meta-RM, so a
run that skipped the ``meta_rm`` and ``benchmark`` stages (the
positive-control run, ``experiments/configs/grm.py:control``) is measured too.
``--meta_rm`` scores every sample with the run's finished ``meta_rm`` stage as
the benchmark stage does and keeps the meta-RM voting rows (k_meta over the
valid judgements; results files ``..._meta.json``, never mixed with the
meta-less ones).
``--split`` judges each n >= 2 test group one response at a time (``grm.yardstick.
singles_of`` / ``join_singles``: judgement j of a group is its n single judgements j
side by side), and its control likewise (the content-blind groups, then split);
results ``..._split.json`` and the n >= 2 rows only. ``--on=train`` judges the
train split's groups instead of the test split's (results ``..._train.json``):
whether the GRM fits the groups it was trained on. Every run also writes
``pair.json`` and a pair-agreement line per stage (``grm.yardstick.pair_agreement``
at the largest k, and on the control).
``--constrained`` overrides the run's ``benchmark.constrained`` (the score line
decoded under its grammar, so no judgement has the wrong count of scores;
default: the run's setting); give such a measurement its own ``--out``.
Writes ``results_<stage>_k<ks>.json`` (per-group records; cached, so a rerun
resumes), ``yardstick.json`` (``experiments.grm_benchmark.yardstick_table``:
strict and chance-credit accuracy, valid and tie rates, n >= 2 and n = 1
apart, chance, the most-common-rating baseline, the control) and
``yardstick.md``. Without ``--meta_rm`` the meta-RM rows are left out.
"""
from __future__ import annotations

import pathlib
import sys

from absl import app, flags

from experiments import common

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when run as a program (not at import:
  ``experiments.grm_compare`` defines a ``--ks`` of its own, and a process that
  imports both must not see the flag twice)."""
  flags.DEFINE_string("workdir", None, "a grm run directory")
  flags.DEFINE_string("stages", "cold_start,rft,rule_rl", "comma-separated GRM stages")
  flags.DEFINE_string("ks", "1,4", "comma-separated k of voting@k")
  flags.DEFINE_string("out", None, "where the results go (default <workdir>/yardstick)")
  flags.DEFINE_enum("constrained", None, ["true", "false"],
                    "decode the score line under its grammar (default: the run's setting)")
  flags.DEFINE_bool("meta_rm", False, "score the samples with the run's meta_rm stage and keep "
                    "the meta-RM voting rows")
  flags.DEFINE_bool("split", False, "judge each n >= 2 group one response at a time")
  flags.DEFINE_enum("on", "test", ["test", "train"],
                    "the groups judged: the test split, or the train split the GRM was "
                    "trained on (does it fit what it saw?)")


def parse_ks(text: str) -> tuple[int, ...]:
  """``"1,4"`` as ``(1, 4)``; ValueError naming ``--ks`` unless non-empty ints >= 1."""
  try:
    ks = tuple(int(k) for k in text.split(","))
  except ValueError:
    raise ValueError(f"--ks={text!r} must be comma-separated ints >= 1") from None
  if not ks or min(ks) < 1:
    raise ValueError(f"--ks={text!r} must be comma-separated ints >= 1")
  return ks


def split_results(ctx, stage: str, subsets, meta) -> dict:
  """``grm_results``' records for the n >= 2 groups of ``subsets`` judged one
  response at a time (``--split``), and for their content-blind control split
  the same way: ``{"records", "control_records"}``."""
  from experiments.grm_benchmark import grm_results  # noqa: PLC0415
  from grm import yardstick as ys  # noqa: PLC0415
  multi = {s: [g for g in gs if g.n >= 2] for s, gs in subsets.items()}
  flat = [g for gs in multi.values() for g in gs]
  names = [s for s, gs in multi.items() for _ in gs]
  blind = ys.content_blind(flat, ctx.config.seed + 19)  # built as grm_results builds its control
  saved = ctx.config.benchmark.content_blind
  ctx.config.benchmark.content_blind = False  # the control is split here, not there
  try:
    out = {}
    for key, groups in (("records", flat), ("control_records", blind)):
      res = grm_results(ctx, stage, {"split": ys.singles_of(groups)}, meta)
      out[key] = ys.join_singles(groups, res["records"], subsets=names)
    return out
  finally:
    ctx.config.benchmark.content_blind = saved


def pair_lines(parts, ks, c) -> tuple[dict, list[str]]:
  """Pair agreement at ``max(ks)`` of each stage's records and control records:
  ``({stage: {"grm", "control"}}, markdown lines)``."""
  from grm import yardstick as ys  # noqa: PLC0415
  boot = dict(num_resamples=c.benchmark.bootstrap_samples, seed=c.seed)
  out, lines = {}, ["", f"Pair agreement at k = {max(ks)} (50: scores blind to which response "
                        "is better; ± bootstrap SE over groups):", ""]
  for stage, res in parts.items():
    if "records" not in res:
      continue
    row = {"grm": ys.pair_agreement(res["records"], max(ks), **boot)}
    if "control_records" in res:
      row["control"] = ys.pair_agreement(res["control_records"], max(ks), **boot)
    out[stage] = row
    cell = lambda e: "–" if e.get("value") is None else f"{e['value']:.1f} ± {e['se']:.1f}"
    lines.append(f"- {stage}: {cell(row['grm'])}"
                 + (f" (control {cell(row['control'])})" if "control" in row else ""))
  return out, lines


def measure(run_dir, stages, ks, out, constrained: bool | None = None,
            meta_rm: bool = False, split: bool = False, on: str = "test") -> dict:
  """The yardstick table of ``stages`` of ``run_dir`` (module docstring); writes ``out``
  (``constrained``: the run's ``benchmark.constrained`` overridden when not None;
  ``meta_rm``: the samples scored by the run's meta-RM, its voting rows kept;
  ``split``: each n >= 2 group judged one response at a time; ``on``: "test" or
  "train", the split whose groups are judged)."""
  if on not in ("test", "train"):
    raise ValueError(f"--on={on!r}: expected 'test' or 'train'")
  from experiments.grm_benchmark import grm_results, yardstick_table  # noqa: PLC0415
  from experiments import grm as grm_job  # noqa: PLC0415
  from experiments.grm_common import (GRM_STAGES, load_groups, load_test_subsets,  # noqa: PLC0415
                                      stage_params)
  from experiments.grm_report import render_yardstick  # noqa: PLC0415
  run_dir, out = pathlib.Path(run_dir), pathlib.Path(out)
  bad = sorted(set(stages) - set(GRM_STAGES))
  if not stages or bad:
    raise ValueError(f"--stages={','.join(stages)!r}: {bad or 'none'} not among the GRM "
                     f"stages {GRM_STAGES}")
  missing = [s for s in (*stages, *(("meta_rm",) if meta_rm else ()))
             if not (run_dir / s / common.FINAL).exists()]
  if missing:
    raise FileNotFoundError(f"{run_dir}: stages {missing} have not finished (no "
                            f"{common.FINAL})")
  ctx = grm_job.saved_run_context(run_dir, ks, content_blind=True,  # the control on
                                  constrained=constrained)
  subsets = load_test_subsets(ctx) if on == "test" else {"train": load_groups(ctx)["train"]}
  meta = None
  if meta_rm:
    meta_cfg = ctx.model_cfg.replace(scalar_head=True)
    meta = (meta_cfg, stage_params(ctx, "meta_rm", meta_cfg))
  out.mkdir(parents=True, exist_ok=True)
  tag = ("-".join(map(str, ks)) + ("_meta" if meta_rm else "") + ("_split" if split else "")
         + ("_train" if on == "train" else ""))
  judge = split_results if split else grm_results
  parts = {stage: common.cached_json(out / f"results_{stage}_k{tag}.json",
                                     lambda stage=stage: judge(ctx, stage, subsets, meta))
           for stage in stages}
  table = yardstick_table(parts, load_groups(ctx).get("train", []), ctx.config)
  if not meta_rm:
    table = {name: row for name, row in table.items() if "/meta@" not in name}
  pair, lines = pair_lines(parts, ks, ctx.config)
  common.write_json(out / "yardstick.json", table)
  common.write_json(out / "pair.json", pair)
  (out / "yardstick.md").write_text("\n".join(
      [f"# GRM yardstick of {run_dir} ({'meta-RM' if meta_rm else 'no meta-RM'}"
       + (", each response judged alone" if split else "")
       + (", on the train split" if on == "train" else "") + ")"]
      + render_yardstick(table) + lines) + "\n")
  return table


def main(argv):
  del argv
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  run_dir = pathlib.Path(FLAGS.workdir)
  measure(run_dir, tuple(s for s in FLAGS.stages.split(",") if s), parse_ks(FLAGS.ks),
          FLAGS.out or run_dir / "yardstick",
          None if FLAGS.constrained is None else FLAGS.constrained == "true", FLAGS.meta_rm,
          FLAGS.split, FLAGS.on)
  sys.stdout.write((pathlib.Path(FLAGS.out or run_dir / "yardstick") / "yardstick.md")
                   .read_text())


if __name__ == "__main__":
  define_flags()
  app.run(main)
