"""grm.gencluster in the sandbox: problems, generated inputs and the filter, hidden
tests, and a run mixing hostile candidates with good ones (docs/DESIGN.md §7)."""
import itertools
import pathlib
import random
import shutil
import tempfile

import pytest

from grm.gencluster import clustering, execution, inputs, pipeline, problems, submission
from opd.tasks import get_task
from opd.tasks.sandbox import KERNEL_ISOLATION, Sandbox, SandboxLimits, isolation_report

LEVEL = next((lv for lv, s in isolation_report().items()
              if s == "available" and lv.startswith("namespaces")), None)
pytestmark = pytest.mark.skipif(LEVEL is None, reason="no namespaces sandbox level here")


@pytest.fixture(scope="module")
def sandbox():
  # Kernel-only containment: no audit-hook guard, so every hostile program
  # below really runs and meets the kernel's limits.
  return Sandbox(SandboxLimits(cpu_s=1, wall_s=1.5), isolation=LEVEL, python_guard=False,
                 require=KERNEL_ISOLATION)


@pytest.fixture(scope="module")
def problem():
  ex = next(e for e in get_task("code").examples("test", 20, seed=0, difficulty=1)
            if e.reference[-1][1].endswith("x*9-4"))
  return problems.make_problem(ex, n_hidden=5, seed=0)


def test_problem_subtasks_widen_and_the_rule_validator_reads_the_constraints(problem):
  assert problem.kinds == ("int",) and [s.level for s in problem.subtasks] == [1, 2, 3]
  for s in problem.subtasks:
    lo, hi = s.bounds[:2]
    assert all(problems.rule_accepts(s, a) for a in s.hidden)
    assert all(problems.rule_accepts(s, a) for a in problems.fallback_inputs(s, 20, seed=1))
    assert not problems.rule_accepts(s, (hi + 1,)) and not problems.rule_accepts(s, (lo - 1,))
    assert not problems.rule_accepts(s, (True,)) and not problems.rule_accepts(s, (1, 2))
  # Level 3 holds the edge values.
  assert {(-1000,), (1000,), (0,), (-1,), (1,)} <= set(problem.subtasks[2].hidden)
  assert problem.subtasks[0].constraints == "x is an integer from 0 to 9"
  lst = problems.Subtask(1, ("list",), ())
  assert problems.rule_accepts(lst, ([0, 9, 3],)) and not problems.rule_accepts(lst, ([],))
  assert not problems.rule_accepts(lst, ([0, 10],)) and not problems.rule_accepts(lst, ([1] * 4,))


def test_build_inputs_model_generator_fallback_and_75_percent_filter(sandbox, problem):
  sub = problem.subtasks[0]  # x in [0, 9]
  gens = ["def f(i): return i*3",          # model: 0, 3, ..., 21: four of eight out of range
          "def f(i): return 7",            # one distinct value: falls back
          "Sure! Here is f."]              # does not parse: falls back
  vals = ["def f(x): return 0 <= x <= 9",  # right: usable
          "def f(x): return x >= 0",       # too lax, but boolean and accepts the probe: usable
          "def f(x): return x + 1",        # not boolean: rule-based instead
          "def f(x): return x > 100",      # boolean, but rejects the probe: rule-based instead
          "no code"]                       # falls back to the rule
  got = inputs.build_inputs(sandbox, problem, sub, gens, vals, per_generator=8, n_probe=6,
                            seed=0, max_inputs=100)
  assert got.generator_sources == ["model", "fallback", "fallback"]
  assert got.validator_sources == ["model", "model", "fallback", "fallback", "fallback"]
  model_inputs = [(3 * i,) for i in range(8)]
  fallback = (problems.fallback_inputs(sub, 8, (0, "generator", 1))
              + problems.fallback_inputs(sub, 8, (0, "generator", 2)))
  expect_all = list(dict.fromkeys(model_inputs + fallback))
  assert got.inputs == expect_all
  # 4 of the 5 validators (the right one and three rule-based) reject 12..21; the lax one
  # accepts them: 1/5 < 75%, removed. Inputs in range: 5/5, kept.
  assert got.kept == [a for a in expect_all if 0 <= a[0] <= 9]
  assert got.counts()["removed"] == got.removed == sum(a[0] > 9 for a in expect_all) == 4
  capped = inputs.build_inputs(sandbox, problem, sub, gens, vals, per_generator=8, n_probe=6,
                               seed=0, max_inputs=3)
  assert capped.kept == got.kept[:3] and capped.removed == 4  # the cap removes nothing


