"""Parsers: exact behaviour on known inputs, and never an exception on any input."""
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd.text import parsers
from opd.text.tool_calls import ToolCall

# Fragments of the response grammar, glued at random: much closer to what a
# half-trained model emits than uniform random text.
FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "Answer:", "Answer: ", " ",
             "\n", "{", "}", "[", "]", '"name"', '"arguments"', ":", ",", '"lookup"', '"key"',
             '"x"', "42", "-", "/", "0", "1/0", "3.5", "1e999", "NaN", "Infinity", "\u0663",
             "<|end|>", "<|assistant|>", "<tool_result>", "def f(x):", " return x", "```python\n",
             "```", "\x00", "null", "true", '"', "\\", "9" * 40]
garbage = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=30).map("".join),
)
anything = st.one_of(garbage, st.none(), st.integers(), st.binary(max_size=20),
                     st.lists(st.text(max_size=3), max_size=3))
PROPERTY = settings(max_examples=200, deadline=None)


@PROPERTY
@given(anything)
def test_no_parser_ever_raises(text):
  results = [parsers.split_thinking(text), parsers.parse_final_answer(text),
             parsers.parse_tool_calls(text), parsers.parse_assistant_turn(text),
             parsers.extract_python_function(text, "f", 1)]
  assert parsers.parse_number(text) is None or isinstance(parsers.parse_number(text), Fraction)
  thinking, answer, calls, turn, code = results
  assert thinking.ok or thinking.reason != "ok"
  assert answer.ok == (answer.value is not None)
  assert all(isinstance(c, ToolCall) for c in calls.calls)
  assert turn.kind in ("tool_call", "answer", "malformed")
  assert code.ok == (code.source is not None)


@PROPERTY
@given(garbage)
def test_garbage_is_malformed(text):
  """Without the answer marker there is no answer; without tags no tool call."""
  text = text.replace("Answer:", "").replace("<tool_call>", "")
  assert not parsers.parse_final_answer(text).ok
  assert parsers.parse_assistant_turn(text).kind == "malformed"
  assert parsers.parse_tool_calls(text).calls == ()


@PROPERTY
@given(st.fractions(max_denominator=10**6).filter(lambda f: abs(f) < 10**20),
       st.one_of(st.none(), st.text(st.characters(blacklist_characters="<>\x00"), max_size=30)))
def test_answer_round_trip(value, thinking):
  text = parsers.format_answer(value)
  if thinking is not None:
    text = f"<think>{thinking}</think>{text}"
  parsed = parsers.parse_final_answer(text)
  assert parsed.ok and parsed.value == value, (text, parsed)
  assert parsers.parse_assistant_turn(text).kind == "answer"


@pytest.mark.parametrize("text,value", [
    ("Answer: 12", 12), ("Answer:12", 12), ("  Answer: -3  \n", -3), ("Answer: 6/4", Fraction(3, 2)),
    ("Answer: 0.25", Fraction(1, 4)), ("<think>7+5=12</think>Answer: 12", 12),
    ("First 7 + 5.\nAnswer: 12", 12), ("Answer: +5/6", Fraction(5, 6)),
])
def test_answers_that_parse(text, value):
  parsed = parsers.parse_final_answer(text)
  assert parsed.ok and parsed.value == Fraction(value), parsed


@pytest.mark.parametrize("text,reason", [
    ("12", "no_answer"), ("The answer is 12.", "no_answer"), ("Answer: 1/0", "bad_number"),
    ("Answer: 1e3", "bad_number"), ("Answer: \u0663", "bad_number"), ("Answer: " + "9" * 31, "bad_number"),
    ("Answer: 1\nAnswer: 2", "multiple_answers"), ("Answer: 12 apples", "bad_answer_line"),
    ("Answer: 12\nthanks", "bad_answer_line"), ("<think>Answer: 3", "unclosed_think"),
    ("Answer: 3</think>", "stray_think_tag"), ("Answer: 3<|end|>", "special_token"),
    ("Answer: 3" + " " * 5000, "too_long"), ("Answer: 3\x00", "nul_byte"),
])
def test_answers_that_do_not_parse(text, reason):
  parsed = parsers.parse_final_answer(text)
  assert not parsed.ok and parsed.reason == reason


