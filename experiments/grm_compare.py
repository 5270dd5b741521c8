"""Shared-backbone GRM against a separate GRM + meta-RM pair (docs/DESIGN.md §6).

  python -m experiments.grm_compare --shared=workdirs/grm --separate=workdirs/grm_d88 \\
      --out=workdirs/grm_compare [--ks=1,2,4,8]

``--shared``: a ``grm`` run whose ``shared`` stage finished (one decoder, two
heads: the LM head judges, the value head guides its own voting).
``--separate``: a ``grm`` run whose ``rule_rl`` and ``meta_rm`` stages
finished (two decoders). With ``--config.grm_width=88`` the separate pair
holds 420,377 parameters against the 128-wide shared backbone's 428,673
(value heads included):
the equal-parameter comparison. Both runs must hold the same data stage
(``data/groups.json`` byte-identical: copy it, the stage then reads as done).

Each arm is benchmarked as the ``grm`` job's benchmark stage does it
(``experiments.grm_benchmark.grm_results``: greedy, voting@k, meta-RM voting@k
with k_meta = ceil(k / 2), the first k of ``max(ks)`` samples, each run's own
``config.benchmark`` sampling settings), on the same test groups. Writes
``results_<arm>_<run>_k<ks>.json`` (cached: a rerun resumes), ``compare.json`` (accuracy
± bootstrap SE per arm, shared − separate paired over the test groups,
parameter counts), ``compare.md`` and ``compare.png``.

``compare.json["yardstick"]`` (``yardstick``) reads the same results with
the GRM yardstick (``grm.yardstick``): n >= 2 strict accuracy per arm and
method, shared − separate paired over the n >= 2 groups, chance (mean 1/n),
each arm's content-blind control when its run judged the control groups,
and pair agreement at the largest k.
"""
from __future__ import annotations

import hashlib
import pathlib
import sys

import numpy as np
from absl import app, flags

from experiments import common

flags.DEFINE_string("shared", None, "grm run dir whose `shared` stage finished")
flags.DEFINE_string("separate", None, "grm run dir whose `rule_rl` and `meta_rm` stages finished")
flags.DEFINE_string("out", "workdirs/grm_compare", "where the results go")
flags.DEFINE_string("ks", "1,2,4,8", "comma-separated k of voting@k")
flags.DEFINE_integer("bootstrap_samples", 1000, "bootstrap resamples for the SEs")
FLAGS = flags.FLAGS

ARMS = ("shared", "separate")


def _need(run_dir: pathlib.Path, stages) -> None:
  missing = [s for s in stages if not (run_dir / s / common.FINAL).exists()]
  if missing:
    raise FileNotFoundError(f"{run_dir}: stages {missing} have not finished (no "
                            f"{common.FINAL}); run the grm job there first")


def _data_digest(run_dir: pathlib.Path) -> str:
  return hashlib.sha256((run_dir / "data" / "groups.json").read_bytes()).hexdigest()


def _cache_name(arm: str, run_dir: pathlib.Path, ks) -> str:
  """One arm's cached results: named by the arm, its run directory and the k's, so
  one ``--out`` holds several comparisons without mixing them up."""
  run = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
  return f"results_{arm}_{run_dir.name}-{run}_k{'-'.join(map(str, ks))}.json"


def arm_results(arm: str, ctx, subsets) -> dict:
  """``grm_results`` of one arm: the shared backbone with its own value head, or
  the rule-RL GRM with the separate meta-RM."""
  from experiments.grm_benchmark import grm_results  # noqa: PLC0415
  from experiments.grm_common import SHARED, stage_params, shared_cfg  # noqa: PLC0415
  head_cfg = shared_cfg(ctx)
  if arm == "shared":
    return grm_results(ctx, SHARED, subsets, (head_cfg, stage_params(ctx, SHARED, head_cfg)),
                        cfg=head_cfg)
  return grm_results(ctx, "rule_rl", subsets, (head_cfg, stage_params(ctx, "meta_rm", head_cfg)))


def param_counts(shared_ctx, separate_ctx) -> dict[str, int]:
  """Parameters each arm holds: the shared decoder plus its value head (D + 1);
  the separate GRM plus the meta-RM, which alone carries a value head."""
  s, p = shared_ctx.model_cfg, separate_ctx.model_cfg
  return {"shared": s.num_params() + s.d_model + 1,
          "separate": 2 * p.num_params() + p.d_model + 1,
          "shared_d_model": s.d_model, "separate_d_model": p.d_model}


