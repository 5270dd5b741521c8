r"""The pointwise GRM's prompt and its one output grammar (docs/DESIGN.md §6).

**Prompt.** A query and n >= 1 responses, shown in a seeded random order
(``build_prompt``); ``GRMPrompt.order[p]`` is the original index of the
response shown as "Response p+1". The prompt is one user turn of the chat
format (``prompt_ids`` opens the assistant turn after it)::

  <instruction>

  [Query]
  <query>
  [End of Query]

  [Response 1]
  <response>
  [End of Response 1]
  ...
  (blank line, "The best response is: Response j": hinted sampling only)

A block is opened and closed only by its exact marker line. The text inside
is escaped (``escape_block``) so that nothing a query or response holds can
be read as the frame: a line that, after leading whitespace and backslashes,
starts like a marker (``[Query``, ``[End of``, ``[Response``), a scores line
(``Scores:``) or a hint (``The best response is``) gets one more backslash
after its leading whitespace. A forged ``[End of Response 1]`` or
``Scores: \boxed{10, 1}`` inside a response is thus shown as
``\[End of Response 1]`` / ``\Scores: \boxed{10, 1}``: it cannot close its
block, open another, or pass as a judgement's scores line. ``read_prompt``
reads a prompt back with the same grammar (``unescape_block`` undoes the
escape exactly).

**Output grammar.** What the GRM writes, what ``format_judgement`` renders as
an SFT target and what ``grm.parse.parse_judgement`` reads back::

  Principles:
  Principle 1 (weight 60%): The final answer must be correct.
  Principle 2: The explanation should be short.
  Critique:
  Response 1 gets the answer right ... Response 2 ...
  Scores: \boxed{7, 3}

Principle lines are ``Principle i: text`` or ``Principle i (weight W%): text``
(W an integer percentage, 0..100). The critique is free text over any number
of lines. The **last line** decides: ``Scores: \boxed{s_1, ..., s_n}``, one
integer in 1..10 per response, **in the order the responses were shown**;
``unshuffle`` maps them back to the original order. Spaces or tabs around
the numbers and commas are allowed; nothing may follow the line except
whitespace. Principles and critique are never required for a sample to be
valid (the score line is; there is no format reward, docs/DESIGN.md §6).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from opd import tasks as tasks_lib
from opd.text.tokenizers import SPECIAL_TOKENS

SCORES_PREFIX = "Scores:"
PRINCIPLES_HEADER = "Principles:"
CRITIQUE_HEADER = "Critique:"
MIN_SCORE, MAX_SCORE = 1, 10
HINT_PREFIX = "The best response is: Response "

# Short on purpose: it opens every prompt the GRM reads (SFT, sampling, RL,
# meta-RM) and the models are byte-level, so each character is a token.
_INSTRUCTION = (
    "Judge the {n} responses. Write \"Principles:\" and one principle per line "
    "(\"Principle 1 (weight 30%): ...\"), then \"Critique:\" and a critique of each "
    "response, then a last line \"Scores: \\boxed{{s_1, ..., s_n}}\": one score in 1..10 "
    "per response, in the order shown.")


# What an escaped line may start with: leading whitespace, then backslashes,
# then the start of something the frame or the judgement grammar reads.
_FRAME_STARTS = ("[Query", "[End of", "[Response", SCORES_PREFIX, HINT_PREFIX.split(":")[0])
_FRAME_ALT = "|".join(re.escape(x) for x in _FRAME_STARTS)
_TO_ESCAPE = re.compile(r"(\s*)(\\*(?:" + _FRAME_ALT + "))")
_ESCAPED = re.compile(r"(\s*)\\(\\*(?:" + _FRAME_ALT + "))")


@dataclasses.dataclass(frozen=True)
class Principle:
  """One judging principle; ``weight`` is an integer percentage or None."""
  text: str
  weight: int | None = None


@dataclasses.dataclass(frozen=True)
class GRMPrompt:
  """A rendered GRM prompt.

  Attributes:
    text: the user message (instruction, query, responses in shown order).
    order: ``[n]`` permutation; ``order[p]`` is the original index of the
      response shown at position p ("Response p+1").
    hint: shown position (1-based) named by a hint line, or None.
  """
  text: str
  order: tuple[int, ...]
  hint: int | None = None

  @property
  def n(self) -> int:
    return len(self.order)


def permutation(n: int, seed) -> tuple[int, ...]:
  """A seeded permutation of ``range(n)`` (``np.random.default_rng(seed)``).

  ``seed`` is anything ``default_rng`` takes, e.g. ``(run_seed, example,
  sample)``, so every (example, sample) draws its own order; ``None`` gives
  the identity (no shuffling).
  """
  n = check_n(n)
  if seed is None:
    return tuple(range(n))
  return tuple(int(i) for i in np.random.default_rng(seed).permutation(n))


def check_n(n) -> int:
  """``n`` (a response count) as an int, or ValueError unless it is an int >= 1."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n={n!r} must be an int >= 1 (the number of responses)")
  return int(n)