def test_format_number_is_canonical():
  assert parsers.format_number(Fraction(6, 4)) == "3/2"
  assert parsers.format_number(Fraction(-8, 2)) == "-4"
  assert parsers.format_answer(7) == "Answer: 7"


def _call(name, arguments):
  return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize("text,kind,reason", [
    (_call("lookup", {"key": "pear"}), "tool_call", "ok"),
    ("<think>need pear</think>" + _call("lookup", {"key": "pear"}), "tool_call", "ok"),
    ('<tool_call>{"name":"lookup","arguments":{"key":"pear"}}</tool_call>', "tool_call", "ok"),
    ("Answer: 7", "answer", "ok"),
    (_call("lookup", {"key": "pear"}) * 2, "malformed", "multiple_tool_calls"),
    ("Sure! " + _call("lookup", {"key": "pear"}), "malformed", "text_outside_tool_call"),
    ('<tool_call>{"name": "lookup"}</tool_call>', "malformed", "bad_schema"),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "malformed", "bad_schema"),
    ('<tool_call>{"name": "a", "arguments": {}, "x": 1}</tool_call>', "malformed", "bad_schema"),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "malformed", "bad_schema"),
    ('<tool_call>{"name": "a", "arguments": {"v": NaN}}</tool_call>', "malformed", "bad_json"),
    ("<tool_call>{not json}</tool_call>", "malformed", "bad_json"),
    ("<tool_call>" + "[" * 3000 + "</tool_call>", "malformed", "bad_json"),
    ('<tool_call>{"name": "a", "arguments": {}}', "malformed", "unclosed_tool_call"),
    ("<tool_call><tool_call>{}</tool_call></tool_call>", "malformed", "nested_tool_call"),
    ("</tool_call>", "malformed", "stray_close_tag"),
    (_call("a", {}) + "Answer: 3", "malformed", "text_outside_tool_call"),
    ("hello", "malformed", "no_answer"),
    ("", "malformed", "no_answer"),
])
def test_assistant_turns(text, kind, reason):
  turn = parsers.parse_assistant_turn(text)
  assert (turn.kind, turn.reason) == (kind, reason)
  if kind == "tool_call":
    assert turn.call == ToolCall("lookup", {"key": "pear"})


@pytest.mark.parametrize("text,n_args,ok,reason", [
    ("def f(x): return x*2+1", 1, True, "ok"),
    ("```python\ndef f(x, y):\n  return x + y\n```", 2, True, "ok"),
    ("<think>double it</think>def f(x): return 2*x", 1, True, "ok"),
    ("def g(x): return x\ndef f(x): return g(x)", 1, True, "ok"),
    ("def f(x): return x", 2, False, "wrong_arity:1"),
    ("def g(x): return x", 1, False, "no_function_f"),
    ("import os\ndef f(x): return x", 1, False, "top_level_Import"),
    ("def f(x): return x\nprint(f(1))", 1, False, "top_level_Expr"),
    ("def f(*a): return a", 1, False, "bad_signature"),
    ("def f(x=1): return x", 1, False, "bad_signature"),
    ("def f(x) return x", 1, False, "syntax_error"),
    ("(" * 1500 + ")" * 1500, 1, False, "syntax_error"),
    ("   ", 1, False, "empty"),
])
def test_extract_python_function(text, n_args, ok, reason):
  code = parsers.extract_python_function(text, "f", n_args)
  assert (code.ok, code.reason) == (ok, reason)


def test_extract_python_function_keeps_syntax_warnings_quiet():
  """``1if x else 2`` parses with a SyntaxWarning on stderr (Python 3.11); a
  model writes such code often, and each warning landed in the demo's log."""
  import warnings
  src = "def f(x):\n  return 1if x else 2"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compile(src, "<model>", "exec", flags=0x400)  # ast.PyCF_ONLY_AST: the warning exists
  assert any(issubclass(w.category, SyntaxWarning) for w in caught)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    code = parsers.extract_python_function(src, "f", 1)
  assert code.ok and not caught