def summarize(parts: dict, ks, num_resamples: int, seed: int) -> dict:
  """Accuracy (0-100) ± bootstrap SE per arm and method, and shared − separate
  paired over the test groups (both arms scored the same groups in the same order)."""
  from grm import benchmark_set as bench_lib  # noqa: PLC0415
  from opd.eval.stats import paired_difference  # noqa: PLC0415
  names = ["greedy"] + [f"{kind}@{k}" for k in ks for kind in ("vote", "meta")]
  out = {}
  for name in names:
    row = {}
    flat = {}
    for arm in ARMS:
      by_subset = parts[arm]["correct"][name]
      e = bench_lib.accuracy(by_subset, num_resamples=num_resamples,
                             seed=seed)[bench_lib.OVERALL]
      row[arm] = {"value": e.value, "se": e.se}
      flat[arm] = np.concatenate([np.asarray(v, np.float64) for v in by_subset.values()]) * 100
    d, se = paired_difference(flat["shared"], flat["separate"], num_resamples, (seed, 99))
    row["shared_minus_separate"] = {"value": d, "se": se}
    out[name] = row
  return out


def yardstick(parts: dict, ks, num_resamples: int, seed: int) -> dict:
  """The GRM yardstick of both arms from their results' per-group records:
  ``{"chance", "rows": {method: {arm: n>=2 strict, arm_control: the control's,
  "shared_minus_separate": paired over the n >= 2 groups}}, "pair": {arm: pair
  agreement at max(ks)}}`` (0-100; absent arms' records: an empty dict)."""
  from grm import yardstick as ys  # noqa: PLC0415
  from opd.eval.stats import paired_difference  # noqa: PLC0415
  if not all("records" in parts[a] for a in ARMS):
    return {}
  boot = dict(num_resamples=num_resamples, seed=seed)
  records = {a: parts[a]["records"] for a in ARMS}
  ns = [int(r["n"]) for r in records["shared"]]
  if ns != [int(r["n"]) for r in records["separate"]]:
    raise ValueError("grm_compare: the two arms' records hold different test groups")
  multi = [i for i, n in enumerate(ns) if n >= 2]
  decisions = {a: ys.record_decisions(records[a], ks) for a in ARMS}
  controls = {a: ys.recompute(parts[a]["control_records"], ks, **boot)
              for a in ARMS if "control_records" in parts[a]}
  rows = {}
  for name in decisions["shared"]:
    # recompute() of the records, from the decisions already made
    row = {a: ys.summarize(decisions[a][name], ns, **boot).get(ys.MULTI, {}).get("strict")
           for a in ARMS}
    for a, t in controls.items():
      row[f"{a}_control"] = t[name].get(ys.MULTI, {}).get("strict")
    if multi:
      x, y = (np.asarray([decisions[a][name][i]["strict"] for i in multi], np.float64) * 100
              for a in ARMS)
      d, se = paired_difference(x, y, num_resamples, (seed, 98))
      row["shared_minus_separate"] = {"value": d, "se": se}
    rows[name] = row
  return {"chance": ys.chance(ns), "rows": rows,
          "pair": {a: ys.pair_agreement(records[a], max(ks), **boot) for a in ARMS}}


def render_yardstick(ys_table: dict) -> str:
  """``yardstick``'s table as markdown (empty when the records are missing)."""
  if not ys_table:
    return ""
  cell = lambda e: "–" if not e else f"{e['value']:.1f} ± {e['se']:.1f}"
  chance = ys_table["chance"].get("n>=2")
  lines = ["", "Yardstick, n >= 2 groups (strict accuracy %; the content-blind control in "
           f"brackets; chance {cell(chance) if chance else '–'}):", "",
           "| method | shared | separate | shared − separate (paired) |", "|---|---:|---:|---:|"]
  for name, row in ys_table["rows"].items():
    arms = [cell(row[a]) + (f" ({row[f'{a}_control']['value']:.1f})"
                            if row.get(f"{a}_control") else "") for a in ARMS]
    d = row.get("shared_minus_separate")
    diff = "–" if not d else f"{d['value']:+.1f} ± {d['se']:.1f}"
    lines.append(f"| {name} | {arms[0]} | {arms[1]} | {diff} |")
  pair = ys_table["pair"]
  lines += ["", "Pair agreement (50 = scores blind to which response is better): " + ", ".join(
      f"{a} {cell(pair[a]) if pair[a]['value'] is not None else '–'}" for a in ARMS) + "."]
  return "\n".join(lines) + "\n"


