"""Chat template: render conversations, parse completions, mask for SFT (docs/DESIGN.md §8).

Format (docs/DEVELOPING.md, "Tokens and chat format")::

  <|system|>You are terse.<|end|>
  <|user|>What is 2+3?<|end|>
  <|assistant|><think>add them</think>Let me check.<tool_call>
      {"name": "calc", "arguments": {"expr": "2+3"}}</tool_call><|end|>
  <|tool|><tool_result>5</tool_result><|end|>
  <|assistant|><think>it said 5</think>5<|end|>

(no newlines or indentation in the real text; tool calls follow the one
grammar of ``opd.text.tool_calls``, which also parses them).
A generation prompt ends with ``<|assistant|>`` in mode "non-think" and with
``<|assistant|><think>`` in mode "high", so the model's completion starts
inside the thinking block; a turn ends at ``<|end|>`` (``STOP_TOKENS``).
Text fields may not contain the special-token strings (``render`` raises).

SFT (``render_for_training``) trains exactly what the model generates after
such a prompt: thinking with its ``</think>``, content, tool calls and the
closing ``<|end|>``.

Interleaved thinking (docs/DESIGN.md §8), applied by every renderer here:
  * a new user message drops the thinking of every earlier assistant turn;
  * after the last user message (one tool-calling trajectory: assistant →
    tool → assistant ...) all thinking is kept across tool calls;
  * boundary control: with ``thinking_budget`` set, the kept thinking blocks
    are counted newest first with ``length_fn`` (chars by default, or
    tokens); every block that would take the total over the budget, and all
    older ones, are replaced by a short summary (the message's
    ``thinking_summary``, else ``summarize(thinking)``);
  * a message with ``closed=True`` is dropped; a closed assistant turn also
    drops the tool turns that directly follow it (its branch's results).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from opd.text.tokenizers import (ASSISTANT, END, EOS, SPECIAL_TOKENS, SYSTEM, THINK_CLOSE,
                            THINK_OPEN, TOOL, TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN, USER)
from opd.text.tool_calls import (InvalidToolCall, ToolCall, as_tool_call, format_tool_call,
                                 scan_tool_calls)

ROLES = ("system", "user", "assistant", "tool")
MODES = ("non-think", "high")
_MARKER = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
STOP_TOKENS = (END, EOS)  # a completion ends at the first of these


@dataclasses.dataclass(frozen=True)
class Message:
  """One turn.

  Attributes:
    role: "system", "user", "assistant" or "tool".
    content: the visible text (for "tool": the environment's reply).
    thinking: assistant only; ``None`` renders no block, ``""`` an empty one.
    tool_calls: assistant only.
    closed: drop this turn (and, for an assistant turn, its tool results).
    thinking_summary: assistant only; replaces ``thinking`` when it falls
      outside the thinking budget.
  """
  role: str
  content: str = ""
  thinking: str | None = None
  tool_calls: tuple[ToolCall, ...] = ()
  closed: bool = False
  thinking_summary: str | None = None


@dataclasses.dataclass(frozen=True)
class ParsedCompletion:
  """What ``parse_completion`` recovers from an assistant completion.

  ``finished`` says whether a stop token was seen; ``errors`` lists every
  irregularity (unterminated blocks, stray markers, bad tool calls).
  """
  thinking: str | None
  content: str
  tool_calls: tuple[ToolCall, ...]
  invalid_tool_calls: tuple[InvalidToolCall, ...]
  finished: bool
  errors: tuple[str, ...]

  def to_message(self) -> Message:
    return Message("assistant", self.content, self.thinking, self.tool_calls)


# ---------------------------------------------------------------------------
# Messages.


def _as_tool_call(tc, where: str) -> ToolCall:
  try:
    return as_tool_call(tc)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def as_message(m, index: int = 0) -> Message:
  """Validates a ``Message`` or an equivalent dict (``tool_calls`` as dicts allowed)."""
  where = f"messages[{index}]"
  if isinstance(m, Mapping):
    fields = {f.name for f in dataclasses.fields(Message)}
    unknown = sorted(set(m) - fields)
    if unknown:
      raise ValueError(f"{where} has unknown key(s) {unknown}; known: {sorted(fields)}")
    if "role" not in m:
      raise ValueError(f"{where} has no 'role'")
    m = Message(**{**m, "tool_calls": tuple(m.get("tool_calls") or ())})
  elif not isinstance(m, Message):
    raise ValueError(f"{where} must be a Message or dict, got {type(m).__name__}")
  if m.role not in ROLES:
    raise ValueError(f"{where}.role={m.role!r} is not one of {ROLES}")
  if not isinstance(m.content, str):
    raise ValueError(f"{where}.content must be a str, got {type(m.content).__name__}")
  if m.role != "assistant":
    for name in ("thinking", "thinking_summary"):
      if getattr(m, name) is not None:
        raise ValueError(f"{where}.{name} is only allowed on assistant turns (role={m.role!r})")
    if m.tool_calls:
      raise ValueError(f"{where}.tool_calls is only allowed on assistant turns (role={m.role!r})")
  for name in ("thinking", "thinking_summary"):
    value = getattr(m, name)
    if value is not None and not isinstance(value, str):
      raise ValueError(f"{where}.{name} must be a str or None, got {type(value).__name__}")
  calls = tuple(_as_tool_call(tc, f"{where}.tool_calls[{k}]")
                for k, tc in enumerate(m.tool_calls))
  return dataclasses.replace(m, tool_calls=calls)


def from_raw(messages: Sequence[Mapping[str, str]]) -> list[Message]:
  """Structured messages from raw ``{"role", "content"}`` dicts whose
  assistant content is model text (inline ``<think>``/``<tool_call>`` blocks),
  as the task suite (``opd.tasks``) writes its references.

  Raises ValueError when an assistant text does not parse cleanly or would
  not render back to exactly the same string — a reference the model is
  trained on must be byte-identical to what it would have to generate.
  """
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
      raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content', got {m!r:.80}")
    if m["role"] != "assistant":
      out.append(as_message(dict(m), i))
      continue
    raw = m["content"]
    if not isinstance(raw, str):
      raise ValueError(f"messages[{i}].content must be a str, got {type(raw).__name__}")
    parsed = parse_completion(raw)
    if parsed.errors or parsed.finished:
      raise ValueError(f"messages[{i}].content does not parse as one assistant turn: "
                       f"{list(parsed.errors) or ['contains a stop token']} in {raw!r:.120}")
    message = parsed.to_message()
    rendered = "".join(seg.text for seg in render_segments([message]))
    expected = ASSISTANT + raw + END
    if rendered != expected:
      raise ValueError(f"messages[{i}].content does not round-trip through the chat format: "
                       f"{raw!r:.120} renders as {rendered[len(ASSISTANT):-len(END)]!r:.120}")
    out.append(message)
  return out


def _check_plain(text: str, where: str) -> str:
  for tok in SPECIAL_TOKENS:
    if tok in text:
      raise ValueError(f"{where} contains the special token {tok!r}, which would break the "
                       "chat format")
  return text


def _tool_call_text(call: ToolCall, where: str) -> str:
  try:
    return format_tool_call(call)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------
# Rendering.


@dataclasses.dataclass(frozen=True)
class Segment:
  """A piece of rendered text; ``generated`` marks what the assistant produced."""
  text: str
  message_index: int | None  # None for the generation prompt
  generated: bool
  in_trajectory: bool = False  # after the last kept user message


def default_summary(thinking: str, max_chars: int = 80) -> str:
  """A short stand-in for old thinking: its first ``max_chars`` characters."""
  flat = " ".join(thinking.split())
  return flat if len(flat) <= max_chars else flat[:max_chars].rstrip() + " …"


def _thinking_plan(msgs: Sequence[Message | None], last_user: int, thinking_budget,
                   length_fn) -> dict[int, str]:
  """Message index → "full" | "summary" | "none" for kept assistant turns with thinking."""
  plan, used = {}, 0
  over = False
  for i in range(len(msgs) - 1, -1, -1):
    m = msgs[i]
    if m is None or m.role != "assistant" or m.thinking is None:
      continue
    if i < last_user:
      plan[i] = "none"
      continue
    if thinking_budget is not None and not over:
      used += length_fn(m.thinking)
      over = used > thinking_budget
    plan[i] = "summary" if over else "full"
  return plan


def _kept(msgs: Sequence[Message]) -> list[Message | None]:
  """Closed turns (and the tool turns answering a closed assistant turn) become None."""
  out: list[Message | None] = list(msgs)
  dropping_results = False
  for i, m in enumerate(msgs):
    if m.closed:
      out[i] = None
      # A closed tool turn inside a closed branch keeps the branch closing.
      dropping_results = m.role == "assistant" or (m.role == "tool" and dropping_results)
    elif m.role == "tool" and dropping_results:
      out[i] = None
    else:
      dropping_results = False
  return out


def render_segments(messages: Sequence[Any], *, add_generation_prompt: bool = False,
                    mode: str = "high", thinking_budget: int | None = None,
                    length_fn: Callable[[str], int] = len,
                    summarize: Callable[[str], str] = default_summary) -> list[Segment]:
  """Renders a conversation as segments (see the module docstring for the rules).

  Args:
    messages: ``Message``s or dicts.
    add_generation_prompt: append ``<|assistant|>`` (+ ``<think>`` in "high").
    mode: "non-think" or "high"; only changes the generation prompt.
    thinking_budget: cap on kept thinking, in ``length_fn`` units.
    length_fn: measures a thinking block (``len`` = chars; pass
      ``lambda s: len(tok.encode(s))`` for tokens).
    summarize: builds a summary for a turn without ``thinking_summary``.

  Raises:
    ValueError: bad messages, unknown mode, or text containing special tokens.
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} is not one of {MODES}")
  if thinking_budget is not None and thinking_budget < 0:
    raise ValueError(f"thinking_budget={thinking_budget} must be >= 0")
  msgs = [as_message(m, i) for i, m in enumerate(messages)]
  kept = _kept(msgs)
  last_user = max((i for i, m in enumerate(kept) if m is not None and m.role == "user"),
                  default=-1)
  plan = _thinking_plan(kept, last_user, thinking_budget, length_fn)
  segs: list[Segment] = []
  for i, m in enumerate(kept):
    if m is None:
      continue
    where = f"messages[{i}]"
    seg = lambda text, generated, i=i: Segment(text, i, generated, i > last_user)
    content = _check_plain(m.content, f"{where}.content")
    if m.role == "tool":
      segs.append(seg(f"{TOOL}{TOOL_RESULT_OPEN}{content}{TOOL_RESULT_CLOSE}{END}", False))
      continue
    if m.role != "assistant":
      segs.append(seg(f"{_MARKER[m.role]}{content}{END}", False))
      continue
    segs.append(seg(ASSISTANT, False))
    show = plan.get(i, "none")
    if show == "full":
      # <think> belongs to the prompt: in mode "high" the generation prompt supplies it.
      segs.append(seg(THINK_OPEN, False))
      thinking = _check_plain(m.thinking, f"{where}.thinking")
      segs.append(seg(f"{thinking}{THINK_CLOSE}", True))
    elif show == "summary":
      summary = m.thinking_summary if m.thinking_summary is not None else summarize(m.thinking)
      summary = _check_plain(summary, f"{where}.thinking_summary")
      segs.append(seg(f"{THINK_OPEN}{summary}{THINK_CLOSE}", False))
    calls = "".join(_tool_call_text(c, f"{where}.tool_calls[{k}]")
                    for k, c in enumerate(m.tool_calls))
    segs.append(seg(f"{content}{calls}{END}", True))
  if add_generation_prompt:
    segs.append(Segment(ASSISTANT + (THINK_OPEN if mode == "high" else ""), None, False))
  return segs


