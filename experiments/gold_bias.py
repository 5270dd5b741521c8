r"""The GOLD surrogate's bias against the span-exact form, on a real student/teacher pair (#32).

  python -m experiments.gold_bias \
      --stage=workdirs/opd_forms_B/opd_forms/code/cross_tokenizer/seed0/opd \
      --control=workdirs/v4_strong/positive_control/code/opd

``opd.distill.gold.gold_surrogate`` (docs/DESIGN.md §3) stands in for the
reverse KL when the teacher's vocabulary is not the student's. What it
approximates is the span-exact form (``opd.distill.crosstok``): at a
position where student and teacher condition on the same bytes (a common
byte boundary of the two tokenizations of the row), the teacher's
probability of a student token ``v`` is that of its bytes,
``q̃(v) = π_T(bytes(v) | prefix)``, the product of the teacher's
probabilities of its own tokens for those bytes (``crosstok.transcode`` of
``[v]``). The span-exact per-position objective and its gradient w.r.t. the
student logits ``z`` are::

  L̃ = Σ_v p(v) (log p(v) − log q̃(v))      ∇_z L̃ = p ⊙ (a − Σ_v p(v) a_v),  a = log p − log q̃

the expectation over the sampled token of the γ = 0 advantage form's
gradient at a one-token span. (``q̃`` need not sum to 1 over the student's
vocabulary: several student tokens can spell prefixes of one another.) With
one tokenizer ``q̃ = q`` and ``L̃`` is the exact reverse KL, which the
surrogate then equals. This job draws ``--batches`` OPD rollout batches from
the stage's student exactly as its OPD step does and compares, at every
aligned response position, the surrogate's value and gradient with ``L̃``'s
(:func:`bias_terms`, :func:`batch_figures`): the relative gap of the
position-mean losses, the cosine between the two batch gradients (all
positions' logits as one vector) and the mean per-position cosine.
``--control``: a stage whose teacher has the student's tokenizer, where the
gap is 0 and the cosine 1 up to float error. Writes ``gold_bias.json`` to
``--out``; the stages are only read.
"""
from __future__ import annotations

import json
import pathlib
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd.distill import crosstok
from opd.distill import gold


def bias_terms(z, x, span_logq, student_ids, teacher_ids):
  """Per position: the surrogate and the span-exact loss and their gradients (τ = 1).

  Args:
    z: ``[N, V_s]`` student logits.
    x: ``[N, V_t]`` teacher logits at the same positions (same bytes before).
    span_logq: ``[N, V_s]`` ``log q̃(v)``, the teacher's log-probability of
      each student token's bytes (finite).
    student_ids, teacher_ids: ``[S]`` the shared pairs (``gold.shared_vocab``).

  Returns:
    ``(L_gold [N], G_gold [N, V_s], L_span [N], G_span [N, V_s])``: the
    gradients are w.r.t. ``z``.
  """
  z = jnp.asarray(z, jnp.float32)
  lq = jnp.asarray(span_logq, jnp.float32)
  if lq.shape != z.shape:
    raise ValueError(f"span_logq.shape={lq.shape} must equal the student logits' {z.shape}")
  if not bool(jnp.all(jnp.isfinite(lq))):
    raise ValueError("span_logq must be finite (every student token's bytes scored by the teacher)")
  surrogate = lambda zz: gold.gold_surrogate(zz, x, student_ids, teacher_ids)  # noqa: E731
  l_gold = surrogate(z)
  g_gold = jax.grad(lambda zz: jnp.sum(surrogate(zz)))(z)
  lp = jax.nn.log_softmax(z, axis=-1)
  p = jnp.exp(lp)
  a = lp - lq
  l_span = jnp.sum(p * a, axis=-1)
  g_span = p * (a - l_span[:, None])
  return l_gold, g_gold, l_span, g_span


