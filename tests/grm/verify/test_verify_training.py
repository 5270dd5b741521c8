"""grm.verify.training: labelled proofs, cold-start pairs, and the two RL rewards against
references written from docs/DESIGN.md §7 (scripted verifier / meta-verifier callables)."""
import numpy as np
import pytest

from grm.verify import training as T
from grm.verify.format import (format_analysis, meta_prompt, parse_analysis, parse_generation,
                               parse_meta, verifier_prompt, write_generation)
from opd.rollout.episodes import Episode
from opd.tasks.proof_task import CORRUPTIONS, Issue, check_proof

EXAMPLES = T.proof_problems("train", 12, difficulties=(1, 2, 3), seed=0)
ITEMS = T.proof_items(EXAMPLES, corruptions=2, seed=0)


def test_proof_items_carry_the_verdicts_their_kind_implies():
  assert [ex.difficulty for ex in EXAMPLES[:3]] == [1, 2, 3]   # round-robin over difficulties
  by_ex = {}
  for it in ITEMS:
    by_ex.setdefault(it.example.id, []).append(it)
    kinds = set(it.check.kinds)
    # The domain's definitions (opd.tasks.proof_task): a reference is clean; a slip
    # is a wrong step carried to a wrong answer; a dropped line skips a step (minor).
    want = {"reference": (set(), 1.0), "wrong_step": ({"wrong_step", "wrong_final"}, 0.0),
            "missing_step": ({"missing_step"}, 0.5), "wrong_final": ({"wrong_final"}, 0.0)}
    assert (kinds, it.check.score) == want[it.source], (it.source, it.proof)
    assert it.check == check_proof(it.example, it.proof)
  for e, ex in enumerate(EXAMPLES):
    rows = by_ex[ex.id]
    assert rows[0].source == "reference" and rows[0].proof == ex.reference_text
    # Corruption j of example e is kind (e + j) mod 3 when the example admits it.
    admitted = [CORRUPTIONS[(e + j) % 3] for j in range(2)]
    assert [r.source for r in rows[1:]] == [k for k in admitted if k in
                                            {r.source for r in rows[1:]}]
  assert {it.source for it in ITEMS} == {"reference", *CORRUPTIONS}
  with pytest.raises(ValueError, match="corruptions"):
    T.proof_items(EXAMPLES, corruptions=-1, seed=0)


def test_verifier_pairs_are_the_checkers_analyses():
  pairs = T.verifier_pairs(ITEMS)
  assert len(pairs) == len(ITEMS)
  for it, (prompt, target) in zip(ITEMS, pairs):
    assert prompt == verifier_prompt(it.problem, it.proof)
    a = parse_analysis(target)
    assert a.valid and a.score == it.check.score
    assert [(i.line, i.kind) for i in a.issues] == [(i.line, i.kind) for i in it.check.issues]


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_generator_pairs_grade_their_own_proof_honestly(fraction):
  pairs = T.generator_pairs(ITEMS, corrupt_fraction=fraction, seed=1)
  refs = sum(it.source == "reference" for it in ITEMS)
  if fraction == 0.0:
    assert len(pairs) == refs
  elif fraction == 1.0:
    assert len(pairs) == len(ITEMS)
  else:
    assert refs < len(pairs) < len(ITEMS)
  by_prompt = {}
  for it in ITEMS:
    by_prompt.setdefault(T.generator_prompt(it.problem), []).append(it)
  for prompt, target in pairs:
    g = parse_generation(target)
    assert g.valid
    it = next(i for i in by_prompt[prompt] if i.proof == g.proof)
    assert g.analysis.score == check_proof(it.example, g.proof).score


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_refine_pairs_show_a_checked_corrupted_proof_and_target_the_reference(fraction):
  pairs = T.refine_pairs(ITEMS, fraction=fraction, seed=2)
  corrupted = [it for it in ITEMS if it.source != "reference"]
  if fraction == 0.0:
    assert pairs == []
  elif fraction == 1.0:
    assert len(pairs) == len(corrupted)
  else:
    assert 0 < len(pairs) < len(corrupted)
  for prompt, target in pairs:
    # The previous derivation is one of the corrupted proofs; its analysis is the checker's.
    it = next(i for i in corrupted if prompt.startswith(i.problem + "\n") and
              f"Previous derivation:\n{i.proof}\nVerification:\n" in prompt)
    shown = parse_analysis(prompt.split("Verification:\n", 1)[1])
    assert shown.valid and shown.score == it.check.score
    assert [(i.line, i.kind) for i in shown.issues] == [(i.line, i.kind) for i in it.check.issues]
    # The target: the reference proof, which the checker scores 1, graded 1.
    g = parse_generation(target)
    assert g.valid and g.proof == it.example.reference_text and g.analysis.score == 1.0
    assert check_proof(it.example, g.proof).score == 1.0
  with pytest.raises(ValueError, match="fraction"):
    T.refine_pairs(ITEMS, fraction=1.5, seed=0)