def render(messages: Sequence[Any], *, add_generation_prompt: bool = False,
           mode: str = "high", **kwargs) -> str:
  """The conversation as one string (``render_segments`` joined)."""
  return "".join(s.text for s in render_segments(
      messages, add_generation_prompt=add_generation_prompt, mode=mode, **kwargs))


def generation_prompt(messages: Sequence[Any], mode: str = "high", **kwargs) -> str:
  """``render`` plus the assistant marker (and ``<think>`` in mode "high")."""
  return render(messages, add_generation_prompt=True, mode=mode, **kwargs)


def render_for_training(messages: Sequence[Any], tokenizer=None, *,
                        train_on: str = "trajectory", add_bos: bool = True, **kwargs):
  """Text (or token ids) plus the SFT loss mask over assistant-generated spans.

  Trainable: each assistant turn's thinking with its ``</think>``, content,
  tool calls and closing ``<|end|>`` — exactly what the model generates after
  the generation prompt. Not trainable: role markers, ``<think>`` openers,
  summarised thinking, system / user / tool turns.

  Args:
    messages: the conversation.
    tokenizer: ``None`` for a per-character mask, else a tokenizer
      (``opd.text.tokenizers``); segments are tokenized one by one so the mask is
      exact.
    train_on: "trajectory" trains only the assistant turns after the last
      user message (earlier ones are rendered without their thinking, i.e.
      not as they were generated); "all" trains every kept assistant turn.
    add_bos: prepend BOS (tokenizer only; never trainable).
    **kwargs: ``render_segments`` options (``thinking_budget``, ...).

  Returns:
    ``(text, mask [len(text)] bool)`` without a tokenizer, else
    ``(ids [T] int32, mask [T] bool)``.
  """
  if train_on not in ("trajectory", "all"):
    raise ValueError(f"train_on={train_on!r} must be 'trajectory' or 'all'")
  segs = render_segments(messages, **kwargs)
  trainable = [s.generated and (train_on == "all" or s.in_trajectory) for s in segs]
  if tokenizer is None:
    text = "".join(s.text for s in segs)
    mask = np.concatenate([np.full(len(s.text), t, bool) for s, t in zip(segs, trainable)]
                          or [np.zeros(0, bool)])
    return text, mask
  ids = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
  mask = [False] * len(ids)
  for s, t in zip(segs, trainable):
    piece = tokenizer.encode(s.text)
    ids.extend(piece)
    mask.extend([t] * len(piece))
  return np.asarray(ids, np.int32), np.asarray(mask, bool)


