"""Writing: open-ended sentences scored by a hidden rubric.

Prompt: ``Write one sentence about the ball. Mention 'fast'.`` (difficulty 3
asks for two mentions). Response: plain prose, e.g. ``The fast ball jumps.``

The rubric is deterministic and never shown to the policy; it plays the
role of the human preferences a generative reward model (GRM) is trained to
predict: ``rubric_score`` scores any response, ``preference`` compares two
and ``rank`` orders several. Rubric components, each in [0, 1]:

  sentences   the requested number of sentences (linear penalty per miss);
              a "sentence" needs at least ``MIN_SENTENCE_WORDS`` words;
  topic       distinct topic words used, out of ``2 * sentences`` wanted;
  mentions    the subject and the required words present;
  capitals    sentences that start with a capital letter;
  ending      the text ends with ``.``, ``!`` or ``?``;
  variety     distinct / total content words (no repetition);
  length      1 inside [lo, hi] characters, falling linearly to 0 at 0 and 2 hi.

The form components (capitals, ending, variety, length) count only when
the text has at least one real sentence, so a string of junk scores 0.
Score = weighted mean with ``RUBRIC_WEIGHTS``. Reward = score; format
reward 1 iff the response is non-empty printable ASCII (after optional
thinking), else reward 0.

Difficulty: 1 sentence and one required word (d = 1), 2 sentences (d = 2),
3 sentences and two required words (d = 3).
"""
from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from opd.tasks.base import Draft, Example, Reward, Task, malformed, response_body
from opd.tasks.vocab import TOPICS, topic_words

RUBRIC_WEIGHTS = {"sentences": 2.0, "topic": 2.0, "mentions": 2.0, "capitals": 1.0,
                  "ending": 1.0, "variety": 1.0, "length": 1.0}
_STOPWORDS = frozenset(("the", "a", "an", "is", "it", "in", "on", "and", "of", "to", "at"))
_COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
_SENTENCE_RE = re.compile(r"[^.!?]+[.!?]*")
_WORD_RE = re.compile(r"[A-Za-z]+")
MAX_CHARS = 400
MIN_SENTENCE_WORDS = 2


def _sentences(text: str) -> list[str]:
  return [s.strip() for s in _SENTENCE_RE.findall(text)
          if len(_WORD_RE.findall(s)) >= MIN_SENTENCE_WORDS]


def rubric_score(meta: Mapping[str, Any], text: str) -> tuple[float, dict[str, float]]:
  """The hidden rubric: ``(score in [0, 1], components)`` of visible ``text``.

  Args:
    meta: an example's ``meta`` (topic, sentences, mentions, length window).
    text: the response body (thinking already removed).
  """
  k = meta["sentences"]
  sentences = _sentences(text)
  words = [w.lower() for w in _WORD_RE.findall(text)]
  content = [w for w in words if w not in _STOPWORDS]
  vocab = set(topic_words(meta["topic"]))
  lo, hi = meta["length"]
  n = len(text)
  parts = {
      "sentences": max(0.0, 1.0 - abs(len(sentences) - k) / k),
      "topic": min(1.0, len(vocab.intersection(words)) / (2 * k)),
      "mentions": (sum(m in words for m in meta["mentions"]) / len(meta["mentions"])
                   if meta["mentions"] else 1.0),
      "capitals": (sum(s[0].isupper() for s in sentences) / len(sentences)) if sentences else 0.0,
      "ending": float(text.rstrip().endswith((".", "!", "?"))),
      "variety": len(set(content)) / len(content) if content else 0.0,
      "length": 1.0 if lo <= n <= hi else (n / lo if n < lo else max(0.0, 2.0 - n / hi)),
  }
  if not sentences:  # junk: no credit for the form of nothing
    for name in ("capitals", "ending", "variety", "length"):
      parts[name] = 0.0
  score = sum(RUBRIC_WEIGHTS[k_] * v for k_, v in parts.items()) / sum(RUBRIC_WEIGHTS.values())
  return score, parts


def _sentence(rng: random.Random, topic: dict, used: set[str], must: list[str]) -> str:
  """One short sentence of fresh topic words; ``must`` words go in first."""
  def pick(pos: str) -> str:
    options = [w for w in topic[pos] if w not in used]
    word = next((m for m in must if m in topic[pos] and m not in used), None) or rng.choice(options)
    used.add(word)
    return word

  noun, verb, adj = pick("nouns"), pick("verbs"), pick("adjs")
  return rng.choice(("The {a} {n} {v}.", "A {a} {n} {v}.", "The {n} {v}, {a}.")).format(
      a=adj, n=noun, v=verb).capitalize()


class WritingTask(Task):
  domain = "writing"

  def draft(self, rng: random.Random, difficulty: int) -> Draft:
    topic_name = rng.choice(sorted(TOPICS))
    topic = TOPICS[topic_name]
    k = difficulty
    subject = rng.choice(topic["nouns"])
    # One sentence has a single noun slot, taken by the subject.
    others = [w for w in topic_words(topic_name)
              if w != subject and (k > 1 or w not in topic["nouns"])]
    mentions = sorted(rng.sample(others, 2 if difficulty == 3 else 1))
    noun_word = "sentence" if k == 1 else "sentences"
    prompt = (f"Write {_COUNT_WORDS[k]} {noun_word} about the {subject}. Mention "
              + " and ".join(f"'{m}'" for m in mentions) + ".")
    used: set[str] = set()
    must = [subject] + mentions
    text = " ".join(_sentence(rng, topic, used, must) for _ in range(k))
    meta = {"topic": topic_name, "sentences": k, "mentions": must, "length": [12 * k, 40 * k]}
    return Draft(prompt, (("assistant", text),), meta)

  def _body(self, response: Any) -> str | Reward:
    body = response_body(response)
    if isinstance(body, Reward):
      return body
    if len(body) > MAX_CHARS or not body.isascii() or not body.replace("\n", " ").isprintable():
      return malformed("not_printable_text")
    return body

  def verify(self, example: Example, response: str) -> Reward:
    self.check_example(example)
    body = self._body(response)
    if isinstance(body, Reward):
      return body
    score, parts = rubric_score(example.meta, body)
    return Reward(score, 1.0, parts, "ok" if score >= 1.0 else f"score:{score:.2f}")

  def score(self, example: Example, response: str) -> float:
    """Hidden-rubric score of any response (0 if malformed)."""
    return self.verify(example, response).reward

  def preference(self, example: Example, a: str, b: str, *, margin: float = 1e-9) -> int:
    """1 if ``a`` is better than ``b`` under the rubric, -1 if worse, 0 if tied."""
    sa, sb = self.score(example, a), self.score(example, b)
    return 0 if abs(sa - sb) <= margin else (1 if sa > sb else -1)

  def rank(self, example: Example, responses: Sequence[str]) -> list[int]:
    """Indices of ``responses`` from best to worst (ties keep input order)."""
    scores = [self.score(example, r) for r in responses]
    return sorted(range(len(responses)), key=lambda i: -scores[i])
