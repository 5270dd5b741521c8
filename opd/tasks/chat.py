"""Chat rendering of task conversations (docs/DEVELOPING.md "Tokens and chat format").

A turn renders as ``<|role|>content<|end|>``; a tool turn's content is
wrapped as ``<tool_result>...</tool_result>``. No ``<|bos|>``/``<|eos|>``:
``opd.data.lm_dataset`` adds those per document. Example::

  <|user|>What is 3 + 4?<|end|><|assistant|>Answer: 7<|end|>

``render_segments`` returns the same text cut into ``(text, trained)``
pieces so an SFT pipeline with any tokenizer can build its loss mask: the
assistant's content and its closing ``<|end|>`` are trained, everything else
(role headers, user and tool turns) is context.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from opd.tasks.base import ROLES

END = "<|end|>"
TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE = "<tool_result>", "</tool_result>"


def role_header(role: str) -> str:
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  return f"<|{role}|>"


def _content(message: Mapping[str, str]) -> tuple[str, str]:
  if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
    raise ValueError(f"a message must be a mapping with 'role' and 'content', got {message!r}")
  role, content = message["role"], message["content"]
  if not isinstance(content, str):
    raise ValueError(f"message content must be str, got {type(content).__name__}")
  role_header(role)
  if role == "tool":
    content = f"{TOOL_RESULT_OPEN}{content}{TOOL_RESULT_CLOSE}"
  return role, content


def render_segments(messages: Sequence[Mapping[str, str]], *,
                    add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
  """``(text, trained)`` pieces whose concatenation is ``render_messages``."""
  pieces: list[tuple[str, bool]] = []
  for message in messages:
    role, content = _content(message)
    if role == "assistant":
      pieces += [(role_header(role), False), (content + END, True)]
    else:
      pieces.append((role_header(role) + content + END, False))
  if add_generation_prompt:
    pieces.append((role_header("assistant"), False))
  return pieces


def render_messages(messages: Sequence[Mapping[str, str]], *,
                    add_generation_prompt: bool = False) -> str:
  """The conversation as one string; optionally opens an assistant turn."""
  return "".join(text for text, _ in render_segments(
      messages, add_generation_prompt=add_generation_prompt))
