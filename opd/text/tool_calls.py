"""Tool calls: the one grammar that rendering and parsing share (docs/DESIGN.md §8).

A call inside an assistant turn is written ``<tool_call>BODY</tool_call>``,
where BODY is the JSON text ``{"name": NAME, "arguments": ARGUMENTS}``:

* a JSON object with exactly the two keys ``name`` and ``arguments``: a
  missing ``arguments`` is as invalid as an extra key;
* ``name`` a non-empty string, ``arguments`` a JSON object;
* only finite numbers (``NaN``/``Infinity`` are not JSON);
* no special token of ``opd.text.tokenizers`` anywhere in BODY (an
  ``<|end|>`` or a ``</tool_call>`` inside a string would end the turn or
  the call early).

``format_tool_call`` writes exactly this (``json.dumps(..., ensure_ascii=False)``)
and refuses, with a ValueError, any call it could not read back as the same
call; ``decode_tool_call`` and ``scan_tool_calls`` are the only readers. The
chat template (``opd.text.chat``: rendering and ``parse_completion``) and the
agent verifier's parser (``opd.text.parsers.parse_tool_calls``) both use
them, so they agree on what a valid call is.

Invalid blocks come back as ``InvalidToolCall`` with a short ``reason``:
``bad_json``, ``bad_schema``, ``special_token``, ``nested_tool_call``,
``unclosed_tool_call`` or ``stray_close_tag`` (a ``</tool_call>`` with no
opening tag). The verifiers turn these into ``malformed:<reason>``.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from opd.text.tokenizers import SPECIAL_TOKENS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

KEYS = ("name", "arguments")


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call: a non-empty ``name`` and a JSON-object ``arguments`` dict.

  Raises:
    ValueError: ``name`` is not a non-empty str or ``arguments`` not a dict.
  """
  name: str
  arguments: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"ToolCall.name must be a non-empty str, got {self.name!r}")
    if not isinstance(self.arguments, dict):
      raise ValueError(f"ToolCall.arguments must be a dict (a JSON object), "
                       f"got {self.arguments!r:.80}")


@dataclasses.dataclass(frozen=True)
class InvalidToolCall:
  """A block that is not a call.

  Attributes:
    raw: the text between ``<tool_call>`` and ``</tool_call>`` (or the end).
    reason: one of the codes of the module docstring.
    detail: a human-readable explanation.
  """
  raw: str
  reason: str
  detail: str = ""


@dataclasses.dataclass(frozen=True)
class ToolCallScan:
  """Every ``<tool_call>`` block of a text, in order.

  Attributes:
    calls: the valid calls.
    invalid: the invalid blocks (and stray closing tags).
    outside: the text outside the blocks, stray closing tags removed.
  """
  calls: tuple[ToolCall, ...]
  invalid: tuple[InvalidToolCall, ...]
  outside: str


def as_tool_call(value: Any) -> ToolCall:
  """A ``ToolCall`` from itself or from a dict with exactly the keys ``name`` and ``arguments``."""
  if isinstance(value, ToolCall):
    return value
  if isinstance(value, Mapping):
    if set(value) != set(KEYS):
      raise ValueError(f"a tool call needs exactly the keys {list(KEYS)}, got {list(value)}")
    return ToolCall(value["name"], value["arguments"])
  raise ValueError(f"a tool call must be a ToolCall or a dict, got {value!r:.80}")


def _reject_constant(name: str):
  raise ValueError(f"non-finite number {name}")


def decode_tool_call(body: str) -> ToolCall | InvalidToolCall:
  """The call whose BODY (the text between the tags) is ``body``; never raises."""
  if TOOL_CALL_OPEN in body:
    return InvalidToolCall(body, "nested_tool_call", f"{TOOL_CALL_OPEN} inside a call")
  special = [t for t in SPECIAL_TOKENS if t in body]
  if special:
    return InvalidToolCall(body, "special_token", f"{special[0]} inside a call")
  try:
    obj = json.loads(body, parse_constant=_reject_constant)
  except (ValueError, RecursionError) as e:
    return InvalidToolCall(body, "bad_json", f"invalid JSON: {e}"[:200])
  if not isinstance(obj, dict):
    return InvalidToolCall(body, "bad_schema", f"expected a JSON object, got {type(obj).__name__}")
  if set(obj) != set(KEYS):
    return InvalidToolCall(body, "bad_schema", f"keys must be {list(KEYS)}, got {sorted(obj)}")
  try:
    return ToolCall(obj["name"], obj["arguments"])
  except ValueError as e:
    return InvalidToolCall(body, "bad_schema", str(e))


def format_tool_call(call: ToolCall | Mapping[str, Any]) -> str:
  """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` for ``call``.

  Raises:
    ValueError: the call breaks the grammar (bad name or arguments, values
      that are not JSON, non-finite numbers, special tokens), or would not
      parse back as the same call (e.g. tuples or non-string keys).
  """
  call = as_tool_call(call)
  try:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False,
                      allow_nan=False)
  except (TypeError, ValueError, RecursionError) as e:
    raise ValueError(f"tool call {call.name!r}: arguments are not JSON ({e})") from None
  back = decode_tool_call(body)
  if isinstance(back, InvalidToolCall):
    raise ValueError(f"tool call {call.name!r} breaks the grammar: {back.detail}")
  if back != call:
    raise ValueError(f"tool call {call.name!r}: arguments {call.arguments!r:.80} do not survive "
                     "a JSON round trip (use lists, str keys and plain JSON values)")
  return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def scan_tool_calls(text: str) -> ToolCallScan:
  """Splits ``text`` into its tool-call blocks and the text outside them; never raises."""
  calls: list[ToolCall] = []
  invalid: list[InvalidToolCall] = []
  outside: list[str] = []
  pos = 0
  while True:
    start = text.find(TOOL_CALL_OPEN, pos)
    piece = text[pos:] if start < 0 else text[pos:start]
    for _ in range(piece.count(TOOL_CALL_CLOSE)):
      invalid.append(InvalidToolCall(TOOL_CALL_CLOSE, "stray_close_tag",
                                     f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}"))
    outside.append(piece.replace(TOOL_CALL_CLOSE, ""))
    if start < 0:
      break
    body_at = start + len(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, body_at)
    if end < 0:
      invalid.append(InvalidToolCall(text[body_at:], "unclosed_tool_call",
                                     f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"))
      break
    decoded = decode_tool_call(text[body_at:end])
    (calls if isinstance(decoded, ToolCall) else invalid).append(decoded)
    pos = end + len(TOOL_CALL_CLOSE)
  return ToolCallScan(tuple(calls), tuple(invalid), "".join(outside))
