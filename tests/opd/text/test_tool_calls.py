"""The one tool-call grammar: rendering and both parsers (chat.parse_completion
and the agent verifier's parsers.parse_tool_calls) agree on every string."""
import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from opd.text import chat, parsers
from opd.text.tokenizers import END, EOS, SPECIAL_TOKENS
from opd.text.tool_calls import (InvalidToolCall, ToolCall, decode_tool_call, format_tool_call,
                                 scan_tool_calls)

PROPERTY = settings(max_examples=150, deadline=None)

_plain = st.text(st.characters(blacklist_characters="\x00"), max_size=8).filter(
    lambda s: not any(t in s for t in SPECIAL_TOKENS))
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=False, allow_infinity=False) | _plain,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_plain, kids, max_size=3),
    max_leaves=8)
_calls = st.builds(ToolCall, _plain.filter(bool), st.dictionaries(_plain, _json, max_size=3))
# Pieces of the grammar glued at random: what a half-trained model writes.
_FRAGMENTS = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', ":",
              ",", '"f"', '""', "1", "-0.5", "NaN", "Infinity", "null", "true", " ", '"', "\\",
              "<|end|>", "<think>", "\x00", '{"name": "f", "arguments": {}}']
_garbage = st.one_of(st.text(max_size=40),
                     st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=3), max_size=25)
                     .map("".join))


def _chat_valid(text):
  p = chat.parse_completion(text)
  return p.tool_calls[0] if len(p.tool_calls) == 1 and not p.invalid_tool_calls else None


def _verifier_valid(text):
  p = parsers.parse_tool_calls(text)
  return p.calls[0] if len(p.calls) == 1 and not p.errors else None


@PROPERTY
@given(_calls, st.booleans())
def test_rendered_call_parses_back_in_both_parsers(call, thinking):
  text = format_tool_call(call)
  assert text == f"<tool_call>{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}</tool_call>"
  assert _chat_valid(text) == call and _verifier_valid(text) == call
  # The agent environment reads the same call out of a whole turn.
  turn = ("<think>plan</think>" if thinking else "") + text
  assert parsers.parse_assistant_turn(turn).call == call
  # And the chat template renders a message holding it to the same text.
  msg = chat.Message("assistant", "", tool_calls=(call,))
  assert chat.render([msg]) == f"<|assistant|>{text}<|end|>"
  assert chat.parse_conversation(chat.render([msg]))[0].tool_calls == (call,)


@PROPERTY
@given(_garbage)
def test_parsers_agree_on_any_call_body(body):
  """Whatever sits between the tags, both parsers accept it or both reject it,
  and an accepted call re-renders to a text that parses to itself.

  A body holding a stop token is left to the test below: the completion
  parser reads only up to the first stop token, by design."""
  assume(END not in body and EOS not in body)
  text = f"<tool_call>{body}</tool_call>"
  got_chat, got_verifier = _chat_valid(text), _verifier_valid(text)
  assert got_chat == got_verifier
  decoded = decode_tool_call(body)
  assert (got_chat is not None) == isinstance(decoded, ToolCall)
  if got_chat is not None:
    assert _chat_valid(format_tool_call(got_chat)) == got_chat


@pytest.mark.parametrize("stop", [END, EOS])
def test_a_stop_token_ends_what_the_completion_parser_reads(stop):
  """Found by hypothesis on CI: ``<tool_call>CALL</tool_call><|end|></tool_call>``.
  The completion ends at the stop token, so chat reads one valid call; the
  verifier, given the whole string, also sees the stray close tag. On the text
  up to the stop token they agree again."""
  call = '{"name": "f", "arguments": {}}'
  head = f"<tool_call>{call}</tool_call>"
  text = f"{head}{stop}</tool_call>"
  assert _chat_valid(text) == ToolCall("f", {})
  assert chat.parse_completion(text).finished
  assert parsers.parse_tool_calls(text).errors == ("stray_close_tag",)
  assert _verifier_valid(head) == _chat_valid(head) == ToolCall("f", {})


