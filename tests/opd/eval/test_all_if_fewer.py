"""EvalConfig.all_if_fewer / Task.examples(at_most=True): a domain whose test
split holds fewer distinct problems than asked is scored on all it has -- the
same examples, in the same order, that asking for exactly that many gives."""
import pytest

from opd import tasks as tasks_lib
from opd.eval.evaluation import eval_examples
from opd.eval.results import EvalConfig


def test_at_most_returns_every_distinct_problem_found_in_draw_order():
  task = tasks_lib.get_task("writing")
  with pytest.raises(ValueError, match="found only"):
    task.examples("test", 1000, seed=0, difficulty=1)
  found = task.examples("test", 1000, seed=0, difficulty=1, at_most=True)
  assert 0 < len(found) < 1000 and len({e.id for e in found}) == len(found)
  exact = task.examples("test", len(found), seed=0, difficulty=1)
  assert [e.id for e in exact] == [e.id for e in found]
  # Where the split holds enough, at_most changes nothing.
  assert ([e.id for e in task.examples("test", 10, seed=0, difficulty=1, at_most=True)]
          == [e.id for e in task.examples("test", 10, seed=0, difficulty=1)])


def test_eval_examples_cap_only_the_short_domains():
  cfg = EvalConfig(domains=("math", "writing"), n_per_domain=200, all_if_fewer=True)
  got = eval_examples(cfg)
  assert len(got["math"]) == 200 and 0 < len(got["writing"]) < 200
  with pytest.raises(ValueError, match="writing: found only"):
    eval_examples(EvalConfig(domains=("math", "writing"), n_per_domain=200))
  with pytest.raises(ValueError, match="all_if_fewer"):
    EvalConfig(all_if_fewer="yes")
