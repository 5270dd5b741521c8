r"""Each OPD estimator's own noise, measured on the same rollouts (issue #26, item 5).

  python -m experiments.estimator_noise \
      --stage=workdirs/v4_strong/positive_control/code/opd --batches=32 --top_ks=10,32

The loss-fluctuation measure of the estimator ablation (``opd.eval.claims.
domain_fluctuation``, step-to-step noise of the training loss) sees two
things at once: the estimator's own noise and the batch-to-batch variation
of the rollouts themselves (which prompts were drawn, what the student
sampled). With ~300 response tokens a batch the second one dominates, so
every arm shows about the same fluctuation (docs/RESULTS.md, "Estimator
ablation in the strong world"). This job removes it: it draws ``--batches``
rollout batches from a student exactly as an OPD step does (the stage's
prompts per step, group size, temperature, response length) and evaluates
**every estimator on the same batch** against the exact full-vocabulary
reverse KL. Per response token ``t`` with student logits ``z_t``, teacher
logits ``x_t`` and the sampled token ``y_t`` (temperature 1, one teacher)::

  full    L_t = KL(p_t ‖ q_t)              ∇_z = p ⊙ (log p − log q − L_t)
  top_k   the same on the teacher's top-k tokens, both sides renormalised
          (zero gradient outside the k tokens)
  token   a_t = log p(y_t) − log q(y_t)    ∇_z = a_t (onehot(y_t) − p)
          (the policy-gradient surrogate with a_t as a stop-gradient
          advantage; its expectation over y_t is the full gradient)

Per batch (token mean, as ``aggregation="token_mean"``): the loss of each
estimator and its gradient with respect to all the batch's student logits,
compared with the full estimator's on that batch: the cosine between the
two gradients, their relative error ``‖G_est − G_full‖ / ‖G_full‖``, the
loss's relative gap ``(L_est − L_full) / L_full``. Over batches: each
estimator's batch-to-batch fluctuation ``std(L_b) / mean(L_b)`` (what the
training-loss measure sees) and the share of it that is the estimator's own
(``std(L_est − L_full) / mean(L_full)``). The student is the stage's
``student.init`` (the cold start) and, with ``--also_final``, the stage's
last checkpoint (the trained student, nearer its teacher). Writes
``estimator_noise.json`` to ``--out`` (default ``workdirs/estimator_noise``);
the stage directory is only read.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference

ESTIMATORS = ("full", "top_k", "token")


def _log_softmax(a):
  return jax.nn.log_softmax(a.astype(jnp.float32), axis=-1)


def estimator_terms(z, x, y, estimator: str, top_k: int = 8):
  """Per-token loss ``[N]`` and its gradient w.r.t. the student logits ``[N, V]``.

  Args:
    z: ``[N, V]`` student logits at the response tokens.
    x: ``[N, V]`` teacher logits at the same tokens.
    y: ``[N]`` the sampled tokens.
    estimator: ``"full"``, ``"top_k"`` or ``"token"`` (module docstring).
    top_k: k of ``top_k``.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator={estimator!r} must be one of {ESTIMATORS}")
  z, x = z.astype(jnp.float32), x.astype(jnp.float32)
  if estimator == "token":
    lp, lq = _log_softmax(z), _log_softmax(x)
    pick = lambda a: jnp.take_along_axis(a, y[:, None], axis=1)[:, 0]
    adv = pick(lp) - pick(lq)
    onehot = jax.nn.one_hot(y, z.shape[-1], dtype=jnp.float32)
    return adv, adv[:, None] * (onehot - jnp.exp(lp))
  if estimator == "top_k" and not 1 <= top_k <= z.shape[-1]:
    raise ValueError(f"top_k={top_k} must be in [1, V={z.shape[-1]}]")
  # The kernels' materialised references over logits (hidden = logits, head = I);
  # each row's loss depends on its own logits only, so the gradient of the sum
  # is every token's own gradient.
  eye, w_hat = jnp.eye(z.shape[-1], dtype=jnp.float32), jnp.ones((z.shape[0], 1), jnp.float32)
  if estimator == "full":
    per_token = lambda zz: reference.reverse_kl_reference(zz, eye, [x], [eye], w_hat, None, 1.0)[0]
  else:
    per_token = lambda zz: reference.topk_kl_reference(zz, eye, [x], [eye], w_hat, top_k, 1.0)
  loss, vjp = jax.vjp(per_token, z)
  return loss, vjp(jnp.ones_like(loss))[0]


