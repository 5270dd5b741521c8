"""grm.judge and grm.pairwise: k shuffled samples in one sampler call, scores mapped back."""
import re

import jax
import numpy as np
from hypothesis import given, settings, strategies as st

import grm.judge as judge_lib
import grm.pairwise as pairwise_lib
from grm.format import format_judgement
from grm.meta_rm import meta_batch, meta_input_ids
from grm.voting import vote
from opd.models import ModelConfig, init_params
from opd.rollout import Policy
from opd.rollout.episodes import Completion, sampling_for_chat
from opd.text.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def _fake_sampler(calls):
  """A stand-in for ``opd.rollout.policy.sample`` that judges by reading
  each shown response's hidden score ("resp-<i>-s<score>")."""

  def sample(policy, prompts, rng, sampling, **kwargs):
    calls.append(len(prompts))
    out = []
    for ids in prompts:
      text = policy.tokenizer.decode(ids)
      shown = [int(s) for s in re.findall(r"\[Response \d+\]\nresp-\d+-s(\d+)", text)]
      body = format_judgement(["Correctness."], "Read the scores.", shown)
      out.append(Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True, body))
    return out

  return sample


def test_k_samples_go_through_one_call_and_scores_come_back_in_original_order(monkeypatch):
  calls = []
  monkeypatch.setattr(judge_lib, "sample", _fake_sampler(calls))
  truth = [[3, 9, 5, 1], [8, 2], [6]]
  groups = [(f"q{e}", [f"resp-{i}-s{s}" for i, s in enumerate(t)]) for e, t in enumerate(truth)]
  k = 5
  samples = judge_lib.sample_judgements(Policy(None, None, TOK), groups, k=k, seed=7,
                                        sampling=sampling_for_chat(TOK, max_new_tokens=8))
  assert calls == [len(groups) * k]
  orders = set()
  for e, t in enumerate(truth):
    assert len(samples[e]) == k
    for s in samples[e]:
      assert s.judgement.valid and s.scores == tuple(t)
      orders.add(s.prompt.order)
    scores, valid = judge_lib.score_arrays(samples[e])
    assert valid.all()
    np.testing.assert_array_equal(vote(scores, valid).totals, k * np.asarray(t))
  assert len(orders) > 3  # samples are shuffled differently
  again = judge_lib.build_prompts(groups, k, 7)
  assert [[p.order for p in row] for row in again] == [[s.prompt.order for s in row]
                                                       for row in samples]


def test_tiny_random_grm_samples_end_to_end_and_invalid_outputs_are_counted():
  cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                    d_ff=64)
  params = init_params(cfg, jax.random.key(0))
  groups = [("2+2?", ["4", "5"]), ("Say hi.", ["hi", "bye", "hello"])]
  samples = judge_lib.sample_judgements(Policy(cfg, params, TOK), groups, k=2, seed=0,
                                        sampling=sampling_for_chat(TOK, max_new_tokens=6))
  flat = [s for row in samples for s in row]
  assert [len(row) for row in samples] == [2, 2]
  counts = judge_lib.invalid_sample_counts(flat)
  n_valid = sum(s.judgement.valid for s in flat)
  assert sum(counts.values()) + n_valid == len(flat)
  for row in samples:
    scores, valid = judge_lib.score_arrays(row)
    assert scores.shape == (2, row[0].prompt.n)
    assert vote(scores, valid).num_valid == valid.sum()
  # The meta-RM reads the prompt followed by exactly what the GRM wrote.
  ids = meta_input_ids(TOK, flat[0].prompt, flat[0].text)
  assert TOK.decode(ids).endswith("<|assistant|>" + flat[0].text)
  batch = meta_batch(TOK, [s.prompt for s in flat], [s.text for s in flat], [1, 0, 0, 1],
                     seq_len=1024)
  assert batch["tokens"].shape == (4, 1024) and batch["labels"].tolist() == [1, 0, 0, 1]


