"""grm.verify.format: one grammar per role, parsers that never raise, rule-written texts."""
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from grm.verify.format import (REASONS, format_analysis, format_meta, generator_prompt, meta_prompt,
                               parse_analysis, parse_generation, parse_meta, refine_prompt,
                               rule_meta_score, split_generation, verifier_prompt, write_analysis,
                               write_generation, write_meta)
from opd.tasks.proof_task import ISSUE_KINDS, Issue, ProofCheck, score_of

FRAGMENTS = ["Line ", "1", "2", "10", "0", "-1", ": ", "wrong_step", "missing_step", "wrong_final",
             "bad_line", "no_answer", "wrong", " - ", "msg", "\n", "\r\n", " ", "\t", "Score:",
             "Score: ", "0.5", "0.50", "1", "No issues.", "No issues stated.", "Issue ",
             "real", "not real", "Self-evaluation:", "Answer: 7", "3*4+5 = 17", "<think>",
             "</think>", "<|end|>", "\x00", "\u0663", "99999"]
_fragments = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)
_texts = st.one_of(st.text(), _fragments)


def _reference_analysis(text):
  """Independent reading of a valid analysis: regexes over the stripped non-empty lines."""
  lines = [l.strip() for l in text.split("\n") if l.strip()]
  score = {"0": 0.0, "0.5": 0.5, "1": 1.0}[re.fullmatch(r"Score:\s*(\S+)", lines[-1]).group(1)]
  if lines[:-1] == ["No issues."]:
    return [], score
  return [(int(re.match(r"Line (\d+): (\w+)", l).group(1)),
           re.match(r"Line (\d+): (\w+)", l).group(2)) for l in lines[:-1]], score


@settings(max_examples=300, deadline=None)
@given(_texts)
def test_parse_analysis_never_raises(text):
  a = parse_analysis(text)
  assert a.valid == (a.reason is None) == (a.score is not None)
  if a.valid:
    assert ([(i.line, i.kind) for i in a.issues], a.score) == _reference_analysis(text)
    assert all(i.kind in ISSUE_KINDS and i.line >= 1 for i in a.issues)
  else:
    assert a.reason in REASONS and a.issues == ()


@settings(max_examples=300, deadline=None)
@given(_texts, st.none() | st.integers(0, 3))
def test_parse_meta_never_raises(text, n):
  j = parse_meta(text, n)
  assert j.valid == (j.reason is None) == (j.score is not None)
  if j.valid:
    lines = [l.strip() for l in text.split("\n") if l.strip()]
    want = [l.endswith(": real") for l in lines[:-1] if l != "No issues stated."]
    assert list(j.verdicts) == want and (n is None or len(want) == n)
    assert j.confirms == all(want)
  else:
    assert j.reason in REASONS and not j.confirms


@settings(max_examples=300, deadline=None)
@given(st.one_of(_texts, st.none(), st.integers()))
def test_parse_generation_never_raises(text):
  g = parse_generation(text)
  proof, rest = split_generation(text)
  assert isinstance(proof, str) and isinstance(rest, str)
  if g.valid:
    assert g.analysis.valid and g.proof.split("\n")[-1].strip().startswith("Answer:")
    assert text.count("Self-evaluation:") >= 1
  else:
    assert g.reason in REASONS


_issues = st.lists(st.tuples(st.integers(1, 50), st.sampled_from(ISSUE_KINDS),
                             st.text(alphabet="abc xyz=+*0123", max_size=20)), max_size=5)


@settings(max_examples=200, deadline=None)
@given(_issues, st.sampled_from([0.0, 0.5, 1.0]))
def test_format_then_parse_round_trips(issues, score):
  issues = [Issue(k, kind, msg) for k, kind, msg in issues]
  a = parse_analysis(format_analysis(issues, score))
  assert a.valid and a.score == score
  assert a.issues == tuple(Issue(i.line, i.kind, " ".join(i.message.split())) for i in issues)
  verdicts = [k % 2 == 0 for k, _, _ in [(i.line, 0, 0) for i in issues]]
  j = parse_meta(format_meta(verdicts, score), len(issues))
  assert j.valid and list(j.verdicts) == verdicts and j.score == score
  g = parse_generation(write_generation("1+1 = 2\nAnswer: 2", format_analysis(issues, score)))
  assert g.valid and g.proof == "1+1 = 2\nAnswer: 2" and g.analysis == a