def batch_comparison(z, x, y, *, top_ks: Sequence[int]) -> dict[str, dict[str, float]]:
  """One batch: each estimator's token-mean loss and its gradient against full's.

  Estimators: ``full``, ``top_<k>`` for each k of ``top_ks``, ``token``. The
  batch gradient is ``G = (1/N) Σ_t ∇_z L_t`` laid out over all N tokens'
  logits (each token's logits are their own coordinates).
  """
  n = z.shape[0]
  lf, gf = estimator_terms(z, x, y, "full")
  Lf, Gf = float(jnp.mean(lf)), gf / n
  out = {}
  arms = [("full", "full", 0)] + [(f"top_{k}", "top_k", k) for k in top_ks] + [
      ("token", "token", 0)]
  for name, estimator, k in arms:
    le, ge = (lf, gf) if name == "full" else estimator_terms(z, x, y, estimator, k or 1)
    Ge = ge / n
    nf, ne = float(jnp.linalg.norm(Gf)), float(jnp.linalg.norm(Ge))
    out[name] = {"loss": float(jnp.mean(le)),
                 "cos": float(jnp.vdot(Ge, Gf)) / (ne * nf) if ne * nf > 0 else float("nan"),
                 "rel_err": float(jnp.linalg.norm(Ge - Gf)) / nf if nf > 0 else float("nan"),
                 "loss_gap": (float(jnp.mean(le)) - Lf) / Lf if Lf else float("nan")}
  return out


