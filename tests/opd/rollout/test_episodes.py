"""Rollouts: episodes' arrays line up with a full forward pass; chunked mode
keeps every sampler call at batch_size rows with the documented keys;
identical responses are verified once, across calls with a cache."""
import jax
import numpy as np
import pytest

from opd import rollout as rl
from opd.rollout import policy as policy_lib
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
  eps = rl.rollout(rl.Policy(CFG, params, TOK), examples, jax.random.key(1), sampling)
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
    rl.rollout(rl.Policy(big, None, TOK), [ex], 0, rl.sampling_for_chat(TOK, max_new_tokens=4))


def test_identical_responses_are_verified_once(monkeypatch):
  """Duplicates in a group share one verifier call but each is counted."""
  from opd import tasks as tasks_lib
  ex = get_task("code").examples("train", 2, seed=1)
  group = [ex[0]] * 3 + [ex[1]] * 2

  def fake_sample(policy, prompts, rng, sampling, **kw):
    texts = [ex[0].reference_text, ex[0].reference_text, "def f(x): return 0", "bad", "bad"]
    return [rl.Completion(np.asarray(TOK.encode(t + "<|end|>"), np.int32),
                          np.zeros(len(TOK.encode(t)) + 1, np.float32), True, t) for t in texts]

  calls = []
  real = tasks_lib.safe_verify_batch
  monkeypatch.setattr(policy_lib, "sample", fake_sample)
  monkeypatch.setattr(tasks_lib, "safe_verify_batch",
                      lambda task, exs, rs, **kw: calls.append(len(rs)) or real(task, exs, rs, **kw))
  stats = tasks_lib.RewardStats()
  eps = rl.rollout(rl.Policy(CFG, None, TOK), group, 0,
                   rl.sampling_for_chat(TOK, max_new_tokens=40),
                   log=rl.RolloutLog(stats=stats))
  assert calls == [3]  # (ex0, ref), (ex0, wrong), (ex1, bad)
  assert [e.reward.reward for e in eps[:2]] == [1.0, 1.0] and eps[2].reward.reward < 1.0
  assert eps[3].reward == eps[4].reward and stats.total == 5


def _reference_sampler(calls):
  """A fake ``rl.sample`` answering every prompt with the reference's next
  assistant turn; records (n prompts, batch_size, prompt_bucket, key data)."""
  def fake(policy, prompts, rng, sampling, **kw):
    calls.append((len(prompts), kw["batch_size"], kw["prompt_bucket"],
                  np.asarray(jax.random.key_data(rng)).tolist()))
    out = []
    for p in prompts:
      text = policy.tokenizer.decode(p)
      turn = text.count("<|assistant|>") - 1
      ex = BY_PROMPT[text.split("<|user|>")[1].split("<|end|>")[0]]
      reply = [c for role, c in ex.reference if role == "assistant"][turn]
      ids = np.asarray(policy.tokenizer.encode(reply + "<|end|>"), np.int32)
      out.append(rl.Completion(ids, np.zeros(len(ids), np.float32), True, reply))
    return out
  return fake


SINGLE = get_task("math").examples("test", 4, seed=5) + get_task("instruct").examples("test", 3)
AGENT = get_task("agent").examples("test", 3, seed=5)
BY_PROMPT = {ex.prompt: ex for ex in SINGLE + AGENT}