@settings(max_examples=300, deadline=None)
@given(st.text() | st.lists(st.sampled_from(["Better:", " ", "A", "B", "\n", "AB", "a", "\t",
                                              "Better: C"]), max_size=12).map("".join))
def test_pairwise_parser_never_raises(text):
  j = pairwise_lib.parse_pairwise(text)
  assert (j.choice is None) == (j.reason is not None)
  if j.valid:
    last = text.rstrip().split("\n")[-1]
    assert re.sub(r"[ \t]", "", last.strip()) == "Better:" + j.choice
  else:
    assert j.reason in pairwise_lib.PAIRWISE_REASONS


def test_pairwise_round_trip_reasons_and_swap_mapping(monkeypatch):
  for choice in "AB":
    assert pairwise_lib.parse_pairwise(pairwise_lib.format_pairwise("why\nnot", choice)).choice \
        == choice
  reasons = [pairwise_lib.parse_pairwise(t).reason for t in
             [None, "  ", "Better: A\nmore", "Better: C", "Better: A B"]]
  assert reasons == ["not_text", "empty", "no_choice_line", "malformed_choice",
                     "malformed_choice"]
  swaps = [pairwise_lib.build_pairwise_prompt("q", "first", "second", seed=(1, e)).swapped
           for e in range(200)]
  assert 60 < sum(swaps) < 140  # a fair coin: 100 ± 5 SE of 200 flips is 100 ± 35

  # A judge that always prefers the response "good" must map back to its
  # original index whichever side it was shown on.
  def sample(policy, prompts, rng, sampling, **kwargs):
    out = []
    for ids in prompts:
      text = policy.tokenizer.decode(ids)
      a = re.search(r"\[Response A\]\n(\w+)", text).group(1)
      body = pairwise_lib.format_pairwise("", "A" if a == "good" else "B")
      out.append(Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True, body))
    return out

  monkeypatch.setattr(judge_lib, "sample", sample)
  pairs = [("q", "good", "bad") if e % 3 else ("q", "bad", "good") for e in range(30)]
  for batch_size in (None, 8):  # one call, or chunks of 8 (the last padded)
    preferred, judgements = pairwise_lib.judge_pairs(
        Policy(None, None, TOK), pairs, seed=3, chunking=judge_lib.Chunking(batch_size),
        sampling=sampling_for_chat(TOK, max_new_tokens=4))
    assert all(j.valid for j in judgements)
    np.testing.assert_array_equal(preferred, [0 if e % 3 else 1 for e in range(30)])
  assert pairwise_lib.preferred_index(pairwise_lib.parse_pairwise("x"), False) == -1


def test_a_truncated_sample_is_invalid_even_when_it_ends_on_a_valid_scores_line(monkeypatch):
  text = format_judgement(["Correctness."], "Fine.", [7, 2])

  def sample(policy, prompts, rng, sampling, **kwargs):
    return [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), finished, text)
            for finished, _ in zip((True, False, True), prompts)]

  monkeypatch.setattr(judge_lib, "sample", sample)
  samples = judge_lib.sample_judgements(Policy(None, None, TOK), [("q", ["a", "b"])], k=3, seed=0,
                                        sampling=sampling_for_chat(TOK, max_new_tokens=8))[0]
  assert [s.judgement.valid for s in samples] == [True, False, True]
  assert samples[1].judgement.reason == "truncated" and samples[1].scores is None
  assert samples[0].judgement.scores == (7, 2)  # the same text, finished, parses
  _, valid = judge_lib.score_arrays(samples)
  assert valid.tolist() == [True, False, True]
  counts = judge_lib.invalid_sample_counts(samples)
  assert counts["truncated"] == 1 and sum(counts.values()) == 1
  assert set(counts) == set(judge_lib.REASONS) and "truncated" in judge_lib.REASONS


