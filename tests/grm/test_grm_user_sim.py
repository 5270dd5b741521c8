"""grm.user_sim: the agent's layered reward at the seed's weights 30/25/20/15/10,
one scenario per layer, expected values derived from the scenario by hand."""
import json

import pytest

from grm.user_sim import SEED_WEIGHTS, AgentLayeredReward, replay, user_satisfaction
from opd.tasks import AgentRewardConfig, get_task

W = {"format": 0.30, "execution": 0.25, "step": 0.20, "grm": 0.15, "user": 0.10}


class Ep:
  def __init__(self, example, turns):
    self.example, self.turns = example, list(turns)


@pytest.fixture(scope="module")
def example():
  # Difficulty 3: two lookups and a calculation, so 3 required steps.
  ex = get_task("agent").examples("train", 1, seed=0, difficulty=3)[0]
  assert len(ex.meta["steps"]) == 3
  return ex


def _reference_turns(ex):
  return [c for role, c in ex.reference if role == "assistant"]


def _bad_lookup():
  return '<tool_call>{"name": "lookup", "arguments": {"key": "no-such-key"}}</tool_call>'


def _total(layers, grm, user):
  return sum(W[k] * v for k, v in layers.items()) + W["grm"] * grm + W["user"] * user


def test_seed_weights_are_30_25_20_15_10():
  assert SEED_WEIGHTS.weights() == {**W, "final_answer": 0.0}


def test_each_layer(example):
  ref = _reference_turns(example)
  wrong = ref[:-1] + ["Answer: 100000"]
  cases = {
      # reference: every layer full; user = 0.5 + 0.3 + 0.2.
      "reference": (ref, dict(format=1, execution=1, step=1), 1.0),
      # a failed extra call first: execution 3/4, step 3/max(3, 4); user: correct,
      # efficiency 4 needed / 5 turns, clean 3/4.
      "failed_call": ([_bad_lookup()] + ref, dict(format=1, execution=3 / 4, step=3 / 4),
                      0.5 + 0.3 * 4 / 5 + 0.2 * 3 / 4),
      # wrong final answer: the rule layers stay full, the user loses "correct".
      "wrong_answer": (wrong, dict(format=1, execution=1, step=1), 0.3 + 0.2),
      # a malformed first turn ends the episode: format 0/1, no calls, not answered.
      "malformed": (["I think the answer is big."], dict(format=0, execution=0, step=0), 0.0),
  }
  grm_values = [0.6, 0.2, 0.9, 0.35]
  calls = []

  def grm_fn(episodes):
    calls.append(len(episodes))
    return grm_values

  eps = [Ep(example, turns) for turns, _, _ in cases.values()]
  rewards = AgentLayeredReward(grm_fn)(eps)
  assert calls == [len(eps)]  # the GRM layer is one batched call
  for (name, (turns, layers, user)), g, r, ep in zip(cases.items(), grm_values, rewards, eps):
    assert user_satisfaction(replay(example, turns, SEED_WEIGHTS)) == pytest.approx(user), name
    for k, v in layers.items():
      assert r.components[k] == pytest.approx(v), (name, k)
    assert r.components["grm"] == g and r.components["user"] == pytest.approx(user), name
    assert r.reward == pytest.approx(_total(layers, g, user), abs=1e-12), name


def test_grm_layer_moves_the_reward_by_its_weight(example):
  ep = Ep(example, _reference_turns(example))
  lo, hi = (AgentLayeredReward(lambda eps, v=v: [v] * len(eps))([ep])[0].reward
            for v in (0.0, 1.0))
  assert hi - lo == pytest.approx(W["grm"], abs=1e-12)


def test_bad_arguments(example):
  with pytest.raises(ValueError, match="grm_fn"):
    AgentLayeredReward(None)
  no_grm = AgentRewardConfig(format=0.3, execution=0.25, step=0.2, final_answer=0.15, user=0.1)
  r = AgentLayeredReward(None, no_grm)([Ep(example, _reference_turns(example))])[0]
  assert r.reward == pytest.approx(1.0)
  with pytest.raises(ValueError, match="shape"):
    AgentLayeredReward(lambda eps: [0.5, 0.5])([Ep(example, [])])
  math = get_task("math").examples("train", 1, seed=0)[0]
  with pytest.raises(ValueError, match="math"):
    AgentLayeredReward(None, no_grm)([Ep(math, ["Answer: 1"])])
  assert json.dumps(SEED_WEIGHTS.weights())  # plain floats, loggable