def test_meta_pairs_confirm_exactly_the_checkers_issues():
  pairs = T.meta_pairs(ITEMS, noise=0.5, seed=3)
  verdicts_seen = set()
  for it, (prompt, target) in zip(ITEMS, pairs):
    analysis_text = prompt.split("Analysis:\n", 1)[1]
    assert prompt == meta_prompt(it.problem, it.proof, analysis_text)
    a = parse_analysis(analysis_text)
    m = parse_meta(target, len(a.issues))
    truth = {(i.line, i.kind) for i in it.check.issues}
    want = [(i.line, i.kind) in truth for i in a.issues]
    assert list(m.verdicts) == want
    verdicts_seen.update(want)
    # The rule meta-score: 0 with an unconfirmed issue, else 1 iff the score is right.
    assert m.score == (0.0 if not all(want) else 1.0 if a.score == it.check.score else 0.5)
  assert verdicts_seen == {True, False}  # the noise makes issues that are not real


def _episode(example, text, truncated=False):
  z = np.zeros(1, np.int32)
  return Episode(example, z, z, np.ones(1, bool), np.zeros(1, np.float32), [text], truncated)


def _scripted(table):
  calls = []

  def fn(prompts):
    calls.append(list(prompts))
    return [table[p] for p in prompts]

  fn.calls = calls
  return fn


def _meta_text(n_issues, score):
  lines = [f"Issue {i}: real" for i in range(1, n_issues + 1)] or ["No issues stated."]
  return "\n".join(lines + [f"Score: {score:g}"])


@pytest.mark.parametrize("with_meta", [False, True])
def test_verifier_rl_reward_matches_the_formula(with_meta):
  rng = np.random.default_rng(0)
  examples = T.verifier_examples(ITEMS)
  texts, truncated, meta_table, meta_score = [], [], {}, []
  for b, (it, ex) in enumerate(zip(ITEMS, examples)):
    kind = b % 4
    if kind == 0:     # the checker's own analysis
      text = format_analysis(it.check.issues, it.check.score)
    elif kind == 1:   # a random score, one spurious issue
      text = format_analysis([Issue(1, "bad_line")], float(rng.choice([0.0, 0.5, 1.0])))
    elif kind == 2:   # not the grammar
      text = "looks fine to me"
    else:             # valid text, but the sampler cut it
      text = format_analysis((), 1.0)
    texts.append(text)
    truncated.append(kind == 3)
    m = float(rng.choice([0.0, 0.5, 1.0]))
    n = len(parse_analysis(text).issues)
    # Every fourth meta answer has the wrong verdict count: invalid, R_meta = 0.
    meta_table[meta_prompt(it.problem, it.proof, text)] = _meta_text(n + (b % 8 == 4), m)
    meta_score.append(0.0 if b % 8 == 4 else m)
  meta_fn = _scripted(meta_table) if with_meta else None
  got = T.VerifierRLReward(meta_fn)([_episode(ex, t, c) for ex, t, c in
                                      zip(examples, texts, truncated)])
  fmt = np.array([k in (0, 1) for k in (b % 4 for b in range(len(ITEMS)))], float)
  pred = np.array([parse_analysis(t).score if f else 0.0 for t, f in zip(texts, fmt)])
  label = np.array([it.check.score for it in ITEMS])
  want = fmt * (1 - np.abs(pred - label)) * (np.array(meta_score) if with_meta else 1.0)
  np.testing.assert_array_equal([r.reward for r in got], want)
  assert [r.format for r in got] == list(fmt)
  if with_meta:  # only the valid analyses are meta-checked, in one batched call
    assert len(meta_fn.calls) == 1 and len(meta_fn.calls[0]) == int(fmt.sum())
  for b, r in enumerate(got):
    if b % 4 == 0:
      assert r.components["accurate"] == 1.0
      assert r.components.get("faithful", 1.0) == 1.0
    if b % 4 == 1:  # "Line 1: bad_line" is never a checker issue of these proofs
      assert r.components["faithful"] == 0.0
    assert (r.reason == "ok") == bool(fmt[b])