def summarize(batches: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
  """Over batches: means of the per-batch figures, the loss's batch-to-batch
  fluctuation ``100·std(L_b)/mean(L_b)`` and the estimator's own share
  ``100·std(L_est,b − L_full,b)/mean(L_full,b)`` (std with ddof 1)."""
  if len(batches) < 2:
    raise ValueError(f"summarize needs >= 2 batches, got {len(batches)}")
  full = np.asarray([b["full"]["loss"] for b in batches])
  out = {}
  for name in batches[0]:
    loss = np.asarray([b[name]["loss"] for b in batches])
    out[name] = {
        "batches": len(batches),
        "loss_mean": float(loss.mean()),
        "fluctuation_pct": float(100 * loss.std(ddof=1) / abs(loss.mean())),
        "own_noise_pct": float(100 * (loss - full).std(ddof=1) / abs(full.mean())),
        "loss_gap_pct": float(100 * (loss.mean() - full.mean()) / full.mean()),
        "cos_mean": float(np.mean([b[name]["cos"] for b in batches])),
        "cos_min": float(np.min([b[name]["cos"] for b in batches])),
        "rel_err_mean": float(np.mean([b[name]["rel_err"] for b in batches])),
    }
  return out


def _measure(stage: pathlib.Path, init: str, n_batches: int, top_ks: Sequence[int],
             seed: int) -> dict:
  """Samples ``n_batches`` OPD rollout batches from ``init`` and compares the estimators."""
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
  if s_cfg.vocab_size != t_cfg.vocab_size:
    raise ValueError(f"student V={s_cfg.vocab_size} != teacher {name!r} V={t_cfg.vocab_size}")
  # A run recorded in the flat layout reads as today's (opd.config.migrations).
  ro = migrate(run)["opd"]["rollout"]
  rollout = RolloutConfig(prompts_per_step=ro["prompts_per_step"], group_size=ro["group_size"],
                          temperature=ro["temperature"], max_new_tokens=ro["max_new_tokens"],
                          seq_len=ro["seq_len"], length_bucket=ro["length_bucket"])
  tok = common.tokenizer_for(s_cfg, stage)
  s_params = load_params(init, s_cfg)
  t_params = load_params(teacher["init"], t_cfg)
  prompts = domain_examples((teacher["domain"],), "train", run["data"]["num_prompts"], seed,
                            tuple(run["data"]["difficulties"]))
  sampling = sampling_for_chat(tok, max_new_tokens=rollout.max_new_tokens,
                               temperature=rollout.temperature)
  policy = Policy(s_cfg, s_params, tok)
  rng, key = np.random.default_rng(seed), jax.random.key(seed)
  batches, tokens = [], 0
  for b in range(n_batches):
    picks = rng.choice(len(prompts), rollout.prompts_per_step, replace=False)
    eps = sample_groups(policy, [prompts[i] for i in picks], rollout, key, b, sampling)
    host, _ = training_arrays(eps, seq_len=rollout.seq_len, length_bucket=rollout.length_bucket,
                              pad_id=tok.pad_id)
    keep = host["loss_mask"] > 0
    zs = np.asarray(forward(s_cfg, s_params, host["tokens"], mask=host["mask"]).logits)[keep]
    xs = np.asarray(forward(t_cfg, t_params, host["tokens"], mask=host["mask"]).logits)[keep]
    batches.append(batch_comparison(jnp.asarray(zs), jnp.asarray(xs),
                                    jnp.asarray(host["targets"][keep]), top_ks=top_ks))
    tokens += int(keep.sum())
  return {"init": str(init), "tokens_per_batch": tokens / n_batches,
          "summary": summarize(batches), "batches": batches}


def main() -> None:
  from absl import app, flags

  flags.DEFINE_string("stage", None, "an OPD stage directory (its config.json names the "
                      "student init, the one teacher and the rollout shape)", required=True)
  flags.DEFINE_integer("batches", 32, "rollout batches per student")
  flags.DEFINE_list("top_ks", ["10", "32"], "k of each top-k estimator")
  flags.DEFINE_integer("seed", 0, "prompt draw and sampling seed")
  flags.DEFINE_bool("also_final", True, "also measure the stage's last checkpoint")
  flags.DEFINE_string("out", "workdirs/estimator_noise", "output directory")
  F = flags.FLAGS

  def run(argv):
    del argv
    from opd.training.checkpoints import CheckpointManager
    stage = pathlib.Path(F.stage)
    cfg = json.loads((stage / "config.json").read_text())
    cfg = cfg.get("experiment", cfg)
    inits = {"cold_start": cfg["student"]["init"]}
    if F.also_final:
      step = CheckpointManager(stage / "checkpoints").latest_step()
      if step is None:
        raise ValueError(f"--also_final: {stage / 'checkpoints'} holds no checkpoint")
      inits[f"step_{step}"] = str(stage / "checkpoints")
    top_ks = [int(k) for k in F.top_ks]
    result = {"stage": str(stage), "top_ks": top_ks, "seed": F.seed,
              "students": {k: _measure(stage, v, F.batches, top_ks, F.seed)
                           for k, v in inits.items()}}
    out = pathlib.Path(F.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimator_noise.json").write_text(json.dumps(result, indent=1))
    for who, r in result["students"].items():
      print(f"\n{who} ({r['tokens_per_batch']:.0f} response tokens a batch, "
            f"{F.batches} batches)")
      print("| estimator | loss | fluctuation % | own noise % | loss gap % | cos(G, G_full) "
            "(min) | rel. error |")
      print("|---|---:|---:|---:|---:|---:|---:|")
      for name, s in r["summary"].items():
        print(f"| {name} | {s['loss_mean']:.4f} | {s['fluctuation_pct']:.1f} | "
              f"{s['own_noise_pct']:.1f} | {s['loss_gap_pct']:+.1f} | {s['cos_mean']:.3f} "
              f"({s['cos_min']:.3f}) | {s['rel_err_mean']:.2f} |")

  app.run(run)


if __name__ == "__main__":
  main()
