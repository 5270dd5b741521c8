"""The multi-turn loop: environments come from the task (Task.multi_turn,
Task.make_env), tool results go back as non-policy tokens."""
import jax
import numpy as np
import pytest

from opd import rollout as rl
from opd.rollout import policy as policy_lib
from opd.rollout.agent import rollout_multi_turn
from opd.tasks import get_task
from opd.tasks.math_task import MathTask
from opd.text.tokenizers import ByteTokenizer
from opd.models import ModelConfig

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64)


def test_agent_loop_with_scripted_policy(monkeypatch):
  """A policy that replays the reference turns gets reward 1; tool replies
  are in the response but masked out of the policy tokens."""
  task = get_task("agent")
  examples = task.examples("train", 3, seed=2, difficulty=2)
  by_prompt = {}
  for ex in examples:
    by_prompt[ex.prompt] = [c for role, c in ex.reference if role == "assistant"]
  calls = []

  def scripted(policy, prompts, rng, sampling, **kw):
    calls.append(len(prompts))
    out = []
    for p in prompts:
      text = policy.tokenizer.decode(p)
      prompt = text.split("<|user|>")[1].split("<|end|>")[0]
      turn = text.count("<|assistant|>") - 1
      reply = by_prompt[prompt][turn]
      ids = np.asarray(policy.tokenizer.encode(reply + "<|end|>"), np.int32)
      out.append(rl.Completion(ids, np.full(len(ids), -0.5, np.float32), True, reply))
    return out

  monkeypatch.setattr(policy_lib, "sample", scripted)
  sampling = rl.sampling_for_chat(TOK, max_new_tokens=80)
  eps = rollout_multi_turn(rl.Policy(CFG, None, TOK), examples, jax.random.key(0), sampling)
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


class _EchoEnv:
  """A two-round environment: replies "again" once, then ends; reward 1 iff
  both turns said "hi"."""

  def reset(self, example):
    self.turns = []
    return example.prompt_messages()

  def step(self, text):
    self.turns.append(text)
    return "again", len(self.turns) == 2, {}

  def reward(self):
    from opd.tasks import Reward
    return Reward(float(self.turns == ["hi", "hi"]), 1.0, {}, "ok")


def test_rollout_dispatches_on_the_task_property(monkeypatch):
  """Turn math multi-turn (task property + environment), nothing else: rollout
  now runs math through the environment loop, without naming any domain."""
  monkeypatch.setattr(MathTask, "multi_turn", True)
  monkeypatch.setattr(MathTask, "make_env", lambda self: _EchoEnv())
  rounds = []

  def say_hi(policy, prompts, rng, sampling, **kw):
    rounds.append(len(prompts))
    ids = np.asarray(policy.tokenizer.encode("hi<|end|>"), np.int32)
    return [rl.Completion(ids, np.zeros(len(ids), np.float32), True, "hi") for _ in prompts]

  monkeypatch.setattr(policy_lib, "sample", say_hi)
  examples = get_task("math").examples("train", 2)
  eps = rl.rollout(rl.Policy(CFG, None, TOK), examples, 0,
                   rl.sampling_for_chat(TOK, max_new_tokens=8))
  assert rounds == [2, 2]
  for ep in eps:
    assert ep.turns == ["hi", "hi"] and ep.reward.reward == 1.0
    assert TOK.decode(ep.response_ids) == (
        "hi<|end|><|tool|><tool_result>again</tool_result><|end|><|assistant|>hi<|end|>")
