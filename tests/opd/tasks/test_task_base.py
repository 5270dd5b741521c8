"""Suite-wide properties: leak-free splits, determinism, safe scoring, rendering, corpus."""
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd.text import chat

from opd.tasks import (ALL_DOMAINS, DIFFICULTIES, TEST_FRACTION, Reward, RewardStats,
                       VerifierFailureError, get_task, is_multi_turn, mixture_corpus, render_messages,
                       safe_verify, safe_verify_batch, split_of)
from opd.tasks.base import Draft, Task


@pytest.mark.parametrize("domain", ALL_DOMAINS)
def test_splits_are_disjoint_and_labelled(domain):
  task = get_task(domain)
  for difficulty in DIFFICULTIES:
    train = task.examples("train", 150, seed=0, difficulty=difficulty)
    test = task.examples("test", 40, seed=0, difficulty=difficulty)
    # Another seed of the train stream must not reach the test prompts either.
    train += task.examples("train", 150, seed=1, difficulty=difficulty)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    for split, examples in (("train", train), ("test", test)):
      for e in examples:
        assert (e.domain, e.split, e.difficulty) == (domain, split, difficulty)
        assert split_of(domain, e.prompt) == split
        assert e.reference and e.reference[-1][0] == "assistant"
    assert len({e.id for e in test}) == len(test)


def test_split_fraction_matches_configuration():
  rng = random.Random(0)
  prompts = [f"prompt {rng.random()}" for _ in range(20000)]
  frac = sum(split_of("math", p) == "test" for p in prompts) / len(prompts)
  assert abs(frac - TEST_FRACTION) < 0.015  # 4.5 binomial standard deviations


@pytest.mark.parametrize("domain", ALL_DOMAINS)
def test_generation_is_deterministic(domain):
  task = get_task(domain)
  for difficulty in DIFFICULTIES:
    a = [e.to_json() for e in task.examples("train", 20, seed=7, difficulty=difficulty)]
    b = [e.to_json() for e in get_task(domain).examples("train", 20, seed=7, difficulty=difficulty)]
    c = [e.to_json() for e in task.examples("train", 20, seed=8, difficulty=difficulty)]
    assert a == b
    assert a != c


@pytest.mark.parametrize("domain", ALL_DOMAINS)
def test_easy_level_fits_a_tiny_byte_model(domain):
  """Difficulty 1: prompts <= 80 characters, single responses <= 40.

  Agent tool-call turns are longer (the JSON call syntax is fixed by the chat
  format) but every one is the same template with one key filled in.
  """
  for e in get_task(domain).examples("train", 300, seed=0, difficulty=1, unique=False):
    assert len(e.prompt) <= 80, e.prompt
    for role, content in e.reference:
      if role == "assistant" and not content.startswith("<tool_call>"):
        assert len(content) <= 40, content


def test_bad_generator_arguments_raise():
  task = get_task("math")
  with pytest.raises(ValueError, match="split"):
    task.examples("valid", 3)
  with pytest.raises(ValueError, match="difficulty"):
    task.examples("train", 3, difficulty=4)
  with pytest.raises(ValueError, match="n must"):
    task.examples("train", -1)
  with pytest.raises(ValueError, match="unknown domain"):
    get_task("poetry")


class _TinyTask(Task):
  """Three possible prompts: asking for more distinct ones must fail clearly."""
  domain = "tiny"

  def draft(self, rng, difficulty):
    k = rng.randrange(3)
    return Draft(f"say {k}", (("assistant", str(k)),), {"k": k})

  def verify(self, example, response):
    if response == "boom":
      raise RuntimeError("verifier bug")
    return Reward(float(response == str(example.meta["k"])), 1.0)


def test_problem_space_exhaustion_and_repeats():
  task = _TinyTask()
  n_train = len({e.prompt for e in task.examples("train", 200, unique=False)})
  assert n_train <= 3
  with pytest.raises(ValueError, match="distinct"):
    task.examples("train", n_train + 1)
  assert len(task.examples("train", 50, unique=False)) == 50