def _echo_sampler(calls):
  """Records each call's (rows, batch_size, prompt width) and returns each prompt's own text,
  so a completion can be checked against the prompt it belongs to."""

  def sample(policy, prompts, rng, sampling, *, batch_size=None,
             prompt_bucket=32, **kwargs):
    longest = max(len(p) for p in prompts)
    calls.append((len(prompts), batch_size, prompt_bucket * -(-longest // prompt_bucket)))
    return [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), True,
                       policy.tokenizer.decode(p)) for p in prompts]

  return sample


def test_sample_rows_chunks_keep_the_order_and_fix_the_prompt_width(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(judge_lib, "sample", _echo_sampler(calls))
  rng = np.random.default_rng(0)
  texts = ["x" * int(n) for n in rng.integers(1, 300, size=23)]
  prompts = [np.asarray(TOK.encode(t), np.int32) for t in texts]
  sampling = sampling_for_chat(TOK, max_new_tokens=4)
  longest = max(len(p) for p in prompts)
  # Unchunked: one call with every row.
  fake = Policy(None, None, TOK)
  out = judge_lib.sample_rows(fake, prompts, 0, sampling)
  assert [c.text for c in out] == texts and calls == [(23, None, 32 * -(-longest // 32))]
  # Chunks of 8: ceil(23 / 8) = 3 calls of batch_size 8, one width (the longest, bucketed).
  calls.clear()
  out = judge_lib.sample_rows(fake, prompts, 0, sampling, chunking=judge_lib.Chunking(8))
  assert [c.text for c in out] == texts
  assert calls == [(8, 8, 32 * -(-longest // 32))] * 2 + [(7, 8, 32 * -(-longest // 32))]
  # Length buckets of 100: rows sorted by length, each chunk padded to its own longest
  # rounded up to a multiple of 100; the completions still come back in the given order.
  calls.clear()
  out = judge_lib.sample_rows(fake, prompts, 0, sampling,
                              chunking=judge_lib.Chunking(8, length_bucket=100))
  assert [c.text for c in out] == texts
  ranked = sorted(len(p) for p in prompts)
  expected = [100 * -(-max(ranked[c:c + 8]) // 100) for c in range(0, 23, 8)]
  assert [w for _, _, w in calls] == expected and [b for _, b, _ in calls] == [8, 8, 8]
  # A progress label draws a bar over the chunks (stderr) and changes nothing else.
  calls.clear()
  out = judge_lib.sample_rows(fake, prompts, 0, sampling,
                              chunking=judge_lib.Chunking(8, length_bucket=100),
                              progress="judging")
  assert [c.text for c in out] == texts
  assert [w for _, _, w in calls] == expected
  bar = capsys.readouterr().err
  assert "judging" in bar and "3/3" in bar, bar


def test_sample_rows_chunks_give_each_prompt_its_own_completion_on_a_tiny_model():
  cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                    d_ff=64)
  params = init_params(cfg, jax.random.key(1))
  # Every call is [2 rows, 32 columns] (one compile): the chunked run's rows equal
  # those of direct calls on each pair, so chunking pairs each prompt with its own output.
  prompts = [np.asarray(TOK.encode(t, add_bos=True), np.int32)
             for t in ("2+2?", "Name a colour, please.", "Hi.", "Count to three")]
  greedy = sampling_for_chat(TOK, max_new_tokens=3, temperature=0.0)
  direct = [c for pair in (prompts[:2], prompts[2:])
            for c in judge_lib.sample_rows(Policy(cfg, params, TOK), pair, 0, greedy,
                                           chunking=judge_lib.Chunking(2))]
  chunked = judge_lib.sample_rows(Policy(cfg, params, TOK), prompts, 0, greedy,
                                  chunking=judge_lib.Chunking(2))
  assert [c.ids.tolist() for c in chunked] == [c.ids.tolist() for c in direct]
  assert len({tuple(c.ids.tolist()) for c in direct}) > 1  # the rows differ, so order matters
