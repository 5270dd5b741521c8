import collections

import numpy as np
import pytest

import grm.judge as judge_lib
import grm.training as training
from grm.data import PreferenceGroup
from grm.format import build_prompt, format_judgement, prompt_ids, shuffle
from grm.parse import parse_judgement
from opd.rl import GRPOConfig
from opd.rl.scoring import score_episodes
from opd.rollout.episodes import Episode
from opd.text.tokenizers import ByteTokenizer
from opd.training.data import BATCH_KEYS

TOK = ByteTokenizer()
END = "<|end|>"


def _groups():
  """Groups of sizes 1..3; the best response of group e is at index e % n."""
  out = []
  for e, n in enumerate((2, 3, 1, 2, 3, 1, 2)):
    if n == 1:
      ratings = (float(1 + e % 10),)
    else:
      ratings = tuple(1.0 if i == e % n else 0.1 * i for i in range(n))
    out.append(PreferenceGroup("math", f"ex{e}", "train", f"q{e}",
                               tuple(f"resp {e}.{i}" for i in range(n)), ratings, ("ok",) * n))
  return out


def _text(outcome, group, order):
  """A judgement text (shown order) that is correct ('c'), wrong ('w') or invalid ('i')."""
  n = group.n
  if outcome == "i":
    return "no scores here"
  if n == 1:
    r = int(group.ratings[0])
    truth = (r if outcome == "c" else r % 10 + 1,)
  else:
    best = int(np.argmax(group.ratings))
    truth = tuple((9 if i == best else 3) if outcome == "c" else (1 if i == best else 5)
                  for i in range(n))
  return format_judgement(["p"], "c", shuffle(truth, order))


# Per group: the N_RFT=4 plain outcomes, then the hinted outcome (used only when none is
# correct). 't' is a correct text cut by the token budget (invalid: truncated).
SCRIPT = ["cccc", "ccww", "wwww", "wiwt", "cwii", "tttt", "cccc"]
HINTED = {2: "c", 3: "w", 5: "c"}


def _fake_sample_fn(groups, calls):
  by_query = {g.query: (e, g) for e, g in enumerate(groups)}

  def sample_fn(pairs, k, seed, hints):
    calls.append((len(pairs), k, seed, hints))
    prompts = judge_lib.build_prompts(pairs, k, seed, hints=hints)
    out = []
    for (query, _), row in zip(pairs, prompts):
      e, g = by_query[query]
      outcomes = HINTED[e] if hints is not None else SCRIPT[e]
      out.append([judge_lib.judge_completion(p, _text("c" if o == "t" else o, g, p.order),
                                             finished=o != "t")
                  for p, o in zip(row, outcomes)])
    return out

  return sample_fn


def test_rft_rejection_counts_match_a_hand_derived_reference():
  groups, calls = _groups(), []
  kept, counts = training.rejective_sample(groups, _fake_sample_fn(groups, calls), n_rft=4,
                                           seed=10)
  # Reference from the script alone.
  ref = collections.Counter()
  ref["groups"], ref["samples"] = len(SCRIPT), 4 * len(SCRIPT)
  for e, s in enumerate(SCRIPT):
    ref["rejected_incorrect"] += 4 - s.count("c")
    ref["rejected_invalid"] += s.count("i") + s.count("t")
    if s == "cccc":
      ref["too_easy_groups"] += 1
      ref["too_easy_samples"] += 4
    elif "c" not in s:
      ref["hinted_groups"] += 1
      ref["hinted_kept" if HINTED[e] == "c" else "hinted_rejected"] += 1
    else:
      ref["kept_sampled"] += s.count("c")
  ref["kept"] = ref["kept_sampled"] + ref["hinted_kept"]
  assert counts == {k: ref[k] for k in training.RFT_COUNTS}
  assert counts["too_easy_groups"] == 2 and counts["hinted_kept"] == 2 and counts["kept"] == 5
  # One batched call for the plain samples, one for the hinted groups (with the true best).
  assert [c[:3] for c in calls] == [(7, 4, 10), (3, 1, 11)]
  assert calls[1][3] == [int(np.argmax(groups[e].ratings)) for e in (2, 3, 5)]
  # Every kept target is correct for its prompt; hinted prompts lose their hint line.
  for prompt, text in kept:
    assert prompt.hint is None and "The best response is" not in prompt.text
    j = parse_judgement(text, prompt.n)
    assert j.valid
  hinted_prompts = [p for p, _ in kept[-2:]]
  for p, e in zip(hinted_prompts, (2, 5)):
    g = groups[e]
    i = (2, 3, 5).index(e)
    assert p.text == build_prompt(g.query, g.responses, seed=(11, i, 0)).text