# ---------------------------------------------------------------------------
# Parsing.


def parse_completion(text: str, mode: str = "non-think") -> ParsedCompletion:
  """Splits an assistant completion into thinking, content and tool calls.

  Never raises on malformed text: irregularities go to ``errors`` and bad
  tool calls to ``invalid_tool_calls``.

  Args:
    text: what the model generated after the generation prompt.
    mode: the generation prompt's mode; in "high" the completion starts
      inside the thinking block. In "non-think" a leading ``<think>`` is still
      understood.
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} is not one of {MODES}")
  errors: list[str] = []
  stops = [(text.find(t), t) for t in STOP_TOKENS if t in text]
  finished = bool(stops)
  if stops:
    cut, tok = min(stops)
    if text[cut + len(tok):].strip():
      errors.append(f"text after {tok} ignored")
    text = text[:cut]
  thinking = None
  if mode == "high" or text.lstrip().startswith(THINK_OPEN):
    start = 0 if mode == "high" else text.index(THINK_OPEN) + len(THINK_OPEN)
    close = text.find(THINK_CLOSE, start)
    if close < 0:
      thinking, text = text[start:], ""
      errors.append("unterminated thinking block (no </think>)")
    else:
      thinking, text = text[start:close], text[close + len(THINK_CLOSE):]
    if THINK_OPEN in thinking:
      errors.append("nested <think> inside thinking")
  scan = scan_tool_calls(text)
  for tok in SPECIAL_TOKENS:
    if tok in scan.outside:
      errors.append(f"stray {tok} in content")
  errors.extend(f"invalid tool call: {c.reason} ({c.detail})" for c in scan.invalid)
  return ParsedCompletion(thinking, scan.outside, scan.calls, scan.invalid, finished,
                          tuple(errors))


_TURN = re.compile("(" + "|".join(re.escape(t) for t in (SYSTEM, USER, ASSISTANT, TOOL)) + ")")


def parse_conversation(text: str) -> list[Message]:
  """Recovers the turns of a rendered conversation (inverse of ``render``).

  Text before the first role marker (e.g. BOS) is ignored; a trailing
  unfinished assistant turn (a generation prompt) is returned as parsed so
  far. Never raises.
  """
  inverse = {v: k for k, v in _MARKER.items()}
  parts = _TURN.split(text)
  out = []
  for k in range(1, len(parts), 2):
    role, body = inverse[parts[k]], parts[k + 1]
    if role == "assistant":
      p = parse_completion(body)
      out.append(p.to_message())
      continue
    body = body[:body.index(END)] if END in body else body
    if role == "tool" and body.startswith(TOOL_RESULT_OPEN) and body.endswith(TOOL_RESULT_CLOSE):
      body = body[len(TOOL_RESULT_OPEN):-len(TOOL_RESULT_CLOSE)]
    out.append(Message(role, body))
  return out