def _check_order(order: Sequence[int], n: int | None = None) -> tuple[int, ...]:
  order = tuple(int(i) for i in order)
  if sorted(order) != list(range(len(order))) or (n is not None and len(order) != n):
    raise ValueError(f"order={order} must be a permutation of range({n if n is not None else len(order)})")
  return order


def plain(text: str) -> str:
  """``text`` with each chat special-token string shown in brackets
  (``<tool_call>`` -> ``[tool_call]``, ``<|end|>`` -> ``[|end|]``), so a
  response with thinking or tool calls can sit inside a user turn."""
  for tok in SPECIAL_TOKENS:
    text = text.replace(tok, "[" + tok[1:-1] + "]")
  return text


def escape_block(text: str) -> str:
  """``text`` as it is shown inside a prompt block (module docstring): each
  line that could be read as a marker, a scores line or a hint gets one more
  backslash after its leading whitespace; other lines are unchanged."""
  return "\n".join(_TO_ESCAPE.sub(r"\1\\\2", line, count=1) if _TO_ESCAPE.match(line)
                   else line for line in text.split("\n"))


def unescape_block(text: str) -> str:
  """The inverse of ``escape_block``: ``unescape_block(escape_block(t)) == t``."""
  return "\n".join(_ESCAPED.sub(r"\1\2", line, count=1) if _ESCAPED.match(line) else line
                   for line in text.split("\n"))


def _shown(text: str) -> str:
  return escape_block(plain(text.strip()))


def build_prompt(query: str, responses: Sequence[str], *, seed=None,
                 hint_best: int | None = None) -> GRMPrompt:
  """The GRM prompt for ``query`` and its responses, shown in a seeded order.

  Args:
    query: the user's request.
    responses: n >= 1 response texts, in their original order. Chat
      special-token strings in the query and responses are bracketed
      (``plain``) and their lines escaped (``escape_block``).
    seed: ``permutation``'s seed; None shows them in the original order.
    hint_best: original index of the best response; when given, the line
      "The best response is: Response j" (j its shown position) ends the
      prompt (hinted sampling of rejective fine-tuning).

  Returns:
    A ``GRMPrompt``.
  """
  if not isinstance(query, str):
    raise ValueError(f"query must be a str, got {type(query).__name__}")
  if isinstance(responses, str) or not all(isinstance(r, str) for r in responses):
    raise ValueError(f"responses must be a sequence of str, got {responses!r:.80}")
  n = check_n(len(responses))
  order = permutation(n, seed)
  parts = [_INSTRUCTION.format(n=n), "", "[Query]", _shown(query), "[End of Query]"]
  for p, i in enumerate(order):
    parts += ["", f"[Response {p + 1}]", _shown(responses[i]), f"[End of Response {p + 1}]"]
  hint = None
  if hint_best is not None:
    if isinstance(hint_best, bool) or not isinstance(hint_best, (int, np.integer)) or not (
        0 <= hint_best < n):
      raise ValueError(f"hint_best={hint_best!r} must be an index in [0, {n})")
    hint = order.index(int(hint_best)) + 1
    parts += ["", f"{HINT_PREFIX}{hint}"]
  return GRMPrompt(text="\n".join(parts), order=order, hint=hint)


def read_prompt(text: str) -> tuple[str, tuple[str, ...], int | None]:
  """Reads a ``build_prompt`` text back: ``(query, responses, hint)``.

  Blocks are found by their exact marker lines (module docstring), so a
  response is read back whole whatever markers it held; the texts come back
  unescaped (as ``plain`` showed them, stripped), the responses in the
  **shown** order, ``hint`` the hinted shown position (1-based) or None.

  Raises:
    ValueError: ``text`` is not a prompt of this grammar (naming the line).
  """
  if not isinstance(text, str):
    raise ValueError(f"text must be a str, got {type(text).__name__}")
  lines = text.split("\n")
  pos = 2

  def fail(what: str):
    shown = repr(lines[pos]) if pos < len(lines) else "the end of the text"
    raise ValueError(f"read_prompt: expected {what} at line {pos + 1}, found {shown:.80}")

  def block(opening: str, closing: str) -> str:
    nonlocal pos
    if pos >= len(lines) or lines[pos] != opening:
      fail(repr(opening))
    try:
      end = lines.index(closing, pos + 1)
    except ValueError:
      pos = len(lines)
      fail(repr(closing))
    body = unescape_block("\n".join(lines[pos + 1:end]))
    pos = end + 1
    return body

  if len(lines) < 2 or lines[1] != "":
    fail("the instruction line and a blank line")
  query = block("[Query]", "[End of Query]")
  responses = []
  while pos + 1 < len(lines) and lines[pos] == "" and lines[pos + 1].startswith("[Response "):
    pos += 1
    responses.append(block(f"[Response {len(responses) + 1}]",
                           f"[End of Response {len(responses) + 1}]"))
  if not responses:
    fail("'[Response 1]' after a blank line")
  if lines[0] != _INSTRUCTION.format(n=len(responses)):
    pos = 0
    fail(f"the instruction for n={len(responses)} responses")
  hint = None
  if pos + 1 < len(lines) and lines[pos] == "" and lines[pos + 1].startswith(HINT_PREFIX):
    pos += 1
    digits = lines[pos][len(HINT_PREFIX):]
    if not (digits.isascii() and digits.isdigit() and 1 <= int(digits) <= len(responses)):
      fail(f"a hint naming a response in 1..{len(responses)}")
    hint = int(digits)
    pos += 1
  if pos != len(lines):
    fail("the end of the prompt")
  return query, tuple(responses), hint