def render(table: dict, counts: dict, invalid: dict) -> str:
  lines = ["| method | shared backbone (1 decoder, D = %d) | separate GRM + meta-RM "
           "(2 decoders, D = %d) | shared − separate (paired) |"
           % (counts["shared_d_model"], counts["separate_d_model"]),
           "|---|---:|---:|---:|"]
  for name, row in table.items():
    cells = [f"{row[a]['value']:.1f} ± {row[a]['se']:.1f}" for a in ARMS]
    d = row["shared_minus_separate"]
    lines.append(f"| {name} | {cells[0]} | {cells[1]} | {d['value']:+.1f} ± {d['se']:.1f} |")
  lines += ["", f"Parameters: shared {counts['shared']:,}, separate {counts['separate']:,} "
            f"({counts['separate'] / counts['shared']:.3f}x).",
            "Invalid sampled judgements: " + ", ".join(
                f"{a} {100 * invalid[a]:.1f}%" for a in ARMS) + "."]
  return "\n".join(lines) + "\n"


def plot(table: dict, ks, counts: dict, path: pathlib.Path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  for arm, style in zip(ARMS, ("o-", "s--")):
    for kind, alpha in (("meta", 1.0), ("vote", 0.45)):
      v = np.array([table[f"{kind}@{k}"][arm]["value"] for k in ks])
      se = np.array([table[f"{kind}@{k}"][arm]["se"] for k in ks])
      ax.plot(ks, v, style, alpha=alpha, label=f"{arm} {kind}@k")
      ax.fill_between(ks, v - se, v + se, alpha=0.12 * alpha)
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(ks), [str(k) for k in ks])
  ax.set_xlabel("k (judgements sampled)")
  ax.set_ylabel("accuracy (%), ± 1 bootstrap SE")
  ax.set_title(f"Shared backbone (D = {counts['shared_d_model']}, {counts['shared']:,} params) vs "
               f"separate\nGRM + meta-RM (D = {counts['separate_d_model']}, "
               f"{counts['separate']:,} params)", fontsize=8)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def compare(shared_dir, separate_dir, out_dir, ks=(1, 2, 4, 8),
            bootstrap_samples: int = 1000) -> dict:
  """Benchmarks both arms (cached per arm in ``out_dir``) and writes the comparison."""
  from experiments.grm_common import load_test_subsets  # noqa: PLC0415
  shared_dir, separate_dir, out = map(pathlib.Path, (shared_dir, separate_dir, out_dir))
  ks = tuple(sorted({int(k) for k in ks}))
  if not ks or ks[0] < 1:
    raise ValueError(f"--ks={ks}: expected positive ints")
  _need(shared_dir, ("data", "shared"))
  _need(separate_dir, ("data", "rule_rl", "meta_rm"))
  if _data_digest(shared_dir) != _data_digest(separate_dir):
    raise ValueError(f"{shared_dir}/data and {separate_dir}/data hold different groups: both "
                     "arms must be scored on the same test set (copy one run's data stage)")
  from experiments import grm as grm_job  # noqa: PLC0415
  ctxs = {"shared": grm_job.saved_run_context(shared_dir, ks),
          "separate": grm_job.saved_run_context(separate_dir, ks)}
  subsets = load_test_subsets(ctxs["shared"])
  out.mkdir(parents=True, exist_ok=True)
  parts = {arm: common.cached_json(out / _cache_name(arm, ctxs[arm].root, ks),
                                   lambda arm=arm: arm_results(arm, ctxs[arm], subsets))
           for arm in ARMS}
  table = summarize(parts, ks, bootstrap_samples, int(ctxs["shared"].config.seed))
  counts = param_counts(ctxs["shared"], ctxs["separate"])
  invalid = {a: parts[a]["invalid"]["sampled"]["invalid_rate"] for a in ARMS}
  ys_table = yardstick(parts, ks, bootstrap_samples, int(ctxs["shared"].config.seed))
  result = {"accuracy": table, "yardstick": ys_table, "params": counts,
            "invalid_sampled": invalid, "ks": list(ks),
            "test_groups": sum(len(v) for v in subsets.values()),
            "shared_dir": str(shared_dir), "separate_dir": str(separate_dir)}
  common.write_json(out / "compare.json", result)
  (out / "compare.md").write_text(render(table, counts, invalid) + render_yardstick(ys_table))
  plot(table, ks, counts, out / "compare.png")
  return result


def main(argv):
  del argv
  if not FLAGS.shared or not FLAGS.separate:
    raise app.UsageError("--shared and --separate are required (grm run directories)")
  common.enable_compilation_cache()
  result = compare(FLAGS.shared, FLAGS.separate, FLAGS.out,
                   tuple(int(k) for k in FLAGS.ks.split(",") if k.strip()),
                   FLAGS.bootstrap_samples)
  print((pathlib.Path(FLAGS.out) / "compare.md").read_text())
  print(f"[grm_compare] {result['test_groups']} test groups; written to {FLAGS.out}")
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
