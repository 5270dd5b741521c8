"""Instruction-following verifier against responses built here from the prompt text."""
import re

import pytest

from opd.tasks import DIFFICULTIES, get_task
from opd.tasks.vocab import TOPICS

_PHRASE_TO_TOPIC = {t["phrase"]: name for name, t in TOPICS.items()}


def read_prompt(prompt: str) -> dict:
  """The constraints as a reader of the prompt understands them."""
  m = re.match(r"Write (\d+) words about (.+?)\.", prompt)
  spec = {"n": int(m.group(1)), "topic": _PHRASE_TO_TOPIC[m.group(2)], "case": None,
          "include": None, "avoid": None, "start": None, "end": None, "commas": False}
  rest = prompt[m.end():]
  spec["case"] = ("lower" if "Use lowercase only." in rest else "upper" if "Use uppercase only."
                  in rest else "title" if "Capitalize every word." in rest else None)
  for key, pattern in (("include", r"Include '(\w+)'\."), ("avoid", r"Avoid '(\w+)'\."),
                       ("start", r"Start with '(\w+)'\."), ("end", r"End with '(.)'\.")):
    found = re.search(pattern, rest)
    spec[key] = found.group(1) if found else None
  spec["commas"] = "Separate words with commas." in rest
  spec["m"] = 2 + sum(spec[k] is not None for k in ("case", "include", "avoid", "start", "end")) \
      + spec["commas"]
  return spec


def build(spec: dict, *, n=None, case="same", end="same", commas=None, words=None) -> str:
  t = TOPICS[spec["topic"]]
  if words is None:
    first = [w for w in (spec["start"], spec["include"]) if w]
    pool = [w for w in t["adjs"] + t["nouns"] + t["verbs"] if w != spec["avoid"] and w not in first]
    words = (first[:1] + pool)[:spec["n"] if n is None else n]
  case = spec["case"] if case == "same" else case
  words = [w.upper() if case == "upper" else w.capitalize() if case == "title" else w
           for w in words]
  text = (", " if (spec["commas"] if commas is None else commas) else " ").join(words)
  return text + ((spec["end"] or "") if end == "same" else end)


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_verifier_on_constructed_responses(difficulty):
  task = get_task("instruct")
  for example in task.examples("test", 40, seed=3, difficulty=difficulty):
    spec = read_prompt(example.prompt)
    m = spec["m"]
    assert len(example.meta["constraints"]) == m

    def check(text, broken):
      r = task.verify(example, text)
      assert r.format == 1.0 and r.reward == pytest.approx(1 - broken / m), (example.prompt, text, r)

    check(build(spec), 0)
    check(example.reference_text, 0)
    check(build(spec, n=spec["n"] + 1), 1)
    if spec["case"]:
      check(build(spec, case={"lower": "upper", "upper": "lower", "title": "lower"}[spec["case"]]), 1)
    if spec["end"]:
      check(build(spec, end=""), 1)
    if spec["commas"]:
      check(build(spec, commas=False), 1)
    if spec["avoid"]:
      words = build(spec, case=None, end="", commas=False).split()
      words[-1] = spec["avoid"]
      check(build(spec, words=words), 1)
    if spec["include"] and not spec["start"]:
      words = build(spec, case=None, end="", commas=False).split()
      others = [w for w in TOPICS[spec["topic"]]["nouns"] if w not in words + [spec["avoid"]]]
      check(build(spec, words=[others[0]] + words[1:]), 1)
    if not spec["include"] and not spec["start"] and spec["n"] >= 2:
      check(build(spec, words=["zorp"] * spec["n"]), 1)  # off topic


def test_malformed_responses():
  task = get_task("instruct")
  example = task.examples("train", 1)[0]
  good = example.reference_text
  for bad in ("", "   ", f"{good}\n{good}", f"{good} \u00e9", "word " * 50, f"<think>{good}",
              f"{good}<|end|>"):
    r = task.verify(example, bad)
    assert (r.reward, r.format) == (0.0, 0.0) and r.category == "malformed", bad
  assert task.verify(example, f"<think>plan</think>{good}").reward == 1.0