def prompt_messages(prompt: GRMPrompt) -> list[dict[str, str]]:
  """The prompt as raw chat messages (one user turn)."""
  return [{"role": "user", "content": prompt.text}]


def user_prompt_ids(tokenizer, text: str) -> np.ndarray:
  """``[P]`` int32 ids: BOS, one user turn holding ``text``, the opened assistant turn."""
  rendered = tasks_lib.render_messages([{"role": "user", "content": text}],
                                       add_generation_prompt=True)
  return np.asarray(tokenizer.encode(rendered, add_bos=True), np.int32)


def prompt_ids(tokenizer, prompt: GRMPrompt) -> np.ndarray:
  """``[P]`` int32 ids of a GRM prompt (``user_prompt_ids``)."""
  return user_prompt_ids(tokenizer, prompt.text)


def shuffle(values: Sequence, order: Sequence[int]) -> tuple:
  """Original order -> shown order: ``shown[p] = values[order[p]]``."""
  order = _check_order(order, len(values))
  return tuple(values[i] for i in order)


def unshuffle(shown: Sequence, order: Sequence[int]) -> tuple:
  """Shown order -> original order: ``original[order[p]] = shown[p]``.

  Raises:
    ValueError: ``order`` is not a permutation of ``range(len(shown))``.
  """
  order = _check_order(order, len(shown))
  out = [None] * len(shown)
  for p, i in enumerate(order):
    out[i] = shown[p]
  return tuple(out)


def format_scores(scores: Sequence[int]) -> str:
  r"""The final line, ``Scores: \boxed{7, 3}``; each score an int in 1..10."""
  scores = tuple(scores)
  if not scores:
    raise ValueError("scores must hold at least one score")
  for i, s in enumerate(scores):
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not (
        MIN_SCORE <= s <= MAX_SCORE):
      raise ValueError(f"scores[{i}]={s!r} must be an int in [{MIN_SCORE}, {MAX_SCORE}]")
  return SCORES_PREFIX + " \\boxed{" + ", ".join(str(int(s)) for s in scores) + "}"


def format_principle(index: int, principle: Principle) -> str:
  """``Principle i: text`` or ``Principle i (weight W%): text`` (i 1-based)."""
  text = principle.text.strip() if isinstance(principle.text, str) else principle.text
  if not isinstance(text, str) or not text or "\n" in text:
    raise ValueError(f"principle {index} text={principle.text!r:.80} must be a non-empty "
                     "one-line str")
  w = principle.weight
  if w is None:
    return f"Principle {index}: {text}"
  if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or not 0 <= w <= 100:
    raise ValueError(f"principle {index} weight={w!r} must be an int percentage in [0, 100]")
  return f"Principle {index} (weight {int(w)}%): {text}"


def format_judgement(principles: Sequence[Principle | str], critique: str,
                     scores: Sequence[int]) -> str:
  """A judgement text in the output grammar (module docstring); SFT targets.

  Args:
    principles: ``Principle``s or plain strings (unweighted), one line each.
    critique: free text; leading and trailing whitespace is dropped.
    scores: one int in 1..10 per response, in the **shown** order.

  Returns:
    The text, ending with the scores line (no trailing newline).
  """
  if not isinstance(critique, str):
    raise ValueError(f"critique must be a str, got {type(critique).__name__}")
  lines = [PRINCIPLES_HEADER]
  for i, p in enumerate(principles):
    lines.append(format_principle(i + 1, p if isinstance(p, Principle) else Principle(p)))
  lines.append(CRITIQUE_HEADER)
  if critique.strip():
    lines.append(critique.strip())
  lines.append(format_scores(scores))
  return "\n".join(lines)
