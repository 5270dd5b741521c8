"""Code verifier: programs written here from the prompt text, run in the sandbox."""
import re

import pytest

from opd.tasks.sandbox.api import Sandbox, SandboxLimits, SandboxResult
from opd.tasks import RewardStats, get_task, safe_verify
from opd.tasks.code_task import SandboxFailure

# Prompt description -> (our own source for the body, our own Python function).
# Written independently of opd.tasks.code_task: different spelling, same meaning.
_SPECS = [
    (r"x plus (\d+)", "{0} + x", lambda a: lambda x: a + x),
    (r"x minus (\d+)", "-{0} + x", lambda a: lambda x: x - a),
    (r"x times (\d+)", "{0} * x", lambda a: lambda x: a * x),
    (r"x times (\d+) plus (\d+)", "{0} * x + {1}", lambda a, b: lambda x: a * x + b),
    (r"x times (\d+) minus (\d+)", "{0} * x - {1}", lambda a, b: lambda x: a * x - b),
    (r"x plus (\d+), times (\d+)", "{1} * (x + {0})", lambda a, b: lambda x: b * (x + a)),
    (r"x squared plus (\d+)", "x ** 2 + {0}", lambda a: lambda x: x ** 2 + a),
    (r"x mod (\d+)", "x - (x // {0}) * {0}", lambda a: lambda x: x - (x // a) * a),
    (r"x divided by (\d+), rounded down", "int((x - x % {0}) / {0})",
     lambda a: lambda x: (x - x % a) // a),
    (r"x plus y", "sum([x, y])", lambda: lambda x, y: x + y),
    (r"x times y", "y * x", lambda: lambda x, y: y * x),
    (r"x minus y times (\d+)", "x - {0} * y", lambda a: lambda x, y: x - a * y),
    (r"x times (\d+) plus y", "y + {0} * x", lambda a: lambda x, y: y + a * x),
    (r"the larger of x and y", "sorted([x, y])[1]", lambda: lambda x, y: sorted([x, y])[1]),
    (r"the smaller of x and y", "sorted([x, y])[0]", lambda: lambda x, y: sorted([x, y])[0]),
    (r"x times (\d+) if x is even, else x plus (\d+)", "(x * {0}) if x % 2 == 0 else (x + {1})",
     lambda a, b: lambda x, y: x * a if x % 2 == 0 else x + b),
    (r"x if x is above (\d+), else y", "y if x <= {0} else x",
     lambda a: lambda x, y: y if x <= a else x),
    (r"the sum of xs", "sum(v for v in xs)", lambda: lambda xs: sum(xs)),
    (r"the sum of xs times (\d+)", "sum(v * {0} for v in xs)", lambda a: lambda xs: a * sum(xs)),
    (r"the largest item of xs plus (\d+)", "sorted(xs)[-1] + {0}", lambda a: lambda xs: max(xs) + a),
    (r"the count of items of xs above (\d+)", "sum(1 for v in xs if v > {0})",
     lambda a: lambda xs: sum(v > a for v in xs)),
    (r"the sum of the even items of xs", "sum(v * (1 - v % 2) for v in xs)",
     lambda: lambda xs: sum(v for v in xs if not v % 2)),
    (r"xs with each item times (\d+)", "list(map(lambda v: v * {0}, xs))",
     lambda a: lambda xs: [a * v for v in xs]),
    (r"the first (\d+) items of xs", "[v for i, v in enumerate(xs) if i < {0}]",
     lambda a: lambda xs: list(xs[:a])),
    (r"xs reversed", "list(reversed(xs))", lambda: lambda xs: list(reversed(xs))),
]


def understand(prompt: str):
  """(signature, body source, function) for a prompt, from our own table."""
  m = re.fullmatch(r"(?:Write|Define) f\(([a-z, ]+)\) (?:that returns|to return) (.+)\.", prompt)
  assert m, prompt
  sig, desc = m.groups()
  for pattern, body, make in _SPECS:
    d = re.fullmatch(pattern, desc)
    if d:
      args = [int(g) for g in d.groups()]
      return sig, body.format(*args), make(*args)
  raise AssertionError(f"no spec for {desc!r}")


@pytest.fixture(scope="module")
def task():
  return get_task("code", sandbox=Sandbox(SandboxLimits(cpu_s=1, wall_s=1.5)))


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_correct_and_wrong_programs(task, difficulty):
  for example in task.examples("test", 3, seed=5, difficulty=difficulty):
    sig, body, fn = understand(example.prompt)
    for args, expected in example.meta["tests"]:
      assert fn(*args) == expected  # the hidden outputs agree with our reading
    right = task.verify(example, f"```python\ndef f({sig}):\n    return {body}\n```")
    assert (right.reward, right.format, right.reason) == (1.0, 1.0, "ok"), (example.prompt, right)
    assert task.verify(example, example.reference_text).reward == 1.0
    # A near miss: off by one whenever the first argument is odd. The reward
    # must be exactly the fraction of hidden tests it still passes.
    if difficulty < 3:
      wrong_src = f"def f({sig}):\n  return ({body}) + (x % 2)"
      wrong = lambda *a: fn(*a) + a[0] % 2  # noqa: E731
    else:
      wrong_src = f"def f({sig}):\n  return ({body}) if len(xs) % 2 else 0"
      wrong = lambda xs: fn(xs) if len(xs) % 2 else 0  # noqa: E731
    expected_frac = sum(type(wrong(*a)) is type(e) and wrong(*a) == e
                        for a, e in example.meta["tests"]) / len(example.meta["tests"])
    got = task.verify(example, wrong_src)
    assert got.format == 1.0 and got.reward == pytest.approx(expected_frac), (wrong_src, got)


def test_hazardous_and_malformed_programs(task):
  example = task.examples("train", 1, seed=0, difficulty=1)[0]
  loop = task.verify(example, "def f(x):\n  while True:\n    pass")
  assert (loop.reward, loop.format) == (0.0, 1.0)
  assert loop.reason in ("sandbox:cpu_time_limit", "sandbox:wall_time_limit")
  write = task.verify(example, "def f(x):\n  return open('/tmp/opd-code-test', 'w').write('x')")
  assert write.reward == 0.0 and write.reason.startswith("sandbox:forbidden")
  boolean = task.verify(example, "def f(x): return True")
  assert boolean.reward == 0.0 and boolean.format == 1.0  # True is not an int
  for bad in ("import os\ndef f(x): return x", "def g(x): return x", "def f(x, y): return x",
              "f = lambda x: x", "return x + 1", "def f(x) return x"):
    r = task.verify(example, bad)
    assert (r.reward, r.format) == (0.0, 0.0) and r.category == "malformed", bad


def test_batch_verification_matches_sequential(task):
  examples = task.examples("train", 4, seed=1, difficulty=1)
  responses = [e.reference_text for e in examples[:2]] + ["def f(x): return 0", "garbage"]
  batch = task.verify_batch(examples, responses)
  assert batch == [task.verify(e, r) for e, r in zip(examples, responses)]


class _BrokenSandbox:
  def run_python(self, source, **kwargs):
    return SandboxResult(False, "sandbox_error:launch failed", None, "", "", 0.0, (), "x")


def test_sandbox_failure_is_a_counted_verifier_error():
  task = get_task("code", sandbox=_BrokenSandbox())
  example = task.examples("train", 1)[0]
  with pytest.raises(SandboxFailure):
    task.verify(example, example.reference_text)
  stats = RewardStats()
  reward = safe_verify(task, example, example.reference_text, stats)
  assert reward.reward == 0.0 and reward.category == "verifier_error"
  assert stats.errors == 1


def test_non_finite_result_fails_its_own_test_only(task):
  """One NaN (or inf) among right answers is the program's wrong answer on
  that test, not unreadable results: the reward counts the other tests."""
  example = task.examples("test", 1, seed=3, difficulty=1)[0]
  sig, body, _ = understand(example.prompt)
  first = example.meta["tests"][0][0][0]
  # Our own count: every test whose input is the first one gets the odd value.
  n_odd = sum(args[0] == first for args, _ in example.meta["tests"])
  expected = (len(example.meta["tests"]) - n_odd) / len(example.meta["tests"])
  for odd in ("float('nan')", "float('inf')", "[float('nan')]"):
    answer = f"def f({sig}):\n  return {odd} if x == {first} else ({body})"
    got = task.verify(example, answer)
    assert got.reward == pytest.approx(expected) and got.format == 1.0, (odd, got)
    assert got.reason == f"partial:{len(example.meta['tests']) - n_odd}/6", (odd, got)