def test_rule_rl_reward_is_plus_one_only_for_a_correct_finished_judgement():
  groups = _groups()
  examples = training.rl_examples(groups, seed=3)
  episodes, expect = [], []
  for ex, g in zip(examples, groups):
    order = tuple(ex.meta["order"])
    assert ex.prompt == build_prompt(g.query, g.responses, seed=(3, groups.index(g))).text
    for outcome, truncated, sign in (("c", False, 1.0), ("w", False, -1.0), ("i", False, -1.0),
                                     ("c", True, -1.0)):
      episodes.append(Episode(ex, np.zeros(1, np.int32), np.zeros(1, np.int32),
                              np.ones(1, np.float32), np.zeros(1, np.float32),
                              [_text(outcome, g, order)], truncated))
      expect.append(sign)
  reward_fn = training.RuleReward()
  np.testing.assert_array_equal(reward_fn(episodes), expect)
  assert reward_fn.last_reasons["truncated"] == len(groups)
  # The same signs come out of GRPO's scoring path (opd.rl.scoring.score_episodes).
  scores = score_episodes(episodes, reward_fn)
  assert [s.reward for s in scores] == expect
  # A tie at the top is incorrect: -1.
  g, ex = groups[0], examples[0]
  tie = format_judgement(["p"], "c", (6, 6))
  ep = Episode(ex, np.zeros(1, np.int32), np.zeros(1, np.int32), np.ones(1, np.float32),
               np.zeros(1, np.float32), [tie], False)
  assert reward_fn([ep]).tolist() == [-1.0]


def test_rule_rl_kl_is_a_multiple_of_the_policy_configs():
  cfg = GRPOConfig()
  assert training.rule_rl_config(cfg).kl_coef == pytest.approx(2 * cfg.kl_coef)
  assert training.rule_rl_config(cfg, 3.0).kl_coef == pytest.approx(3 * cfg.kl_coef)
  with pytest.raises(ValueError, match="kl_multiplier"):
    training.rule_rl_config(cfg, 0.5)


def test_cold_start_pairs_mask_only_the_judgement():
  groups = _groups()
  pairs = training.cold_start_pairs(groups, seed=0)
  for (prompt, text), g in zip(pairs, groups):
    ids, mask = training.judgement_pair(TOK, prompt, text)
    head = prompt_ids(TOK, prompt)
    np.testing.assert_array_equal(ids[:head.size], head)  # what the sampler is prompted with
    assert not mask[:head.size].any() and mask[head.size:].all()
    assert TOK.decode(ids[mask]) == text + END
  longest = max(training.judgement_pair(TOK, p, t)[0].size for p, t in pairs)
  assert longest < 2048  # nothing is cut, so every judgement must come back whole
  batches = list(training.sft_batches(TOK, _cfg(), pairs, seq_len=2048, batch_size=2, seed=0,
                                      num_epochs=1, drop_remainder=False))
  trained = []
  for b in batches:
    assert set(BATCH_KEYS) <= set(b)
    lm = b["loss_mask"].astype(bool)
    for row in range(lm.shape[0]):
      for seg in np.unique(b["segment_ids"][row][lm[row]]):
        sel = lm[row] & (b["segment_ids"][row] == seg)
        trained.append(TOK.decode(b["targets"][row][sel]))
  assert sorted(trained) == sorted(t + END for _, t in pairs)


def _cfg():
  from opd.models import ModelConfig
  return ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                     d_ff=64)
