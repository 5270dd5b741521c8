"""A GRM from a real checkpoint layout: a tiny random Qwen3 saved by
``transformers`` (safetensors + config.json) with a real ``tokenizer.json``
(a tiny BPE trained here; no downloads), run end to end: format -> sample ->
parse -> vote, and as a GRPO reward. A random model writes invalid
judgements; the point is that nothing crashes and every sample is counted."""
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import grm.judge as judge_lib
from grm.format import build_prompt, format_judgement
from grm.reward import GRMReward
from grm.voting import vote
from opd.models.hf import load_hf
from opd.rollout import Policy
from opd.rollout.episodes import sampling_for_chat
from opd.tasks import Example
from opd.text.tokenizers import SPECIAL_TOKENS, HFTokenizer, check_vocab

GROUPS = [("What is 2+3?", ["5", "It is 6."]), ("Write a short greeting.", ["hello there"])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3_grm")
  corpus = [build_prompt(q, r).text for q, r in GROUPS] + [
      format_judgement(["Be correct."], "Response 1 is right.", [9, 2])]
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=400, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  bpe.save(str(path / "tokenizer.json"))
  config = transformers.Qwen3Config(
      vocab_size=bpe.get_vocab_size(with_added_tokens=True), hidden_size=32,
      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, tie_word_embeddings=False)
  torch.manual_seed(0)
  transformers.Qwen3ForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
  return path


def test_qwen3_checkpoint_judges_votes_and_rewards_end_to_end(checkpoint):
  cfg, params = load_hf(str(checkpoint))
  tok = HFTokenizer(str(checkpoint))
  check_vocab(tok, cfg)
  assert cfg.qk_norm  # it really is a Qwen3 layout
  sampling = sampling_for_chat(tok, max_new_tokens=12, temperature=1.0)
  k = 3
  samples = judge_lib.sample_judgements(Policy(cfg, params, tok), GROUPS, k=k, seed=0,
                                        sampling=sampling)
  flat = [s for row in samples for s in row]
  assert [len(row) for row in samples] == [k, k]
  counts = judge_lib.invalid_sample_counts(flat)
  n_valid = sum(s.judgement.valid for s in flat)
  assert sum(counts.values()) + n_valid == len(flat)
  for s in flat:
    assert s.judgement.valid == (s.scores is not None)
    # A sample cut at its 12-token budget is invalid as "truncated".
    assert s.finished or s.judgement.reason == judge_lib.TRUNCATED
  for (_, responses), row in zip(GROUPS, samples):
    scores, valid = judge_lib.score_arrays(row)
    assert scores.shape == (k, len(responses))
    result = vote(scores, valid)
    assert result.num_valid + result.num_invalid == k
    np.testing.assert_array_equal(result.totals, scores[valid].sum(axis=0))
  # The same checkpoint as a GRPO reward: every episode gets a reward in
  # [0, 1], and the fallback count matches the episodes with no valid sample.
  reward = GRMReward(cfg, params, tok, sampling=sampling, k=2, fallback=0.5)

  class Ep:
    def __init__(self, q, a):
      self.example = Example("writing", q, "train", 1, q, (("assistant", a),), {})
      self.turns = [a]

  eps = [Ep(q, r[0]) for q, r in GROUPS]
  out = reward(eps)
  assert len(out) == len(eps) and all(0.0 <= r.reward <= 1.0 for r in out)
  n_fallback = sum(r.reason.startswith("grm_invalid") for r in out)
  assert reward.last_metrics["fallback_episodes"] == n_fallback
  assert reward.last_metrics["samples"] == 2 * len(eps)
  print("invalid counts:", counts, "reward metrics:", reward.last_metrics)
