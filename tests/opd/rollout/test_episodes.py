"""Rollouts: episodes' arrays line up with a full forward pass, and the
multi-turn agent loop feeds tool results back as non-policy tokens."""
import jax
import numpy as np
import pytest

from opd.rollout import episodes as rl
from opd.rollout.agent import rollout_multi_turn
from opd.models import ModelConfig, forward, init_params, token_logprobs
from opd.tasks import get_task
from opd.text.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


def test_batch_logprobs_match_full_forward(params):
  """old_logprobs at loss positions equal a fresh forward over the batch:
  the GRPO ratio starts at exactly 1."""
  examples = (get_task("math").examples("train", 2, seed=0)
              + get_task("instruct").examples("train", 1, seed=0)
              + get_task("agent").examples("train", 1, seed=0))
  sampling = rl.sampling_for_chat(TOK, max_new_tokens=12, temperature=0.8)
  eps = rl.rollout(CFG, params, TOK, examples, jax.random.key(1), sampling)
  assert [e.example.id for e in eps] == [e.id for e in examples]
  for ep in eps:
    assert ep.reward is not None and 0.0 <= ep.reward.reward <= 1.0
    assert len(ep.response_ids) == len(ep.logprobs) == len(ep.policy_mask) >= 1
  batch = rl.batch_episodes(eps, seq_len=96, pad_id=TOK.pad_id)
  logits = forward(CFG, params, batch["tokens"], mask=batch["mask"]).logits
  fresh = np.asarray(token_logprobs(logits, batch["targets"], 0.8))
  where = batch["loss_mask"] > 0
  assert where.sum() == sum(ep.num_policy_tokens for ep in eps)
  np.testing.assert_allclose(fresh[where], batch["old_logprobs"][where], atol=2e-5)
  # Targets at loss positions are exactly the sampled response tokens.
  for b, ep in enumerate(eps):
    np.testing.assert_array_equal(batch["targets"][b][where[b]], ep.response_ids[ep.policy_mask])


def test_agent_loop_with_scripted_policy(monkeypatch):
  """A policy that replays the reference turns gets reward 1; tool replies
  are in the response but masked out of the policy tokens."""
  task = get_task("agent")
  examples = task.examples("train", 3, seed=2, difficulty=2)
  by_prompt = {}
  for ex in examples:
    by_prompt[ex.prompt] = [c for role, c in ex.reference if role == "assistant"]
  calls = []

  def scripted(model_cfg, params, tokenizer, prompts, rng, sampling, **kw):
    calls.append(len(prompts))
    out = []
    for p in prompts:
      text = tokenizer.decode(p)
      prompt = text.split("<|user|>")[1].split("<|end|>")[0]
      turn = text.count("<|assistant|>") - 1
      reply = by_prompt[prompt][turn]
      ids = np.asarray(tokenizer.encode(reply + "<|end|>"), np.int32)
      out.append(rl.Completion(ids, np.full(len(ids), -0.5, np.float32), True, reply))
    return out

  monkeypatch.setattr(rl, "sample", scripted)
  sampling = rl.sampling_for_chat(TOK, max_new_tokens=80)
  eps = rollout_multi_turn(CFG, None, TOK, examples, jax.random.key(0), sampling)
  for ep, ex in zip(eps, examples):
    assert ep.reward.reward == pytest.approx(1.0), ep.reward
    text = TOK.decode(ep.response_ids)
    expected = "".join(
        c + "<|end|>" if role == "assistant" else f"<|tool|><tool_result>{c}</tool_result><|end|><|assistant|>"
        for role, c in ex.reference)
    assert text == expected
    policy_text = TOK.decode(ep.response_ids[ep.policy_mask])
    assert "<tool_result>" not in policy_text and policy_text.count("<|end|>") == len(ep.turns)
    np.testing.assert_array_equal(ep.logprobs[~ep.policy_mask], 0.0)
  # Turns shrink the active set but the sampler batch stays the same size.
  assert len(calls) == max(len(v) for v in by_prompt.values())


def test_batch_episodes_rejects_overlong():
  ex = get_task("math").examples("train", 1)[0]
  ep = rl.Episode(ex, np.arange(10, dtype=np.int32), np.arange(5, dtype=np.int32),
                  np.ones(5, bool), np.zeros(5, np.float32), ["x"], False)
  with pytest.raises(ValueError, match="seq_len=8"):
    rl.batch_episodes([ep], seq_len=8, pad_id=0)


def test_model_vocab_beyond_tokenizer_is_refused(params):
  big = CFG.replace(vocab_size=TOK.vocab_size + 2)
  ex = get_task("math").examples("train", 1)[0]
  with pytest.raises(ValueError, match=f"vocab_size={TOK.vocab_size + 2} exceeds"):
    rl.rollout(big, None, TOK, [ex], 0, rl.sampling_for_chat(TOK, max_new_tokens=4))


def test_identical_responses_are_verified_once(monkeypatch):
  """Duplicates in a group share one verifier call but each is counted."""
  from opd import tasks as tasks_lib
  ex = get_task("code").examples("train", 2, seed=1)
  group = [ex[0]] * 3 + [ex[1]] * 2

  def fake_sample(model_cfg, params, tokenizer, prompts, rng, sampling, **kw):
    texts = [ex[0].reference_text, ex[0].reference_text, "def f(x): return 0", "bad", "bad"]
    return [rl.Completion(np.asarray(TOK.encode(t + "<|end|>"), np.int32),
                          np.zeros(len(TOK.encode(t)) + 1, np.float32), True, t) for t in texts]

  calls = []
  real = tasks_lib.safe_verify_batch
  monkeypatch.setattr(rl, "sample", fake_sample)
  monkeypatch.setattr(tasks_lib, "safe_verify_batch",
                      lambda task, exs, rs, **kw: calls.append(len(rs)) or real(task, exs, rs, **kw))
  stats = tasks_lib.RewardStats()
  eps = rl.rollout(CFG, None, TOK, group, 0, rl.sampling_for_chat(TOK, max_new_tokens=40),
                   stats=stats)
  assert calls == [3]  # (ex0, ref), (ex0, wrong), (ex1, bad)
  assert [e.reward.reward for e in eps[:2]] == [1.0, 1.0] and eps[2].reward.reward < 1.0
  assert eps[3].reward == eps[4].reward and stats.total == 5