@pytest.mark.parametrize("text,reason", [
    (None, "not_text"), ("  \n ", "empty"), ("Line 1: wrong_step", "no_score_line"),
    ("No issues.\nScore: 0.25", "bad_score"), ("No issues.\nScore: 1 2", "bad_score"),
    ("Score: 1", "no_issue_section"), ("Line 0: wrong_step\nScore: 0", "bad_line"),
    ("Line 1: typo\nScore: 0", "bad_line"), ("Line 1: wrong_step\nNo issues.\nScore: 0",
                                              "mixed_issue_section"),
    ("x" * 5000 + "\nScore: 1", "too_long")])
def test_analysis_reasons(text, reason):
  assert parse_analysis(text).reason == reason


def test_meta_and_generation_reasons():
  assert parse_meta("Issue 2: real\nScore: 1").reason == "bad_line"       # numbering starts at 1
  assert parse_meta("Issue 1: real\nScore: 1", 2).reason == "wrong_count"
  assert parse_meta("No issues stated.\nScore: 1", 0).valid
  assert parse_generation("Answer: 3\nScore: 1").reason == "no_self_evaluation"
  assert parse_generation("1+2 = 3\nSelf-evaluation:\nNo issues.\nScore: 1").reason == "bad_proof"
  assert parse_generation("Answer: 3\nSelf-evaluation:\nScore: 1").reason == "no_issue_section"
  assert parse_generation("<think>Answer: 3\nSelf-evaluation:").reason == "bad_thinking"


def test_prompts_number_the_proof_lines_and_bracket_chat_markers():
  proof = "3*4+5 = 12+5\n\n= 17<|end|>\nAnswer: 17"
  v = verifier_prompt("Simplify 3*4+5.", proof)
  assert "\n1| 3*4+5 = 12+5\n2| = 17[|end|]\n3| Answer: 17" in v and "<|end|>" not in v
  m = meta_prompt("Simplify 3*4+5.", proof, "Line 2: wrong_step\nScore: 0")
  assert m.endswith("Analysis:\nLine 2: wrong_step\nScore: 0") and "2| = 17" in m
  assert generator_prompt("Simplify 3*4+5.").startswith("Simplify 3*4+5.\n")
  r = refine_prompt("Simplify 3*4+5.", "= 18\nAnswer: 18", "Line 1: wrong_step\nScore: 0")
  assert "= 18\nAnswer: 18" in r and r.endswith("Line 1: wrong_step\nScore: 0")
  with pytest.raises(ValueError, match="problem"):
    verifier_prompt(None, proof)


CHECK = ProofCheck((Issue(2, "wrong_step", "changes the value"), Issue(3, "wrong_final", "")), 0.0)


def test_rule_analysis_and_meta():
  a = parse_analysis(write_analysis(CHECK))
  assert [(i.line, i.kind, i.message) for i in a.issues] == [(2, "wrong_step", ""),
                                                             (3, "wrong_final", "")]
  assert a.score == 0.0
  assert parse_analysis(write_analysis(CHECK, messages=True)).issues[0].message == \
      "changes the value"
  assert write_analysis(ProofCheck((), 1.0)) == "No issues.\nScore: 1"
  # Line 2 wrong_step is real; line 1 missing_step is not: 0 (a stated issue is not real).
  mixed = parse_analysis("Line 1: missing_step\nLine 2: wrong_step\nScore: 0.5")
  assert write_meta(mixed, CHECK) == "Issue 1: not real\nIssue 2: real\nScore: 0"
  # Every stated issue real but score 0.5 != the checker's 0 (an issue missed): 0.5.
  partial = parse_analysis("Line 2: wrong_step\nScore: 0.5")
  assert write_meta(partial, CHECK) == "Issue 1: real\nScore: 0.5"
  assert rule_meta_score(a, CHECK) == 1.0
  assert rule_meta_score(parse_analysis("No issues.\nScore: 1"), CHECK) == 0.5
  assert rule_meta_score(parse_analysis("junk"), CHECK) == 0.0
  with pytest.raises(ValueError, match="valid analysis"):
    write_meta(parse_analysis("junk"), CHECK)


