"""Chat template: format, render → parse round trips, thinking rules, SFT masks."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opd.text import chat
from opd.text.chat import Message
from opd.text.tool_calls import ToolCall
from opd.text.tokenizers import SPECIAL_TOKENS, ByteTokenizer

TOK = ByteTokenizer()


def _call_json(name, args):
  return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def test_render_matches_documented_format():
  msgs = [
      {"role": "system", "content": "Be terse."},
      {"role": "user", "content": "2+3?"},
      {"role": "assistant", "thinking": "use calc", "content": "Checking.",
       "tool_calls": [{"name": "calc", "arguments": {"expr": "2+3"}}]},
      {"role": "tool", "content": "5"},
      {"role": "assistant", "thinking": "", "content": "5"},
  ]
  expected = ("<|system|>Be terse.<|end|>" "<|user|>2+3?<|end|>"
              "<|assistant|><think>use calc</think>Checking."
              "<tool_call>" + _call_json("calc", {"expr": "2+3"}) + "</tool_call><|end|>"
              "<|tool|><tool_result>5</tool_result><|end|>"
              "<|assistant|><think></think>5<|end|>")
  assert chat.render(msgs) == expected
  assert chat.generation_prompt(msgs, mode="high") == expected + "<|assistant|><think>"
  assert chat.generation_prompt(msgs, mode="non-think") == expected + "<|assistant|>"
  # Every marker in the format is one token of the byte tokenizer.
  assert TOK.decode(TOK.encode(expected)) == expected
  assert sum(i in TOK.special_ids for i in TOK.encode(expected)) == sum(
      expected.count(t) for t in SPECIAL_TOKENS) == 18


_plain = st.text(max_size=12).filter(lambda s: not any(t in s for t in SPECIAL_TOKENS))
_json = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | _plain,
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_plain, kids,
                                                                                max_size=3),
                     max_leaves=5)
_calls = st.lists(st.builds(ToolCall, st.text(min_size=1, max_size=6).filter(
    lambda s: not any(t in s for t in SPECIAL_TOKENS)), st.dictionaries(_plain, _json,
                                                                        max_size=3)), max_size=2)
_assistant = st.builds(Message, st.just("assistant"), _plain, st.none() | _plain,
                       _calls.map(tuple))
_tool = st.builds(Message, st.just("tool"), _plain)


@settings(max_examples=60, deadline=None)
@given(st.booleans(), _plain, st.lists(st.one_of(_assistant, _tool), min_size=1, max_size=5))
def test_render_parse_round_trip(with_system, user, trajectory):
  # Everything after the (only) user message keeps its thinking, so parsing
  # the rendering must give back the very same turns.
  msgs = ([Message("system", "sys")] if with_system else []) + [Message("user", user)]
  msgs += trajectory
  assert chat.parse_conversation(chat.render(msgs)) == msgs


@settings(max_examples=60, deadline=None)
@given(_assistant)
def test_completion_parses_back_in_both_modes(msg):
  full = chat.render([msg])
  assert full.startswith("<|assistant|>")
  completion = full[len("<|assistant|>"):]
  if msg.thinking is not None:
    # Mode "high": the prompt already holds <think>.
    parsed = chat.parse_completion(completion[len("<think>"):], mode="high")
  else:
    parsed = chat.parse_completion(completion, mode="non-think")
  assert parsed.to_message() == msg
  assert parsed.finished and parsed.errors == () and parsed.invalid_tool_calls == ()


def _thinking_by_turn(text):
  return [m.thinking for m in chat.parse_conversation(text) if m.role == "assistant"]


def test_new_user_message_drops_earlier_thinking_but_tool_trajectory_keeps_it():
  call = ToolCall("search", {"q": "x"})
  msgs = [Message("user", "q1"),
          Message("assistant", "a1", thinking="T1"),
          Message("user", "q2"),
          Message("assistant", "", thinking="T2", tool_calls=(call,)),
          Message("tool", "r1"),
          Message("assistant", "", thinking="T3", tool_calls=(call,)),
          Message("tool", "r2"),
          Message("assistant", "a2", thinking="T4")]
  assert _thinking_by_turn(chat.render(msgs)) == [None, "T2", "T3", "T4"]
  # Continuing the trajectory after a tool result keeps all of it ...
  # (the trailing generation prompt opens an empty thinking block)
  assert _thinking_by_turn(chat.generation_prompt(msgs[:-1])) == [None, "T2", "T3", ""]
  # ... and a new user message drops all of it.
  prompt = chat.generation_prompt(msgs + [Message("user", "q3")], mode="high")
  assert _thinking_by_turn(prompt) == [None, None, None, None, ""]
  assert "T2" not in prompt and "T4" not in prompt and prompt.endswith("<|assistant|><think>")


def test_thinking_budget_replaces_old_thinking_with_summary():
  t_old, t_mid, t_new = "a" * 10, "b" * 20, "c" * 30
  msgs = [Message("user", "go"),
          Message("assistant", "", thinking=t_old, tool_calls=(ToolCall("f"),),
                  thinking_summary="looked at a"),
          Message("tool", "1"),
          Message("assistant", "", thinking=t_mid, tool_calls=(ToolCall("f"),)),
          Message("tool", "2"),
          Message("assistant", "done", thinking=t_new)]
  # Newest first: 30 + 20 = 50 <= 55, + 10 = 60 > 55 -> only the oldest goes.
  assert _thinking_by_turn(chat.render(msgs, thinking_budget=55)) == [
      "looked at a", t_mid, t_new]
  # Budget 49: the middle block goes too and, lacking a summary, gets the default one.
  assert _thinking_by_turn(chat.render(msgs, thinking_budget=49)) == [
      "looked at a", chat.default_summary(t_mid), t_new]
  assert _thinking_by_turn(chat.render(msgs)) == [t_old, t_mid, t_new]
  # The budget can be in tokens: "é" is 2 bytes, so 20 chars are 40 tokens here.
  msgs[3] = Message("assistant", "", thinking="é" * 20, tool_calls=(ToolCall("f"),))
  by_tokens = chat.render(msgs, thinking_budget=69, length_fn=lambda s: len(TOK.encode(s)))
  assert _thinking_by_turn(by_tokens)[1] == chat.default_summary("é" * 20)
  assert len(chat.default_summary("word " * 100)) < 90


def test_closed_branches_are_dropped():
  msgs = [Message("user", "find it"),
          Message("assistant", "", thinking="try A", tool_calls=(ToolCall("a"),), closed=True),
          Message("tool", "dead end"),
          Message("tool", "closed anyway", closed=True),
          Message("tool", "also dead"),
          Message("assistant", "", thinking="try B", tool_calls=(ToolCall("b"),)),
          Message("tool", "found"),
          Message("user", "ignore me", closed=True),
          Message("assistant", "it is B", thinking="B worked")]
  text = chat.render(msgs)
  for gone in ("try A", "dead end", "closed anyway", "also dead", "ignore me"):
    assert gone not in text
  kept = chat.parse_conversation(text)
  assert [m.role for m in kept] == ["user", "assistant", "tool", "assistant"]
  # The closed user message does not count as "new": B's thinking stays.
  assert [m.thinking for m in kept if m.role == "assistant"] == ["try B", "B worked"]


def _true_runs(text, mask):
  assert len(text) == len(mask)
  runs, start = [], None
  for k, m in enumerate(list(mask) + [False]):
    if m and start is None:
      start = k
    elif not m and start is not None:
      runs.append(text[start:k])
      start = None
  return runs


TRAIN_MSGS = [
    Message("system", "sys"),
    Message("user", "q1"),
    Message("assistant", "old answer", thinking="old thoughts"),
    Message("user", "q2"),
    Message("assistant", "", thinking="plan", tool_calls=(ToolCall("calc", {"x": 1}),)),
    Message("tool", "42"),
    Message("assistant", "the answer is 42", thinking="read result"),
]


def test_render_for_training_masks_exactly_the_generated_spans():
  text, mask = chat.render_for_training(TRAIN_MSGS)
  assert text == chat.render(TRAIN_MSGS)
  expected = ["plan</think><tool_call>" + _call_json("calc", {"x": 1}) + "</tool_call><|end|>",
              "read result</think>the answer is 42<|end|>"]
  assert _true_runs(text, mask) == expected
  # Prompts, tool output, role markers and <think> openers are not trained.
  for k in range(len(text)):
    if text.startswith(("<|user|>", "<|tool|>", "<|assistant|>", "<think>", "42</tool_result>"),
                       k):
      assert not mask[k], text[k:k + 15]
  # train_on="all" also trains the earlier turn, rendered without thinking.
  text, mask = chat.render_for_training(TRAIN_MSGS, train_on="all")
  assert _true_runs(text, mask) == ["old answer<|end|>"] + expected


def test_render_for_training_token_mask_matches_char_mask():
  text, char_mask = chat.render_for_training(TRAIN_MSGS)
  ids, mask = chat.render_for_training(TRAIN_MSGS, TOK)
  assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
  # Segment-wise tokenization equals tokenizing the whole string (plus BOS).
  assert ids.tolist() == TOK.encode(text, add_bos=True)
  # Decoding the trainable runs gives the same spans as the character mask.
  runs, cur = [], []
  for i, m in zip(ids.tolist() + [None], mask.tolist() + [False]):
    if m:
      cur.append(i)
    elif cur:
      runs.append(TOK.decode(cur))
      cur = []
  assert runs == _true_runs(text, char_mask)
  assert not mask[0] and ids[0] == TOK.bos_id
  # Summarised thinking is not trainable.
  msgs = TRAIN_MSGS[:4] + [Message("assistant", "ok", thinking="x" * 50, thinking_summary="s")]
  text, mask = chat.render_for_training(msgs, thinking_budget=10)
  assert _true_runs(text, mask) == ["ok<|end|>"] and "<think>s</think>" in text


def test_parse_completion_reports_problems_without_raising():
  p = chat.parse_completion('hmm</think>ok<tool_call>{"name": "f", "arguments": {"a": 1}}'
                            '</tool_call><tool_call>{bad json</tool_call><|end|>junk',
                            mode="high")
  assert p.thinking == "hmm" and p.content == "ok" and p.finished
  assert p.tool_calls == (ToolCall("f", {"a": 1}),)
  assert len(p.invalid_tool_calls) == 1 and p.invalid_tool_calls[0].raw == "{bad json"
  assert p.invalid_tool_calls[0].reason == "bad_json"
  assert any("after <|end|>" in e for e in p.errors)

  p = chat.parse_completion("still thinking", mode="high")
  assert p.thinking == "still thinking" and p.content == "" and not p.finished
  assert any("unterminated thinking" in e for e in p.errors)

  p = chat.parse_completion('x<tool_call>{"arguments": {}}</tool_call></tool_call>'
                            '<tool_call>{"name": "g"')
  assert p.thinking is None and p.content == "x" and p.tool_calls == ()
  assert [c.reason for c in p.invalid_tool_calls] == [
      "bad_schema", "stray_close_tag", "unclosed_tool_call"]
  assert len(p.errors) == 3 and all(e.startswith("invalid tool call: ") for e in p.errors)

  p = chat.parse_completion("a</think>b<|user|>c")
  assert any("stray </think>" in e for e in p.errors)
  assert any("stray <|user|>" in e for e in p.errors)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=6), st.sampled_from(SPECIAL_TOKENS + ("{", '"name"'))),
                max_size=12), st.sampled_from(chat.MODES))
def test_parse_never_raises_on_garbage(pieces, mode):
  text = "".join(pieces)
  p = chat.parse_completion(text, mode=mode)
  assert isinstance(p.content, str)
  chat.parse_conversation(text)


@pytest.mark.parametrize("msg,match", [
    ({"role": "robot", "content": "x"}, r"messages\[0\].role='robot'"),
    ({"role": "user", "content": "x", "thinking": "t"}, r"messages\[0\].thinking"),
    ({"role": "tool", "content": "x", "tool_calls": [{"name": "f"}]}, r"tool_calls"),
    ({"role": "user", "content": "hi<|end|>"}, r"messages\[0\].content contains .*<\|end\|>"),
    ({"role": "assistant", "content": "", "thinking": "a</think>"}, r"thinking contains"),
    ({"role": "user", "text": "x"}, r"unknown key\(s\) \['text'\]"),
    ({"role": "assistant", "tool_calls": [{"name": "f", "arguments": {1j}}]}, "JSON"),
    ({"role": "assistant", "tool_calls": [{"args": {}}]}, r"tool_calls\[0\]"),
    ({"role": "user", "content": 3}, r"content must be a str"),
])
def test_bad_messages_raise(msg, match):
  with pytest.raises(ValueError, match=match):
    chat.render([msg])


def test_bad_options_raise():
  with pytest.raises(ValueError, match="mode='max'"):
    chat.render([], mode="max")
  with pytest.raises(ValueError, match="mode='low'"):
    chat.parse_completion("", mode="low")
  with pytest.raises(ValueError, match="train_on='some'"):
    chat.render_for_training([], train_on="some")
  with pytest.raises(ValueError, match="thinking_budget=-1"):
    chat.render([], thinking_budget=-1)
