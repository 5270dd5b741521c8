"""Job ``grm_reward``: writing GRPO under the GRM, the BT RM and the hidden rubric (docs/DESIGN.md §6).

For each reward in ``config.rewards`` the policy starts from the same params
and trains with ``opd.rl.train_grpo`` (``grm``: ``grm.reward.GRMReward``;
``bt``: ``grm.reward.BTReward``; ``rubric``: the writing verifier, i.e. no
``reward_fn``). Each trained policy's greedy answers to ``config.data.num_test``
test prompts are scored with the hidden rubric and with the GRM and the BT
RM, as are the starting policy's (``init``); so are ``config.eval.num_samples``
sampled answers per test prompt at the GRPO temperature by the rubric (GRPO at
this size moves the sampled answers more than the greedy one). Final metrics,
all on the rewards' 0-1 scale: ``rubric/<policy>`` (test rubric score of the
policy trained on that reward, or ``init``), ``rubric_mean@<n>/<policy>`` (the
rubric's mean over the n samples), ``score_grm/<policy>`` and
``score_bt/<policy>`` (its greedy test scores under the two learned rewards),
each with ``<score>_se/<policy>`` (bootstrap SE over test prompts) and, for
the trained policies, ``<score>_gain/<policy>`` and ``<score>_gain_se/<policy>``
(minus the initial policy's, paired over test prompts);
``train_reward_first/<reward>`` and ``train_reward/<reward>`` (the first and
last step's mean training reward) and, for the GRM-trained run, the GRM's
sample counts (``grm/samples``, ``grm/invalid_samples``, ...). A learned
reward the policy games shows as a rise in its own score without one in the
rubric's. Per reward, ``<workdir>/<reward>/`` keeps the GRPO run (metrics,
``checkpoints/``, resumed when stopped), ``train.json`` (its training
figures) and ``scores.json`` (the test scores of its final checkpoint, with
the per-prompt values); each is reused on a rerun, as is ``init_scores.json``.
"""
from __future__ import annotations

import pathlib

import jax
import numpy as np

from experiments import common
from grm.reward import BTReward, GRMReward
from opd import rollout as rollout_lib
from opd.config.fields import from_group
from opd.models import init_params, to_model_config
from opd.eval import stats as stats_lib
from opd.rl import grpo as grpo_lib
from opd.rl.config import GRPOConfig
from opd.rollout.episodes import sampling_for_chat
from opd.training.checkpoints import load_params
from opd.tasks import domain_examples
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.metrics_writer import read_metrics

REWARDS = ("grm", "bt", "rubric")
BOOTSTRAP = 1000  # resamples of the test prompts for every SE