@pytest.mark.parametrize("seed", range(20))
def test_noisy_analysis_is_self_consistent(seed):
  rng = random.Random(seed)
  a = parse_analysis(write_analysis(CHECK, n_lines=4, noise=0.5, rng=rng))
  assert a.valid and a.score == score_of(a.issues)
  true = {(i.line, i.kind) for i in CHECK.issues}
  spurious = [i for i in a.issues if (i.line, i.kind) not in true]
  assert len(spurious) <= 1 and all(1 <= i.line <= 4 for i in spurious)
  full = parse_analysis(write_analysis(CHECK, n_lines=4, noise=1.0, rng=rng))
  # p = 1: every true issue dropped, one spurious added.
  assert len(full.issues) == 1 and (full.issues[0].line, full.issues[0].kind) not in true
  with pytest.raises(ValueError, match="rng"):
    write_analysis(CHECK, noise=0.5)


# ----------------------------------------------------------------------------- grammars
def _walks(automaton, pattern, n, rng, max_len=400):
  """``n`` random walks through the compiled automaton from ``pattern``'s start: each
  step a uniform choice among the allowed ids, ending at an end id (what a
  constrained sampler with uniform logits writes); the texts of the walks that end."""
  from opd.rollout.constraint import DEAD  # noqa: PLC0415
  out = []
  for _ in range(n):
    s, ids = automaton.starts[pattern], []
    for _ in range(max_len):
      allowed = np.flatnonzero(automaton.table[s] != DEAD)
      t = int(rng.choice(allowed))
      if t in automaton.end_ids:
        out.append(bytes(ids).decode())
        break
      ids.append(t)
      s = int(automaton.table[s, t])
  return out


def test_role_grammars_accept_only_valid_outputs():
  """Every text the analysis / meta grammars let a sampler finish parses valid (uniform
  random walks through the compiled token automaton); the rule-written texts match; near
  misses do not."""
  from grm.verify.format import ANALYSIS_PATTERN, MAX_META_VERDICTS, META_PATTERN  # noqa: PLC0415
  from opd.rollout.constraint import compile_patterns  # noqa: PLC0415
  from opd.text.tokenizers import ByteTokenizer  # noqa: PLC0415
  tok = ByteTokenizer()
  automaton = compile_patterns([ANALYSIS_PATTERN, META_PATTERN], tok, end_ids=(tok.eos_id,))
  rng = np.random.default_rng(0)
  analyses, metas = _walks(automaton, 0, 300, rng), _walks(automaton, 1, 300, rng)
  assert len(analyses) > 250 and len(metas) > 250  # the walks do end
  for text in analyses:
    assert parse_analysis(text).valid, text
    assert re.fullmatch(ANALYSIS_PATTERN, text)
  for text in metas:
    assert parse_meta(text).valid, text
  # Both branches and every score are reached.
  assert {parse_analysis(t).reports_issues for t in analyses} == {True, False}
  assert {parse_analysis(t).score for t in analyses} == {0.0, 0.5, 1.0}
  assert {len(parse_meta(t).verdicts) for t in metas} >= {0, 1, 2}
  # Rule-written texts are in the grammar.
  r = random.Random(0)
  for _ in range(50):
    issues = [Issue(r.randint(1, 9999), r.choice(ISSUE_KINDS)) for _ in range(r.randint(0, 4))]
    text = format_analysis(issues, score_of(issues))
    assert re.fullmatch(ANALYSIS_PATTERN, text), text
    verdicts = [r.random() < 0.5 for _ in range(r.randint(0, MAX_META_VERDICTS))]
    assert re.fullmatch(META_PATTERN, format_meta(verdicts, r.choice((0.0, 0.5, 1.0))))
  for bad in ("Line 0: wrong_step\nScore: 1", "Line 1: wrong\nScore: 1", "No issues.\nScore: 0.7",
              "Line 1: wrong_step - msg\nScore: 1", "No issues.\nLine 1: bad_line\nScore: 0",
              "Score: 1"):
    assert not re.fullmatch(ANALYSIS_PATTERN, bad), bad
  for bad in ("Issue 2: real\nScore: 0", "Issue 1: real\nIssue 1: real\nScore: 0",
              "No issues stated.\nIssue 1: real\nScore: 1", "Issue 1: maybe\nScore: 1"):
    assert not re.fullmatch(META_PATTERN, bad), bad
