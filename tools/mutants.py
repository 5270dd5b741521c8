"""Hand-written mutation testing of the core math (``make mutants``; not in CI).

Each mutant is a small, plausible bug in a module whose bugs would silently
corrupt results (the fused-KL tile math and chunked scan, the decoder, the
sampler's warpers, the GRPO loss and advantages, the distillation loss). For
every mutant the script

1. copies the repository (the committed tree, ``git archive HEAD``, or with
   ``--worktree`` the working tree) into a scratch directory, once;
2. replaces the mutant's ``original`` snippet by its ``mutated`` one in the
   scratch copy (a snippet that is not found exactly once is reported as
   ``snippet not found``: the code moved, the mutant needs updating);
3. runs the mutant's tight test selection there with ``pytest -x -q``,
   ``PYTHONPATH`` pointing at the scratch copy so that the editable install
   in ``.venv`` does not shadow it (checked: ``opd.__file__`` must lie in the
   scratch copy), and restores the file.

A mutant is *killed* when its tests fail, *survived* when they pass. Every
test selection is first run once unmutated (``baseline``): a selection that
already fails makes its mutants ``baseline failed`` instead of killed.
Results are printed as a table and written to
``benchmark_results/mutants.json``.

Why not ``mutmut``: it generates every operator/constant mutation of a
module (hundreds per file here) and reruns the selected tests for each,
where a single run of this repo's tests is dominated by XLA compilation
(seconds to a minute), so a run over these modules would take days on the
2-core reference machine; and most of its mutants of JAX code are either
shape errors caught at trace time or numerically equivalent. Hand-picked
mutants target the bugs that would pass silently.

  .venv/bin/python tools/mutants.py                  # everything (~15-25 min on 2 cores)
  .venv/bin/python tools/mutants.py --only kernels   # one group
  .venv/bin/python tools/mutants.py --list           # the mutants, nothing run
  .venv/bin/python tools/mutants.py --rerun          # only what the last run did not kill
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
  """One hand-written bug.

  Attributes:
    name: short id.
    group: ``kernels``, ``decoder``, ``sampler``, ``grpo`` or ``distill``.
    path: file to mutate, relative to the repository root.
    edits: ``(original, mutated)`` snippet pairs; each original must occur
      exactly once in the file.
    tests: pytest arguments selecting the tests that should kill it (paths
      or node ids; paths that do not exist are dropped).
    why: the bug it models.
  """
  name: str
  group: str
  path: str
  edits: tuple[tuple[str, str], ...]
  tests: tuple[str, ...]
  why: str


_KL_TESTS = ("tests/pallas_kernels/test_kl_chunked.py", "tests/pallas_kernels/test_kl_properties.py")
_DECODER_TESTS = ("tests/opd/models/test_decoder.py",
                  "tests/opd/models/test_hf.py::test_load_hf_matches_transformers")
_MLA_TESTS = ("tests/opd/models/test_mla.py",
              "tests/opd/models/test_hf_deepseek.py::test_load_hf_matches_transformers")
_SAMPLER_TESTS = ("tests/opd/rollout/test_sampler.py",)
_GRPO_TESTS = ("tests/opd/rl/test_rl_loss.py",)
_ADVANTAGE_TESTS = ("tests/opd/rl/test_advantages.py", "tests/opd/rl/test_rl_loss.py")
_DISTILL_TESTS = ("tests/opd/distill/test_distill_loss.py",)
_KL_LOSSES_TESTS = ("tests/pallas_kernels/test_kl_losses.py", "tests/opd/distill/test_distill_loss.py")

M = Mutant
MUTANTS: tuple[Mutant, ...] = (
    # --- pallas_kernels: tile math and chunked scan -------------------------
    M("online_rescale_dropped", "kernels", "pallas_kernels/tile_math.py",
      (("l = alpha * acc.l + jnp.sum(e, axis=1, keepdims=True)",
        "l = acc.l + jnp.sum(e, axis=1, keepdims=True)"),),
      _KL_TESTS, "the running sum l is not rescaled when the running max moves"),
    M("running_max_is_mean", "kernels", "pallas_kernels/tile_math.py",
      (("m_new = jnp.maximum(acc.m, jnp.max(_sel(valid, z, NEG), axis=1, keepdims=True))",
        "m_new = jnp.maximum(acc.m, jnp.mean(_sel(valid, z, 0.0), axis=1, keepdims=True))"),),
      _KL_TESTS, "running max replaced by a running mean (exact in real arithmetic; "
      "exp(z - m) overflows for peaked logits)"),
    M("entropy_shift_dropped", "kernels", "pallas_kernels/tile_math.py",
      (("s = alpha * (acc.s - (m_new - acc.m) * acc.l)", "s = alpha * acc.s"),),
      _KL_TESTS, "Σ e^(z-m)(z-m) not re-centred when the max moves"),
    M("teacher_rescale_dropped", "kernels", "pallas_kernels/tile_math.py",
      (("l_k.append(jnp.exp(acc.m_k[k] - mk_new) * acc.l_k[k] +", "l_k.append(acc.l_k[k] +"),),
      _KL_TESTS, "teacher normaliser not rescaled to the new teacher max"),
    M("kl_sign", "kernels", "pallas_kernels/tile_math.py",
      (("return stats.e_k - stats.lse[:, None] + stats.lse_k",
        "return stats.e_k + stats.lse[:, None] - stats.lse_k"),),
      _KL_TESTS, "log-normaliser terms of KL(p‖q) with the wrong sign"),
    M("dz_constant_sign", "kernels", "pallas_kernels/tile_math.py",
      (("inner = coef.c * (z - coef.ez) + coef.r", "inner = coef.c * (z - coef.ez) - coef.r"),),
      # r = g_lse + Σ g_e_k is 0 for any function of KL and entropy (both are
      # shift-invariant in z); only the cross-entropy (lse - z_y) exercises it.
      ("tests/pallas_kernels/test_kl_losses.py", *_KL_TESTS),
      "backward: the lse cotangent term enters with the wrong sign"),
    M("merge_entropy_shift_dropped", "kernels", "pallas_kernels/tile_math.py",
      (("ent = jnp.sum(w * (parts.ent + jnp.expand_dims(lse, axis) - parts.lse), axis=axis)",
        "ent = jnp.sum(w * parts.ent, axis=axis)"),),
      ("tests/pallas_kernels/test_kl_properties.py::test_merge_stats_is_exact_with_an_empty_partition",
       "tests/pallas_kernels/test_kl_pallas.py::test_pallas_matches_oracle"),
      "merging vocabulary partitions forgets the entropy's lse shift"),
    M("grad_missing_inv_tau", "kernels", "pallas_kernels/chunked.py",
      (("dz = (dz_fn(z, start, size) * inv_tau).astype(mm_dtype)",
        "dz = dz_fn(z, start, size).astype(mm_dtype)"),),
      _KL_TESTS, "backward drops the chain rule's 1/τ"),
    M("last_tile_off_by_one", "kernels", "pallas_kernels/chunked.py",
      (("carry = step(carry, n_full * bv, rem)", "carry = step(carry, n_full * bv, max(rem - 1, 1))"),),
      _KL_TESTS, "the remainder tile misses the last vocabulary column"),
    # --- decoder ------------------------------------------------------------
    M("rope_on_v", "decoder", "opd/models/decoder.py",
      (("k = rope(k, positions, cfg.rope_theta)", "v = rope(v, positions, cfg.rope_theta)"),),
      _DECODER_TESTS, "RoPE rotates the values instead of the keys"),
    M("gqa_h_mod_k", "decoder", "opd/models/decoder.py",
      (("qg = q.reshape(B, T, K, G, Dh)", "qg = q.reshape(B, T, G, K, Dh).swapaxes(2, 3)"),
       ('out = jnp.einsum("BKGTS,BSKE->BTKGE", probs, v).reshape(B, T, H, Dh)',
        'out = jnp.einsum("BKGTS,BSKE->BTGKE", probs, v).reshape(B, T, H, Dh)')),
      _DECODER_TESTS, "query head h reads kv head h % K instead of h // G"),
    M("mlp_dropped_in_bf16", "decoder", "opd/models/decoder.py",
      (('x = x + MLP(cfg, name="mlp")(norm("mlp_norm")(x))',
        'x = x + MLP(cfg, name="mlp")(norm("mlp_norm")(x)) * (cfg.compute_dtype == jnp.float32)'),),
      _DECODER_TESTS, "the MLP branch contributes nothing when computing in bfloat16"),
    M("rmsnorm_eps_outside", "decoder", "opd/models/layers.py",
      (("jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)",
        "(jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)) + self.eps)"),),
      _DECODER_TESTS, "RMSNorm adds eps after the rsqrt instead of inside it"),
    M("causal_mask_sees_next", "decoder", "opd/models/decoder.py",
      (("causal = jnp.tril(jnp.ones((T, T), bool))", "causal = jnp.tril(jnp.ones((T, T), bool), k=1)"),),
      _DECODER_TESTS, "causal mask off by one: each query also sees the next token"),
    M("cache_mask_excludes_self", "decoder", "opd/models/decoder.py",
      (("causal = slots[None, :] <= (index + jnp.arange(T))[:, None]",
        "causal = slots[None, :] < (index + jnp.arange(T))[:, None]"),),
      _DECODER_TESTS, "cached decoding: a query does not attend to its own slot"),
    M("rope_rotation_reversed", "decoder", "opd/models/layers.py",
      (("rotated = jnp.concatenate([-x2, x1], axis=-1)", "rotated = jnp.concatenate([x2, -x1], axis=-1)"),),
      _DECODER_TESTS, "RoPE rotates the other way (positions enter with the wrong sign)"),
    M("mla_interleave_ignored", "decoder", "opd/models/mla.py",
      (("  if m.rope_interleave:\n", "  if False:\n"),),
      _MLA_TESTS, "MLA: DeepSeek's interleaved RoPE pairs rotated as halves"),
    M("mla_scale_nope_only", "decoder", "opd/models/mla.py",
      (("scale = m.qk_head_dim ** -0.5", "scale = m.qk_nope_head_dim ** -0.5"),),
      _MLA_TESTS, "MLA: softmax scale from the non-RoPE query dims only"),
    M("mla_absorbed_rope_key_dropped", "decoder", "opd/models/mla.py",
      (('+ jnp.einsum("BTHE,BSE->BHTS", q_rope, kr, preferred_element_type=jnp.float32))',
        '+ 0 * jnp.einsum("BTHE,BSE->BHTS", q_rope, kr, preferred_element_type=jnp.float32))'),),
      _MLA_TESTS, "MLA absorbed (cached) form: scores lose the shared RoPE key"),
    M("mla_cache_holds_unnormalised_latent", "decoder", "opd/models/mla.py",
      (("c[:, None].astype(cc.dtype)", "ckv[:, None, :, :C].astype(cc.dtype)"),),
      _MLA_TESTS, "MLA cache: the latent written before its RMSNorm"),
    # --- sampler --------------------------------------------------------------
    M("top_p_keeps_one_too_few", "sampler", "opd/rollout/sampler.py",
      (("nucleus = jnp.take_along_axis(sorted_vals, n_keep - 1, axis=-1)",
        "nucleus = jnp.take_along_axis(sorted_vals, jnp.maximum(n_keep - 2, 0), axis=-1)"),),
      _SAMPLER_TESTS, "the nucleus drops the token that makes its mass reach top_p"),
    M("temperature_not_applied", "sampler", "opd/rollout/sampler.py",
      (("tempered = logits.astype(jnp.float32) / temperature",
        "tempered = logits.astype(jnp.float32)"),),
      _SAMPLER_TESTS, "sampling ignores the temperature"),
    M("reported_logprob_untempered", "sampler", "opd/rollout/sampler.py",
      (("logp = jax.nn.log_softmax(tempered, axis=-1)",
        "logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)"),),
      _SAMPLER_TESTS, "reported log-probs are not at the sampling temperature"),
    M("top_k_off_by_one", "sampler", "opd/rollout/sampler.py",
      (("k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)",
        "k = jnp.where(top_k > 0, jnp.minimum(top_k + 1, V), V)"),),
      _SAMPLER_TESTS, "top-k keeps k + 1 tokens"),
    M("decode_position_off_by_one", "sampler", "opd/rollout/sampler.py",
      (("(prompt_len + t)[:, None]", "(prompt_len + t + 1)[:, None]"),),
      _SAMPLER_TESTS, "decode steps use RoPE position p + 1"),
    M("constraint_state_not_advanced", "sampler", "opd/rollout/sampler.py",
      (('new["fsm"] = jnp.where(live, jnp.take_along_axis(nxt, token[:, None], axis=1)[:, 0],',
        'new["fsm"] = jnp.where(live, s["fsm"],'),),
      ("tests/opd/rollout/test_constraint.py",),
      "constrained decoding: the automaton state stays at the start"),
    M("constrained_logprob_unmasked", "sampler", "opd/rollout/sampler.py",
      (("    token, logp = _sample(logits, jax.random.fold_in(rng, t), knobs)\n",
        "    token, logp = _sample(logits, jax.random.fold_in(rng, t), knobs)\n"
        "    logp = jnp.take_along_axis(jax.nn.log_softmax(s['logits'].astype(jnp.float32) / "
        "jnp.where(knobs.temperature == 0.0, 1.0, knobs.temperature), axis=-1), "
        "token[:, None], axis=-1)[:, 0]\n"),),
      ("tests/opd/rollout/test_constraint.py",),
      "constrained decoding reports the unmasked distribution's log-probs"),
    # --- GRPO loss and advantages (run last: the module layout was moving) ---
    M("clip_sides_swapped", "grpo", "opd/rl/loss.py",
      (("jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)",
        "jnp.clip(ratio, 1.0 - clip_eps_high, 1.0 + clip_eps_low)"),),
      _GRPO_TESTS, "clip range with eps_low and eps_high swapped"),
    M("pessimistic_min_is_max", "grpo", "opd/rl/loss.py",
      (("pg = -jnp.minimum(ratio * A, clipped * A)", "pg = -jnp.maximum(ratio * A, clipped * A)"),),
      _GRPO_TESTS, "the clipped surrogate takes the optimistic side"),
    M("kl_direction", "grpo", "opd/rl/loss.py",
      (("jnp.clip(ref_logp - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)",
        "jnp.clip(logp - ref_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)"),),
      _GRPO_TESTS, "k3 estimator of the wrong KL direction"),
    M("kl_coef_ignored", "grpo", "opd/rl/loss.py",
      (("per_token = pg + kl_coef * kl", "per_token = pg + kl"),),
      _GRPO_TESTS, "KL penalty added with weight 1"),
    M("token_mean_over_all_tokens", "grpo", "opd/rl/loss.py",
      (("jnp.sum(per_token * w) / jnp.where(total > 0, total, 1.0)",
        "jnp.sum(per_token * w) / per_token.size"),),
      _GRPO_TESTS, "token_mean divides by every position, padding included"),
    M("sequence_mean_by_batch", "grpo", "opd/rl/loss.py",
      (("jnp.sum(jnp.where(rows, seq, 0.0)) / jnp.maximum(count, 1)",
        "jnp.sum(jnp.where(rows, seq, 0.0)) / per_token.shape[0]"),),
      _GRPO_TESTS, "sequence_mean counts empty rows"),
    M("advantage_mean_mixes_prompts", "grpo", "opd/rl/advantages.py",
      (("adv = r - r.mean(axis=1, keepdims=True)", "adv = r - r.mean()"),),
      _ADVANTAGE_TESTS, "advantages centred on the batch mean, not the prompt's group"),
    M("advantage_std_mixes_prompts", "grpo", "opd/rl/advantages.py",
      (("std = np.where(flat, 1.0, r.std(axis=1))[:, None]",
        "std = np.where(flat, 1.0, r.std())[:, None]"),),
      _ADVANTAGE_TESTS, "advantages scaled by the batch std, not the group's"),
    M("advantage_not_scaled", "grpo", "opd/rl/advantages.py",
      (("adv = adv / (std + eps)", "adv = adv"),),
      _ADVANTAGE_TESTS, "scale_by_std ignored"),
    # --- distillation loss ----------------------------------------------------
    M("token_estimator_plain_logprob_grad", "distill", "opd/distill/loss.py",
      (("pg = jax.lax.stop_gradient(est) * est", "pg = est"),),
      _DISTILL_TESTS, "token-level estimator: gradient of a_t instead of a_t ∇log p_s(y_t)"),
    M("teacherless_tokens_kept", "distill", "opd/distill/loss.py",
      (("& (jnp.sum(weights, axis=-1) > 0))", ")"),),
      _DISTILL_TESTS, "tokens no teacher answered count in the mean"),
    M("distill_sequence_mean_by_batch", "distill", "opd/distill/loss.py",
      (("return keep / jnp.maximum(n, 1.0) / jnp.maximum(rows, 1.0)",
        "return keep / jnp.maximum(n, 1.0) / keep.shape[0]"),),
      _DISTILL_TESTS, "sequence_mean counts rows without trained tokens"),
    M("token_level_teacher_unnormalised", "distill", "pallas_kernels/losses.py",
      (("zip(h_k, w_k)], axis=1) - jax.lax.stop_gradient(stats.lse_k)", "zip(h_k, w_k)], axis=1)"),),
      _KL_LOSSES_TESTS, "token-level estimator uses teacher logits, not log-probs"),
    M("topk_kl_direction", "distill", "pallas_kernels/losses.py",
      (("kls.append(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1))",
        "kls.append(jnp.sum(jnp.exp(lq) * (lq - lp), axis=-1))"),),
      _KL_LOSSES_TESTS, "top-k estimator computes the forward KL"),
)
GROUPS = ("kernels", "decoder", "sampler", "grpo", "distill")


def make_scratch(worktree: bool) -> pathlib.Path:
  """A copy of the repository to mutate (without .git, .venv, outputs)."""
  root = pathlib.Path(tempfile.mkdtemp(prefix="mutants_"))
  if worktree:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "benchmark_results",
                                    "workdirs", "runs", "*.egg-info", ".pytest_cache")
    shutil.copytree(REPO, root, ignore=ignore, dirs_exist_ok=True)
  else:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
  return root


def _env(root: pathlib.Path) -> dict:
  env = os.environ.copy()
  env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
  env["PYTHONDONTWRITEBYTECODE"] = "1"
  return env


def check_shadowing(root: pathlib.Path) -> None:
  """Raises unless ``import opd, pallas_kernels`` resolve inside the scratch copy."""
  out = subprocess.run(
      [sys.executable, "-c", "import opd, pallas_kernels; print(opd.__file__); "
       "print(pallas_kernels.__file__)"],
      cwd=root, env=_env(root), capture_output=True, text=True, check=True).stdout.split()
  if not all(pathlib.Path(p).resolve().is_relative_to(root.resolve()) for p in out):
    raise RuntimeError(f"the scratch copy is shadowed: modules load from {out}, not {root}")


def run_tests(root: pathlib.Path, tests: list[str], timeout: float) -> dict:
  """``pytest -x -q`` of ``tests`` in ``root``: status, first failing test, seconds."""
  cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider",
         "-p", "no:randomly", *tests]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"failed": True, "by": f"timeout after {timeout:.0f} s", "seconds": timeout, "rc": None}
  seconds = time.perf_counter() - t0
  failed_ids = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
  # rc 1: a test failed; 2: collection/import error (also a kill); 4/5: usage / nothing ran.
  if proc.returncode in (4, 5):
    return {"failed": None, "by": f"pytest rc={proc.returncode}: {proc.stdout[-300:]}",
            "seconds": seconds, "rc": proc.returncode}
  return {"failed": proc.returncode != 0, "by": failed_ids[0] if failed_ids else
          (proc.stdout.strip().splitlines() or [""])[-1], "seconds": seconds, "rc": proc.returncode}


def apply_edits(text: str, edits) -> str | None:
  """``text`` with every edit applied, or None if an original is not found exactly once."""
  for original, mutated in edits:
    if text.count(original) != 1:
      return None
    text = text.replace(original, mutated)
  return text


def run(mutants, root: pathlib.Path, timeout: float, log=print) -> list[dict]:
  """Runs ``mutants`` in ``root``; returns one result row per mutant."""
  baselines: dict[tuple, dict] = {}
  rows = []
  for mut in mutants:
    row = {"mutant": mut.name, "group": mut.group, "module": mut.path, "why": mut.why}
    tests = [t for t in mut.tests if (root / t.split("::")[0]).exists()]
    target = root / mut.path
    original = target.read_text() if target.exists() else None
    mutated = apply_edits(original, mut.edits) if original is not None else None
    if not tests:
      row.update(status="tests not found", killed_by="", seconds=0.0, tests=list(mut.tests))
    elif mutated is None:
      row.update(status="snippet not found", killed_by="", seconds=0.0, tests=tests)
    else:
      key = tuple(tests)
      if key not in baselines:
        baselines[key] = run_tests(root, tests, timeout)
        log(f"  baseline {' '.join(tests)}: "
            f"{'FAILS' if baselines[key]['failed'] else 'passes'} "
            f"({baselines[key]['seconds']:.0f} s)")
      if baselines[key]["failed"] is not False:
        row.update(status="baseline failed", killed_by=baselines[key]["by"], seconds=0.0,
                   tests=tests)
      else:
        try:
          target.write_text(mutated)
          res = run_tests(root, tests, timeout)
        finally:
          target.write_text(original)
        status = {True: "killed", False: "survived", None: "error"}[res["failed"]]
        row.update(status=status, killed_by=res["by"] if res["failed"] else "",
                   seconds=res["seconds"], tests=tests)
    log(f"{row['mutant']:36s} {row['status']:18s} {row['seconds']:6.1f} s  {row['killed_by']}")
    rows.append(row)
  return rows


def _table(rows) -> str:
  lines = ["| mutant | module | status | killed by | time (s) |", "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['mutant']} | {r['module']} | {r['status']} | {r['killed_by']} | "
                 f"{r['seconds']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="+", choices=GROUPS, help="groups to run (default: all)")
  parser.add_argument("--mutant", nargs="+", help="mutant names to run")
  parser.add_argument("--worktree", action="store_true",
                      help="mutate a copy of the working tree instead of the committed HEAD")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
  parser.add_argument("--out", default=str(REPO / "benchmark_results"))
  parser.add_argument("--list", action="store_true", help="print the mutants and exit")
  parser.add_argument("--merge", action="store_true",
                      help="merge the results into the last mutants.json in --out (rows of "
                           "mutants not run now are kept)")
  parser.add_argument("--rerun", action="store_true",
                      help="--merge, running only the selected mutants not listed as killed")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  selected = [m for m in MUTANTS if (not args.only or m.group in args.only)
              and (not args.mutant or m.name in args.mutant)]
  previous = {}
  if (args.merge or args.rerun) and (out / "mutants.json").exists():
    previous = {r["mutant"]: r for r in json.loads((out / "mutants.json").read_text())["rows"]}
  if args.rerun:
    selected = [m for m in selected if previous.get(m.name, {}).get("status") != "killed"]
  if args.mutant and len(selected) != len(set(args.mutant)):
    unknown = sorted(set(args.mutant) - {m.name for m in selected})
    raise SystemExit(f"--mutant: unknown names {unknown}")
  if args.list:
    for m in selected:
      print(f"{m.name:36s} {m.path:32s} {m.why}")
    return {}
  root = make_scratch(args.worktree)
  try:
    check_shadowing(root)
    print(f"scratch copy: {root} ({'working tree' if args.worktree else 'HEAD'})")
    t0 = time.perf_counter()
    rows = run(selected, root, args.timeout)
    total = time.perf_counter() - t0
  finally:
    shutil.rmtree(root, ignore_errors=True)
  if previous:  # keep earlier results of mutants not rerun, in MUTANTS order
    fresh = {r["mutant"]: r for r in rows}
    merged = {**previous, **fresh}
    rows = [merged[m.name] for m in MUTANTS if m.name in merged]
  counts = {st: sum(r["status"] == st for r in rows) for st in sorted({r["status"] for r in rows})}
  print()
  print(_table(rows))
  print(f"\n{counts} in {total / 60:.1f} min")
  survivors = [r["mutant"] for r in rows if r["status"] != "killed"]
  if survivors:
    print("not killed: " + ", ".join(survivors))
  commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  source = "worktree" if args.worktree else f"HEAD {commit}"
  for r in rows:
    r.setdefault("source", source)
  payload = {"source": source, "rows": rows, "counts": counts, "total_s": total}
  out.mkdir(parents=True, exist_ok=True)
  (out / "mutants.json").write_text(json.dumps(payload, indent=2))
  print(f"wrote {out / 'mutants.json'}")
  return payload


if __name__ == "__main__":
  main()
