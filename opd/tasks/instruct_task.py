"""Instruction following: short word lists under verifiable constraints.

Prompt: ``Write N words about TOPIC.`` plus 1-3 stated constraints, e.g.
``Write 3 words about the sea. Use lowercase only. Include 'fish'.``
Response: the words on one line, e.g. ``fish wave calm``.

Constraints (all stated in the prompt, each checked by a rule): word count,
topic (at least half the words from the topic's word list), case (lower /
upper / capitalised), include a word, avoid a word, start with a word, end
with a punctuation mark, comma-separated. Reward: the fraction of
constraints met, so near-misses get partial credit. Format reward: 1 iff the
response is one non-empty line of printable ASCII (after optional thinking);
otherwise reward 0.

Difficulty d: d extra constraints beyond count and topic; N is 2-4 words at
d = 1, 3-6 at d = 2, 4-8 at d = 3.
"""
from __future__ import annotations

import math
import random
import re

from opd.tasks.base import Draft, Example, Reward, Task, malformed, response_body
from opd.tasks.vocab import TOPICS, topic_words

_WORD_RE = re.compile(r"[A-Za-z]+")
_CASES = {"lower": "Use lowercase only.", "upper": "Use uppercase only.",
          "title": "Capitalize every word."}
_ENDS = {"!": "End with '!'.", ".": "End with '.'.", "?": "End with '?'."}
_N_WORDS = {1: (2, 4), 2: (3, 6), 3: (4, 8)}
MAX_CHARS = 200


def _apply_case(word: str, case: str | None) -> str:
  return {"upper": word.upper(), "title": word.capitalize()}.get(case, word)


def _words(text: str) -> list[str]:
  return _WORD_RE.findall(text)


def check_constraint(c: dict, text: str) -> bool:
  """Whether ``text`` (the visible response) meets constraint ``c``."""
  words = _words(text)
  lower = [w.lower() for w in words]
  kind = c["kind"]
  if kind == "count":
    return len(words) == c["n"]
  if kind == "topic":
    vocab = set(topic_words(c["topic"]))
    return bool(words) and sum(w in vocab for w in lower) >= math.ceil(len(words) / 2)
  if kind == "case":
    if not words:
      return False
    if c["case"] == "lower":
      return all(w == w.lower() for w in words)
    if c["case"] == "upper":
      return all(w == w.upper() for w in words)
    return all(w == w.capitalize() for w in words)
  if kind == "include":
    return c["word"] in lower
  if kind == "exclude":
    return bool(words) and c["word"] not in lower
  if kind == "start":
    return bool(lower) and lower[0] == c["word"]
  if kind == "end":
    return text.rstrip().endswith(c["char"])
  if kind == "commas":
    body = text.strip().rstrip("!.?")
    items = body.split(", ")
    return len(items) == len(words) >= 2 and all(_WORD_RE.fullmatch(i) for i in items)
  raise ValueError(f"unknown constraint kind {kind!r}")


def _prompt_of(c: dict) -> str:
  kind = c["kind"]
  if kind == "case":
    return _CASES[c["case"]]
  if kind == "include":
    return f"Include '{c['word']}'."
  if kind == "exclude":
    return f"Avoid '{c['word']}'."
  if kind == "start":
    return f"Start with '{c['word']}'."
  if kind == "end":
    return _ENDS[c["char"]]
  if kind == "commas":
    return "Separate words with commas."
  raise ValueError(f"constraint kind {kind!r} has no prompt text")


class InstructTask(Task):
  domain = "instruct"

  def draft(self, rng: random.Random, difficulty: int) -> Draft:
    topic = rng.choice(sorted(TOPICS))
    vocab = list(topic_words(topic))
    n = rng.randint(*_N_WORDS[difficulty])
    kinds = rng.sample(("case", "include", "exclude", "start", "end", "commas"), difficulty)
    extra = []
    chosen = rng.sample(vocab, 2)  # include/start use chosen[0]; exclude uses chosen[1]
    for kind in kinds:
      if kind == "case":
        extra.append({"kind": "case", "case": rng.choice(sorted(_CASES))})
      elif kind in ("include", "start"):
        extra.append({"kind": kind, "word": chosen[0]})
      elif kind == "exclude":
        extra.append({"kind": "exclude", "word": chosen[1]})
      elif kind == "end":
        extra.append({"kind": "end", "char": rng.choice(sorted(_ENDS))})
      else:
        extra.append({"kind": "commas"})
    constraints = [{"kind": "count", "n": n}, {"kind": "topic", "topic": topic}] + extra
    prompt = " ".join([f"Write {n} words about {TOPICS[topic]['phrase']}."]
                      + [_prompt_of(c) for c in extra])
    # Reference: distinct topic words, the required one first, the avoided one never.
    pool = [w for w in vocab if w not in chosen]
    rng.shuffle(pool)
    words = ([chosen[0]] if any(c["kind"] in ("include", "start") for c in extra) else []) + pool
    words = words[:n]
    case = next((c["case"] for c in extra if c["kind"] == "case"), None)
    words = [_apply_case(w, case) for w in words]
    text = (", " if any(c["kind"] == "commas" for c in extra) else " ").join(words)
    text += next((c["char"] for c in extra if c["kind"] == "end"), "")
    return Draft(prompt, (("assistant", text),), {"constraints": constraints})

  def verify(self, example: Example, response: str) -> Reward:
    self.check_example(example)
    body = response_body(response)
    if isinstance(body, Reward):
      return body
    if "\n" in body or len(body) > MAX_CHARS or not (body.isascii() and body.isprintable()):
      return malformed("not_one_printable_line")
    constraints = example.meta["constraints"]
    met = {f"{i}:{c['kind']}": float(check_constraint(c, body)) for i, c in enumerate(constraints)}
    score = sum(met.values()) / len(met)
    failed = [k for k, v in met.items() if not v]
    return Reward(score, 1.0, met, "ok" if not failed else f"partial:{len(met) - len(failed)}/{len(met)}")