def test_chunked_rollout_fixed_rows_keys_and_padding(monkeypatch):
  """7 single-turn + 3 agent examples, batch_size 4: single-turn chunks of
  4 then 3 rows at one padded length, then one agent chunk padded to 4
  episodes; chunk c samples with fold_in(rng, c); padding never comes back."""
  from opd import tasks as tasks_lib
  calls, verified = [], []
  monkeypatch.setattr(policy_lib, "sample", _reference_sampler(calls))
  real = tasks_lib.safe_verify_batch
  monkeypatch.setattr(tasks_lib, "safe_verify_batch",
                      lambda task, exs, rs, **kw: verified.append(len(rs)) or real(task, exs, rs))
  examples = [AGENT[0]] + SINGLE[:4] + AGENT[1:] + SINGLE[4:]
  key = jax.random.key(11)
  stats, cache, timings = tasks_lib.RewardStats(), {}, {}
  eps = rl.rollout(rl.Policy(CFG, None, TOK), examples, key,
                   rl.sampling_for_chat(TOK, max_new_tokens=80),
                   prompt_bucket=16, batch_size=4, chunked=True,
                   log=rl.RolloutLog(stats=stats, verify_cache=cache, timings=timings))
  assert [e.example.id for e in eps] == [e.id for e in examples]
  assert all(e.reward.reward == pytest.approx(1.0) for e in eps)
  assert stats.total == len(examples) and set(timings) == {"generate", "verify"}
  longest = max(len(rl.prompt_ids(TOK, e)) for e in SINGLE)
  bucket = 16 * -(-longest // 16)
  keys = [np.asarray(jax.random.key_data(jax.random.fold_in(key, c))).tolist() for c in range(3)]
  assert calls[:2] == [(4, 4, bucket, keys[0]), (3, 4, bucket, keys[1])]
  # Agent rounds: 4 contexts (3 real + 1 padding copy) at the plain bucket,
  # keys split off fold_in(rng, 2) round by round.
  k = jax.random.fold_in(key, 2)
  for n, bs, pb, kd in calls[2:]:
    k, sub = jax.random.split(k)
    assert (bs, pb, kd) == (4, 16, np.asarray(jax.random.key_data(sub)).tolist())
  assert calls[2][0] == 4
  assert sum(verified) == len(SINGLE) and len(cache) == len(SINGLE)
  # A second call with the same cache verifies nothing again.
  rl.rollout(rl.Policy(CFG, None, TOK), SINGLE, 0, rl.sampling_for_chat(TOK, max_new_tokens=80),
             batch_size=4, chunked=True, log=rl.RolloutLog(verify_cache=cache))
  assert sum(verified) == len(SINGLE)


def test_rollout_rejects_bad_chunking_and_double_agent_config():
  from opd.tasks import AgentRewardConfig
  sampling = rl.sampling_for_chat(TOK, max_new_tokens=4)
  with pytest.raises(ValueError, match="chunked=True.*batch_size >= 1, got None"):
    rl.rollout(rl.Policy(CFG, None, TOK), SINGLE, 0, sampling, chunked=True)
  with pytest.raises(ValueError, match="agent_config and task_kwargs"):
    rl.rollout(rl.Policy(CFG, None, TOK), AGENT, 0, sampling,
               task_kwargs=rl.with_agent_config({"agent": {"config": AgentRewardConfig()}},
                                                AgentRewardConfig()))



def test_sample_pads_the_batch_to_the_mesh_batch_shards(params):
  """Three prompts on an 8-way batch mesh (the default ``pretrain.py:tiny``'s
  ``sample_text`` with four prompts on 8 devices): the batch is padded to 8
  rows instead of dying in the sampler, and the completions equal the
  unsharded ones (data parallelism only: each row's arithmetic is unchanged)."""
  from opd.parallel import sharding
  examples = get_task("math").examples("test", 3, seed=0)
  prompts = [rl.prompt_ids(TOK, e) for e in examples]
  sampling = rl.sampling_for_chat(TOK, max_new_tokens=6, temperature=0.0)
  mesh = sharding.make_mesh((8, 1, 1))
  sharded = rl.sample(rl.Policy(CFG, params, TOK, mesh), prompts, 0, sampling)
  single = rl.sample(rl.Policy(CFG, params, TOK), prompts, 0, sampling)
  assert len(sharded) == len(single) == 3
  for a, b in zip(sharded, single):
    np.testing.assert_array_equal(a.ids, b.ids)
    assert a.text == b.text
  with pytest.raises(ValueError, match=r"batch_size=6 is not divisible by the 8 batch shards"):
    rl.sample(rl.Policy(CFG, params, TOK, mesh), prompts, 0, sampling, batch_size=6)