@pytest.mark.parametrize("alpha,beta", [(0.76, 0.24), (0.3, 0.7)])
def test_generator_rl_reward_matches_the_formula(alpha, beta):
  rng = np.random.default_rng(1)
  gens = T.generator_examples(EXAMPLES)
  items = {it.example.id: [] for it in ITEMS}
  for it in ITEMS:
    items[it.example.id].append(it)
  texts, ver_table, meta_table, want, checker = [], {}, {}, [], []
  for b, ex in enumerate(EXAMPLES):
    it = items[ex.id][b % len(items[ex.id])]
    s_self = float(rng.choice([0.0, 0.5, 1.0]))
    z = format_analysis((), s_self) if s_self == 1.0 else format_analysis([Issue(1, "wrong_step")],
                                                                         s_self)
    text = write_generation(it.proof, z) if b % 5 else it.proof  # no Self-evaluation: format 0
    texts.append(text)
    r_y, m = float(rng.choice([0.0, 0.5, 1.0])), float(rng.choice([0.0, 0.5, 1.0]))
    ver_text = format_analysis((), 1.0) if r_y == 1.0 else format_analysis(
        [Issue(2, "wrong_step")], r_y)
    if b % 7 == 3:  # an unparsable verifier answer: R_Y = 0
      ver_text, r_y = "Score: maybe", 0.0
    ver_table[verifier_prompt(ex.prompt, it.proof)] = ver_text
    meta_table[meta_prompt(ex.prompt, it.proof, z)] = _meta_text(len(parse_analysis(z).issues), m)
    fmt = float(b % 5 != 0)
    want.append(fmt * (alpha * r_y + beta * (1 - abs(s_self - r_y)) * m))
    checker.append(check_proof(ex, it.proof).score)
  reward = T.GeneratorRLReward(_scripted(ver_table), _scripted(meta_table), alpha=alpha,
                               beta=beta)
  got = reward([_episode(g, t) for g, t in zip(gens, texts)])
  np.testing.assert_allclose([r.reward for r in got], want, rtol=0,
                             atol=4 * np.finfo(np.float64).eps)
  assert [r.components["checker"] for r in got] == checker   # logged, never rewarded
  assert all(r.format == float(b % 5 != 0) for b, r in enumerate(got))


def test_rewards_refuse_examples_of_another_role():
  with pytest.raises(ValueError, match="not a verifier example"):
    T.VerifierRLReward()([_episode(EXAMPLES[0], "Score: 1")])
  with pytest.raises(ValueError, match="not a generator example"):
    T.GeneratorRLReward(_scripted({}), _scripted({}))([_episode(EXAMPLES[0], "x")])