def _models(config, model_cfg, mesh, rules):
  """``(policy, grm, (bt_cfg, bt))`` params: random tiny ones or the checkpoints."""
  bt_cfg = model_cfg.replace(scalar_head=True)
  if config.tiny_models:
    keys = jax.random.split(jax.random.key(config.seed), 3)
    return (init_params(model_cfg, keys[0]), init_params(model_cfg, keys[1]),
            (bt_cfg, init_params(bt_cfg, keys[2])))
  for name in ("init", "grm_init", "bt_init"):
    if not config.get(name):
      raise ValueError(f"config.{name} must name a checkpoint directory (or set "
                       "config.tiny_models=True)")
  return (load_params(config.init, model_cfg, mesh=mesh, rules=rules),
          load_params(config.grm_init, model_cfg, mesh=mesh, rules=rules),
          (bt_cfg, load_params(config.bt_init, bt_cfg, mesh=mesh, rules=rules)))


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  bad = [r for r in config.rewards if r not in REWARDS]
  if bad or not config.rewards:
    raise ValueError(f"config.rewards={tuple(config.rewards)} must be a non-empty subset of "
                     f"{REWARDS}")
  model_cfg = to_model_config(config.model)
  tok = common.tokenizer_for(model_cfg, workdir)
  mesh, rules = common.mesh_and_rules(config)
  policy, grm_params, (bt_cfg, bt_params) = _models(config, model_cfg, mesh, rules)
  cfg = from_group(GRPOConfig, config.grpo, "config.grpo")
  diffs = tuple(config.data.difficulties)
  prompts = domain_examples(("writing",), "train", config.data.num_prompts, config.seed, diffs)
  test = domain_examples(("writing",), "test", config.data.num_test, config.seed + 1, diffs)
  g = config.grm
  reward_fns = {
      "grm": lambda: GRMReward(model_cfg, grm_params, tok, k=g.k, fallback=g.fallback,
                               seed=config.seed, batch_size=g.batch_size, mesh=mesh,
                               rules=rules, constrained=g.get("constrained", False),
                               sampling=sampling_for_chat(
                                   tok, max_new_tokens=g.max_new_tokens,
                                   temperature=g.temperature)),
      "bt": lambda: BTReward(bt_cfg, bt_params, tok, seq_len=config.bt.seq_len,
                             batch_size=config.bt.batch_size),
      "rubric": lambda: None}
  greedy = sampling_for_chat(tok, max_new_tokens=cfg.max_new_tokens, temperature=0.0)
  n_samples = int(config.eval.num_samples)
  if n_samples < 1:
    raise ValueError(f"config.eval.num_samples={n_samples} must be >= 1")
  sampled = sampling_for_chat(tok, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_k=cfg.top_k, top_p=cfg.top_p)
  # Every policy's greedy test answers are scored by all three rewards, so a
  # learned reward the policy games shows: its own score rises, the rubric's not.
  judges = {"grm": reward_fns["grm"](), "bt": reward_fns["bt"]()}

  def test_scores(params) -> dict:
    """Means, bootstrap SEs (``<key>_se``, 0-1 scale) and the per-test-prompt
    values (``per_example``) of the greedy and sampled scores."""
    policy = rollout_lib.Policy(model_cfg, params, tok, mesh, rules)
    episodes = rollout_lib.rollout(policy, test, jax.random.key(config.seed), greedy)
    many = rollout_lib.rollout(policy, list(test) * n_samples, jax.random.key(config.seed + 1),
                               sampled)
    # list(test) * n: sample j of prompt i is row j * len(test) + i.
    per = {"rubric": [ep.reward.reward for ep in episodes],
           f"rubric_mean@{n_samples}": np.asarray(
               [ep.reward.reward for ep in many]).reshape(n_samples, len(test)).T.tolist()}
    for judge, fn in judges.items():
      per[f"score_{judge}"] = [r.reward for r in fn(episodes)]
    out = {}
    for key, values in per.items():
      out[key] = float(np.mean(values))
      out[f"{key}_se"] = stats_lib.bootstrap_se(values, BOOTSTRAP, config.seed)
    out["per_example"] = per
    return out

  def gains(scores: dict, name: str) -> dict:
    """Each score of policy ``name`` minus the initial policy's, paired over the
    test prompts (bootstrap SE of the per-prompt differences)."""
    res = {}
    for key, values in scores["per_example"].items():
      res[f"{key}_gain/{name}"], res[f"{key}_gain_se/{name}"] = stats_lib.paired_difference(
          values, init["per_example"][key], BOOTSTRAP, config.seed)
    return res

  root = pathlib.Path(workdir)
  out = {"steps": config.train.steps}
  init = common.cached_json(root / "init_scores.json", lambda: test_scores(policy))
  out.update({f"{k}/init": v for k, v in init.items() if k != "per_example"})
  for name in config.rewards:
    arm = root / name

    def train(name=name, arm=arm):
      reward_fn = reward_fns[name]()
      grpo_lib.train_grpo(
          model_cfg, policy, policy if cfg.kl_coef > 0 else None, prompts, cfg,
          common.optim_config(config.optim),
          LoopConfig(config.train.steps, save_every=int(config.train.save_every),
                     keep_checkpoints=1),
          RunIO(workdir=arm, checkpoint_dir=arm / "checkpoints",
                config={"reward": name, "init": config.get("init"),
                        "optim": config.optim.to_dict()}),
          runtime=Runtime(mesh, rules, seed=config.seed, tokenizer=tok),
          extras=grpo_lib.GRPOExtras(reward_fn=reward_fn))
      # From metrics.jsonl, not the returned history: a resumed run's history
      # holds only the steps it ran.
      rewards = [m["reward/mean"] for m in read_metrics(arm) if "reward/mean" in m]
      res = {f"train_reward/{name}": float(rewards[-1]),
             f"train_reward_first/{name}": float(rewards[0])}
      if isinstance(reward_fn, GRMReward):  # this process's samples (all, unless resumed)
        res.update({f"grm/{k}": v for k, v in reward_fn.totals.items()})
      return res

    out.update(common.cached_json(arm / "train.json", train))
    scores = common.cached_json(arm / "scores.json", lambda arm=arm: test_scores(
        load_params(str(arm / "checkpoints"), model_cfg, mesh=mesh, rules=rules)))
    out.update({f"{k}/{name}": v for k, v in scores.items() if k != "per_example"})
    out.update(gains(scores, name))
  out["wall_s"] = timer.seconds
  common.write_json(root / "rubric_scores.json",
                    {k: v for k, v in out.items() if k.startswith("rubric")})
  return out