def test_safe_verify_counts_errors_and_fails_fast():
  task = _TinyTask()
  examples = task.examples("train", 1, unique=False) * 4
  k = examples[0].meta["k"]
  stats = RewardStats()
  rewards = [safe_verify(task, e, r, stats) for e, r in zip(examples, [str(k), "boom", "x", "boom"])]
  assert [r.reward for r in rewards] == [1.0, 0.0, 0.0, 0.0]
  assert rewards[1].reason.startswith("verifier_error:RuntimeError")
  assert stats.total == 4 and stats.errors == 2 and stats.error_fraction == 0.5
  assert stats.metrics()["reward_reason/verifier_error"] == 2.0
  stats.check(0.5)
  with pytest.raises(VerifierFailureError, match="2/4"):
    stats.check(0.25)
  bad = safe_verify(task, "not an example", "0", stats)
  assert bad.reward == 0.0 and bad.category == "bad_example"
  other = get_task("math").examples("train", 1)[0]
  assert safe_verify(task, other, "0").category == "bad_example"


def test_safe_verify_batch_isolates_failures():
  task = _TinyTask()
  examples = task.examples("train", 1, unique=False) * 3
  k = examples[0].meta["k"]
  stats = RewardStats()
  rewards = safe_verify_batch(task, examples, [str(k), "boom", str(k)], stats=stats)
  assert [r.reward for r in rewards] == [1.0, 0.0, 1.0]
  assert stats.errors == 1
  with pytest.raises(VerifierFailureError):
    safe_verify_batch(task, examples, ["boom", "boom", str(k)], max_error_fraction=0.5)
  with pytest.raises(ValueError, match="responses"):
    safe_verify_batch(task, examples, ["0"])


def test_reward_validation():
  with pytest.raises(ValueError, match="reward"):
    Reward(1.5, 1.0)
  with pytest.raises(ValueError, match="format"):
    Reward(0.5, float("nan"))
  with pytest.raises(ValueError, match="components"):
    Reward(0.5, 1.0, {"x": -0.1})
  assert Reward(0.5, 1.0, {}, "partial:1/2").category == "partial"


def test_reference_text_is_single_turn_only():
  math_ex = get_task("math").examples("train", 1)[0]
  assert math_ex.reference_text.startswith("Answer: ")
  agent_ex = get_task("agent").examples("train", 1)[0]
  with pytest.raises(ValueError, match="multi-turn"):
    agent_ex.reference_text


def test_chat_rendering_and_loss_segments():
  messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "call"},
              {"role": "tool", "content": "7"}, {"role": "assistant", "content": "Answer: 7"}]
  text = render_messages(messages)
  assert text == ("<|user|>Q<|end|><|assistant|>call<|end|>"
                  "<|tool|><tool_result>7</tool_result><|end|><|assistant|>Answer: 7<|end|>")
  chars, mask = chat.render_for_training(chat.from_raw(messages))
  assert chars == text
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
  runs = [chars[a:b] for a, b in zip(edges[::2], edges[1::2])]
  assert runs == ["call<|end|>", "Answer: 7<|end|>"]
  assert render_messages(messages[:1], add_generation_prompt=True) == "<|user|>Q<|end|><|assistant|>"
  with pytest.raises(ValueError, match="role"):
    render_messages([{"role": "robot", "content": "x"}])
  with pytest.raises(ValueError, match="content"):
    render_messages([{"role": "user"}])


@pytest.mark.parametrize("domain", ALL_DOMAINS)
def test_references_round_trip_through_the_chat_format(domain):
  """Every reference renders (via opd.text.chat) to the plain concatenation of
  its turns, so SFT trains exactly the text a policy would generate."""
  for example in get_task(domain).examples("train", 20, seed=3, difficulty=2):
    messages = example.messages()
    plain = "".join(f"<|{m['role']}|>" + (f"<tool_result>{m['content']}</tool_result>"
                                         if m["role"] == "tool" else m["content"]) + "<|end|>"
                    for m in messages)
    assert render_messages(messages) == plain