def test_a_validator_accepting_exactly_half_of_the_probe_is_used(sandbox, problem):
  """The usability rule is "at least half" of the probe accepted: exactly half is
  usable, one input fewer is not (the rule-based validator replaces it)."""
  sub = problem.subtasks[0]
  n_probe = 6
  probe = problems.fallback_inputs(sub, n_probe, (0, "probe"))  # what build_inputs probes with
  values = sorted({a[0] for a in probe})

  def accepting(count):
    """Some set of probe values accepted on exactly ``count`` of the probe inputs."""
    for r in range(len(values) + 1):
      for chosen in itertools.combinations(values, r):
        if sum(a[0] in chosen for a in probe) == count:
          return chosen
    raise AssertionError(f"no set of {values} covers exactly {count} of {probe}")

  half, below = accepting(n_probe // 2), accepting(n_probe // 2 - 1)
  vals = [f"def f(x): return x in {half!r}", f"def f(x): return x in {below!r}"]
  got = inputs.build_inputs(sandbox, problem, sub, ["no code"], vals, per_generator=8,
                            n_probe=n_probe, seed=0, max_inputs=100)
  assert got.validator_sources == ["model", "fallback"]
  # Two validators: 75% is both. The rule accepts every fallback input (all in range), so the
  # kept inputs are exactly those the half validator accepts: it is really used.
  assert all(problems.rule_accepts(sub, a) for a in got.inputs)
  assert got.kept == [a for a in got.inputs if a[0] in half]
  assert 0 < len(got.kept) < len(got.inputs)


def test_hidden_passes_per_subtask_and_reference_check(sandbox, problem):
  srcs = ["def f(x): return x*9-4",                   # right everywhere
          "def f(x): return abs(x)*9-4",              # right for x >= 0 only: level 1
          "def f(x): return x*9-4 if x < 500 else 0",  # wrong only for large x: levels 1, 2
          None]
  got = pipeline.hidden_passes(sandbox, [problem], [srcs])[0]
  assert got == [frozenset({0, 1, 2}), frozenset({0}), frozenset({0, 1}), frozenset()]
  bad = problems.Problem(problem.id, problem.prompt, 1, ("int",), "def f(x): return x*9-5",
                         problem.tests, problem.subtasks)
  with pytest.raises(ValueError, match="task's callables"):
    pipeline.hidden_passes(sandbox, [bad], [[]])


@pytest.fixture
def host_dir():
  path = pathlib.Path(tempfile.mkdtemp(prefix="gencluster-hostile-"))
  path.chmod(0o777)
  yield path
  shutil.rmtree(path)


def _clusters(sandbox, srcs, test_inputs):
  outs = execution.run_functions(sandbox, srcs, [test_inputs] * len(srcs), chunk=16)
  kept, counts = clustering.cluster(outs, [len(s) for s in srcs])
  return outs, kept, counts


def test_hostile_candidates_cost_one_slot_each(sandbox, problem, host_dir):
  """Hang, fork bomb, output flood and a write outside the work directory, mixed
  into good and wrong candidates: each hostile one fails alone (its cluster
  dropped, no subtask passed, nothing written on the host), and the others
  cluster, rank and solve exactly as in a run without them."""
  sub = problem.subtasks[1]
  test_inputs = problems.fallback_inputs(sub, 6, seed=3)
  good = ["def f(x): return x*9-4",
          "def f(x):\n  y = x*9\n  return y-4",
          "def f(x): return abs(x)*9-4",
          "def f(x): return x*9+4"]
  target = host_dir / "pwned.txt"
  hostile = ["def f(x):\n  while True:\n    pass",
             "def f(x):\n  import os\n  while True:\n    os.fork()",
             "def f(x):\n  print('A' * 10**7)\n  return x*9-4",
             f"def f(x):\n  open({str(target)!r}, 'w').write('x')\n  return x*9-4"]
  rng = random.Random(0)
  mixed = good + hostile
  rng.shuffle(mixed)
  g_outs, g_kept, _ = _clusters(sandbox, good, test_inputs)
  m_outs, m_kept, m_counts = _clusters(sandbox, mixed, test_inputs)
  assert not target.exists()
  # Every hostile candidate: a failed run or an error output, so its cluster is dropped.
  for src, out in zip(mixed, m_outs):
    if src in hostile:
      assert clustering.is_bad(out), (src, out)
    else:
      assert out == g_outs[good.index(src)]
  assert m_counts["candidates_dropped"] == len(hostile)
  # The good ones cluster as without the hostile ones (indices mapped back).
  as_text = lambda kept, srcs: [sorted(srcs[i] for i in c.members) for c in kept]  # noqa: E731
  assert as_text(m_kept, mixed) == as_text(g_kept, good)
  # And solve as without them: the hostile ones pass no subtask.
  passes = pipeline.hidden_passes(sandbox, [problem], [mixed])[0]
  alone = pipeline.hidden_passes(sandbox, [problem], [good])[0]
  for src, p in zip(mixed, passes):
    assert p == (frozenset() if src in hostile else alone[good.index(src)])
  ranked = [[], [list(c.members) for c in m_kept], []]
  subs = submission.submit(ranked, dict(enumerate(passes)), budget=50)
  # The largest cluster {good[0], good[1]} first, its longer-reasoning member (good[1]) first.
  assert subs[0].candidate == mixed.index(good[1]) and subs[0].solved == {0, 1, 2}