@PROPERTY
@given(_garbage)
def test_parsers_find_the_same_calls_in_any_text(text):
  """On any text both parsers would read whole (no stop token, no leading
  thinking block, within the verifier's size limit) they find the same calls
  and the same invalid blocks; nothing raises."""
  p = chat.parse_completion(text)
  v = parsers.parse_tool_calls(text)
  if END in text or EOS in text or text.lstrip().startswith("<think>") or "\x00" in text:
    return
  assert p.tool_calls == v.calls
  assert tuple(c.reason for c in p.invalid_tool_calls) == v.errors
  assert p.content.strip() == v.outside


@pytest.mark.parametrize("body,reason", [
    ('{"name": "f"}', "bad_schema"),                       # arguments missing
    ('{"name": "f", "arguments": null}', "bad_schema"),
    ('{"name": "f", "arguments": [1]}', "bad_schema"),
    ('{"name": "f", "arguments": "x"}', "bad_schema"),
    ('{"name": "", "arguments": {}}', "bad_schema"),
    ('{"name": 3, "arguments": {}}', "bad_schema"),
    ('{"name": "f", "arguments": {}, "id": 1}', "bad_schema"),
    ('["f", {}]', "bad_schema"),
    ('{"name": "f", "arguments": {"x": NaN}}', "bad_json"),
    ('{"name": "f", "arguments": {"x": Infinity}}', "bad_json"),
    ("{name: f}", "bad_json"),
    ("[" * 5000, "bad_json"),
    ('{"name": "f", "arguments": {"x": "<think>"}}', "special_token"),
    ('<tool_call>{"name": "f", "arguments": {}}', "nested_tool_call"),
])
def test_invalid_bodies_have_one_reason_everywhere(body, reason):
  decoded = decode_tool_call(body)
  assert isinstance(decoded, InvalidToolCall) and decoded.reason == reason, decoded
  text = f"<tool_call>{body}</tool_call>"
  assert chat.parse_completion(text).tool_calls == ()
  assert [c.reason for c in chat.parse_completion(text).invalid_tool_calls] == [reason]
  if len(text) <= parsers.MAX_RESPONSE_CHARS:
    assert parsers.parse_tool_calls(text).errors == (reason,)
    # The turn is malformed (a stray <think> is caught before the call is read).
    assert parsers.parse_assistant_turn(text).kind == "malformed"


def test_scan_reports_unclosed_and_stray_tags_in_order():
  scan = scan_tool_calls('a</tool_call>b<tool_call>{"name": "f", "arguments": {}}</tool_call>'
                         'c<tool_call>{"name"')
  assert scan.calls == (ToolCall("f", {}),)
  assert [c.reason for c in scan.invalid] == ["stray_close_tag", "unclosed_tool_call"]
  assert scan.outside == "abc"


@pytest.mark.parametrize("make,match", [
    (lambda: ToolCall("", {}), "ToolCall.name must be a non-empty str, got ''"),
    (lambda: ToolCall("f", [1]), r"ToolCall.arguments must be a dict"),
    (lambda: format_tool_call({"name": "f"}), r"exactly the keys \['name', 'arguments'\]"),
    (lambda: format_tool_call(ToolCall("f", {"x": math.nan})), "not JSON"),
    (lambda: format_tool_call(ToolCall("f", {"x": {1j}})), "not JSON"),
    (lambda: format_tool_call(ToolCall("f", {"x": (1, 2)})), "JSON round trip"),
    (lambda: format_tool_call(ToolCall("f", {1: "x"})), "JSON round trip"),
    (lambda: format_tool_call(ToolCall("f", {"x": "done<|end|>"})), r"<\|end\|> inside a call"),
    (lambda: format_tool_call(ToolCall("f</tool_call>", {})), "inside a call"),
])
def test_format_refuses_calls_outside_the_grammar(make, match):
  with pytest.raises(ValueError, match=match):
    make()