def test_mixture_corpus():
  corpus = mixture_corpus(23, seed=3)
  assert corpus == mixture_corpus(23, seed=3)
  assert len(corpus) == 23
  prompts = [t.split("<|user|>", 1)[1].split("<|end|>", 1)[0] for t in corpus]
  expected_domains = [ALL_DOMAINS[i % len(ALL_DOMAINS)] for i in range(23)]
  for text, prompt, domain in zip(corpus, prompts, expected_domains):
    assert text.startswith("<|user|>") and text.endswith("<|end|>")
    assert split_of(domain, prompt) == "train"  # never a test prompt
  assert "<tool_call>" in corpus[3] and "<|tool|>" in corpus[3]
  prompts_only = mixture_corpus(23, seed=3, responses=False)
  assert [t.split("<|end|>")[0] + "<|end|>" for t in corpus] == prompts_only
  big = mixture_corpus(3000, seed=0, domains=("writing",))
  assert len(big) == 3000  # more than the distinct easy prompts: repeats allowed
  with pytest.raises(ValueError, match="difficulties"):
    mixture_corpus(5, difficulties=(0,))


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), st.none(), st.integers(),
                 st.lists(st.sampled_from(["Answer: 3", "<tool_call>", "</tool_call>", "x", "\n",
                                           "<think>", "</think>", "<|end|>", "."]),
                          max_size=20).map("".join)))
def test_no_verifier_raises_and_malformed_scores_zero(response):
  for domain in ("math", "instruct", "agent", "writing"):
    task = get_task(domain)
    example = task.examples("train", 1, seed=0)[0]
    reward = task.verify(example, response)
    assert isinstance(reward, Reward)
    if reward.format == 0.0:
      assert reward.reward == 0.0


def test_examples_accept_numpy_ints_and_name_bad_fields():
  """numpy ints are ints (the same examples as the Python ints); bools and
  floats are not, and the error names the field and the value."""
  task = get_task("math")
  assert ([e.id for e in task.examples("test", np.int64(3), seed=np.int32(2),
                                       difficulty=np.int64(2))]
          == [e.id for e in task.examples("test", 3, seed=2, difficulty=2)])
  for kwargs, match in (({"n": True}, "MathTask.examples.n must be .*int.*, got True"),
                        ({"n": 2, "seed": 1.0}, "MathTask.examples.seed must be .*, got 1.0"),
                        ({"n": 2, "difficulty": 4}, "MathTask.examples.difficulty .*, got 4"),
                        ({"n": 2, "split": "dev"}, "MathTask.examples.split .*, got 'dev'")):
    with pytest.raises(ValueError, match=match):
      task.examples(kwargs.pop("split", "test"), **kwargs)


def test_only_multi_turn_tasks_have_an_environment():
  for domain in ALL_DOMAINS:
    task = get_task(domain)
    assert task.multi_turn == is_multi_turn(domain)
    if task.multi_turn:
      env = task.make_env()
      example = task.examples("train", 1)[0]
      assert env.reset(example)[0]["content"] == example.prompt
    else:
      with pytest.raises(ValueError, match=f"task '{domain}' is single-turn"):
        task.make_env()


def test_isolation_unavailable_is_a_setup_error_not_a_bad_sample():
  # A sandbox that cannot give the required isolation must stop the caller,
  # not be counted as one verifier error per sample (which a trainer would
  # only notice through its error-fraction limit, blaming the samples).
  from opd.tasks import MathTask, safe_verify, safe_verify_batch
  from opd.tasks.sandbox.api import IsolationUnavailable

  class NoSandbox(MathTask):
    def verify(self, example, response):
      raise IsolationUnavailable("no kernel isolation here")

  task = NoSandbox()
  ex = task.examples("train", 2)
  with pytest.raises(IsolationUnavailable):
    safe_verify(task, ex[0], "Answer: 1")
  with pytest.raises(IsolationUnavailable):
    safe_verify_batch(task, ex, ["Answer: 1", "Answer: 2"])

  class Flaky(MathTask):  # any other exception is still the sample's: scored 0, counted
    def verify(self, example, response):
      raise RuntimeError("boom")

  assert safe_verify(Flaky(), ex[0], "Answer: 1").reason.startswith("verifier_error:RuntimeError")