def batch_figures(l_gold, g_gold, l_span, g_span) -> dict[str, float]:
  """One batch's figures (module docstring): position means of both losses,
  the loss gap ``(L_gold − L_span) / L_span``, the cosine of the batch
  gradients and the mean of the per-position cosines."""
  l_gold, l_span = np.asarray(l_gold, np.float64), np.asarray(l_span, np.float64)
  g_gold, g_span = np.asarray(g_gold, np.float64), np.asarray(g_span, np.float64)
  norms = np.linalg.norm(g_gold, axis=1) * np.linalg.norm(g_span, axis=1)
  per = np.sum(g_gold * g_span, axis=1)[norms > 0] / norms[norms > 0]
  total = np.linalg.norm(g_gold) * np.linalg.norm(g_span)
  return {"positions": int(l_span.size), "loss_gold": float(l_gold.mean()),
          "loss_span": float(l_span.mean()),
          "loss_gap": float((l_gold.mean() - l_span.mean()) / l_span.mean()),
          "cos": float(np.sum(g_gold * g_span) / total) if total > 0 else float("nan"),
          "cos_per_position_mean": float(per.mean()) if per.size else float("nan")}


def summarize(batches: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """Means over batches of each figure, with the SE of the mean (ddof 1) of
  the loss gap and the cosine."""
  out = {k: float(np.mean([b[k] for b in batches])) for k in batches[0]}
  for k in ("loss_gap", "cos"):
    x = np.asarray([b[k] for b in batches])
    out[f"{k}_se"] = float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")
  return out


def _aligned(s_pieces: Sequence[bytes], t_pieces: Sequence[bytes]) -> dict[int, int]:
  """Student token index i -> teacher token index j where both end at the
  same byte offset (the prefix through i is the prefix through j)."""
  s_ends = np.cumsum([len(b) for b in s_pieces])
  t_end = {int(e): j for j, e in enumerate(np.cumsum([len(b) for b in t_pieces]))}
  return {i: t_end[int(e)] for i, e in enumerate(s_ends) if int(e) in t_end}


def _candidates(student_tok, teacher_tok) -> list[list[int]]:
  """Each student token's bytes in teacher ids (``transcode`` of the one token)."""
  return [crosstok.transcode(student_tok, teacher_tok, [v], teacher="teacher",
                             example=f"student token {v}") for v in range(student_tok.vocab_size)]


def span_logq_at(t_cfg, t_params, prefix: Sequence[int], cands: Sequence[Sequence[int]],
                 chunk: int = 256, bucket: int = 64) -> tuple[np.ndarray, np.ndarray]:
  """The teacher after ``prefix``: ``([V_s]`` log-probability of each
  candidate's ids, ``[V_t]`` its next-token logits``)``.

  Rows are right-padded to a multiple of ``bucket`` (causal attention: the
  padding after a row's ids changes none of its log-probs), so that few
  shapes are compiled.
  """
  from opd.models import forward
  width = -(-(len(prefix) + max(len(c) for c in cands)) // bucket) * bucket
  rows = np.zeros((len(cands), width), np.int32)
  for r, c in enumerate(cands):
    rows[r, :len(prefix) + len(c)] = list(prefix) + list(c)
  out, p0, x = np.zeros(len(cands)), len(prefix), None
  for lo in range(0, len(cands), chunk):
    part = rows[lo:lo + chunk]
    part = np.pad(part, ((0, chunk - part.shape[0]), (0, 0)))  # one shape per width
    logits = forward(t_cfg, t_params, jnp.asarray(part)).logits
    if x is None:
      x = np.asarray(logits[0, p0 - 1], np.float32)
    lq = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    for r in range(lo, min(lo + chunk, len(cands))):
      c = cands[r]
      out[r] = sum(lq[r - lo, p0 - 1 + k, c[k]] for k in range(len(c)))
  return out, x


def measure(stage: pathlib.Path, n_batches: int, positions: int, seed: int) -> dict:
  """Rollout batches from the stage's student; the figures at up to
  ``positions`` aligned response positions per batch (drawn uniformly)."""
  from experiments import common
  from opd.models import forward, to_model_config
  from opd.config.migrations import migrate
  from opd.rollout.batches import RolloutConfig, sample_groups, training_arrays
  from opd.rollout.policy import Policy, sampling_for_chat
  from opd.tasks import domain_examples
  from opd.training.checkpoints import load_params

  run = json.loads((stage / "config.json").read_text())
  run = run.get("experiment", run)
  (name, teacher), = run["teachers"].items()
  s_cfg = to_model_config(run["student"]["model"], "student.model")
  t_cfg = to_model_config(teacher["model"], f"teachers.{name}.model")
  # A run recorded in the flat layout reads as today's (opd.config.migrations).
  ro = migrate(run)["opd"]["rollout"]
  temp = float(ro["temperature"])
  if temp != 1.0:
    raise ValueError(f"stage {stage}: rollout temperature {temp}; q̃ is computed at τ = 1 only")
  rollout = RolloutConfig(prompts_per_step=ro["prompts_per_step"], group_size=ro["group_size"],
                          temperature=temp, max_new_tokens=ro["max_new_tokens"],
                          seq_len=ro["seq_len"], length_bucket=ro["length_bucket"])
  s_tok = common.tokenizer_for(s_cfg, stage)
  t_tok = (s_tok if t_cfg.tokenizer == s_cfg.tokenizer else
           common.tokenizer_for(t_cfg, pathlib.Path(teacher["init"]).parent))
  s_params = load_params(run["student"]["init"], s_cfg)
  t_params = load_params(teacher["init"], t_cfg)
  s_ids, t_ids = gold.shared_vocab(s_tok, t_tok)
  cands = _candidates(s_tok, t_tok)
  prompts = domain_examples((teacher["domain"],), "train", run["data"]["num_prompts"], seed,
                            tuple(run["data"]["difficulties"]))
  sampling = sampling_for_chat(s_tok, max_new_tokens=rollout.max_new_tokens, temperature=temp)
  policy = Policy(s_cfg, s_params, s_tok)
  rng, key = np.random.default_rng(seed), jax.random.key(seed)
  batches = []
  for b in range(n_batches):
    picks = rng.choice(len(prompts), rollout.prompts_per_step, replace=False)
    eps = sample_groups(policy, [prompts[i] for i in picks], rollout, key, b, sampling)
    host, _ = training_arrays(eps, seq_len=rollout.seq_len, length_bucket=rollout.length_bucket,
                              pad_id=s_tok.pad_id)
    z_all = np.asarray(forward(s_cfg, s_params, host["tokens"], mask=host["mask"]).logits)
    sites = []  # (row, student position, teacher prefix ids)
    for r in range(host["tokens"].shape[0]):
      n = int(host["mask"][r].sum())
      ids = host["tokens"][r, :n].tolist()
      t_row = crosstok.transcode(s_tok, t_tok, ids, teacher=name, example=f"batch {b} row {r}")
      align = _aligned(crosstok.token_bytes(s_tok, ids), crosstok.token_bytes(t_tok, t_row))
      sites += [(r, i, t_row[:align[i] + 1]) for i in range(n - 1)
                if host["loss_mask"][r, i] > 0 and i in align]
    take = rng.choice(len(sites), min(positions, len(sites)), replace=False)
    z, x, lq = [], [], []
    for k in sorted(take):
      r, i, prefix = sites[k]
      z.append(z_all[r, i])
      lq_i, x_i = span_logq_at(t_cfg, t_params, prefix, cands)
      lq.append(lq_i)
      x.append(x_i)
    terms = bias_terms(np.stack(z), np.stack(x), np.stack(lq), s_ids, t_ids)
    batches.append({**batch_figures(*terms), "aligned_share": len(sites) / max(
        1, int(np.sum(host["loss_mask"] > 0)))})
    print(f"{stage} batch {b}: {json.dumps(batches[-1])}", flush=True)
  return {"stage": str(stage), "student_tokenizer": s_cfg.tokenizer,
          "teacher_tokenizer": t_cfg.tokenizer, "shared_pairs": int(len(s_ids)),
          "summary": summarize(batches), "batches": batches}


def main() -> None:
  from absl import app, flags

  flags.DEFINE_string("stage", None, "an OPD stage whose one teacher has another tokenizer",
                      required=True)
  flags.DEFINE_string("control", None, "an OPD stage whose teacher has the student's tokenizer")
  flags.DEFINE_integer("batches", 4, "rollout batches")
  flags.DEFINE_integer("positions", 16, "aligned response positions scored per batch")
  flags.DEFINE_integer("seed", 0, "prompt draw and sampling seed")
  flags.DEFINE_string("out", "workdirs/gold_bias", "output directory")
  F = flags.FLAGS

  def run(argv):
    del argv
    out = {"cross": measure(pathlib.Path(F.stage), F.batches, F.positions, F.seed)}
    if F.control:
      out["control"] = measure(pathlib.Path(F.control), F.batches, F.positions, F.seed)
    path = pathlib.Path(F.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gold_bias.json").write_text(json.dumps(out, indent=1))
    for k, v in out.items():
      print(k, v["student_tokenizer"], "->", v["teacher_tokenizer"], json.dumps(v["summary"]))

  app.run(run)


if __name__ == "__main__":
  main()
