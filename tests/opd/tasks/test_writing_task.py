"""Writing: the hidden rubric on hand-made responses, preferences and ranking.

Expected scores are derived by hand from the rubric as documented in
opd/tasks/writing_task.py: weights sentences 2, topic 2, mentions 2,
capitals 1, ending 1, variety 1, length 1 (total 10).
"""
import pytest

from opd.tasks import DIFFICULTIES, Example, get_task

TASK = get_task("writing")
EXAMPLE = Example(
    "writing", "writing-hand-1", "train", 1, "Write one sentence about the dog. Mention 'happy'.",
    (("assistant", "The happy dog runs."),),
    {"topic": "dog", "sentences": 1, "mentions": ["dog", "happy"], "length": [12, 40]})


@pytest.mark.parametrize("response,score", [
    ("The happy dog runs.", 1.0),
    ("The happy dog runs", 1.0 - 1 / 10),  # no final punctuation
    ("the happy dog runs.", 1.0 - 1 / 10),  # no capital
    ("The happy dog runs runs.", 1.0 - (1 / 10) * (1 / 4)),  # variety 3/4
    ("The fast dog runs.", 1.0 - (2 / 10) * (1 / 2)),  # 'happy' missing
    ("The happy dog runs. It barks.", 1.0 - 2 / 10),  # two sentences: 1 - |2-1|/1 = 0
    ("A happy cat.", 1.0 - 2 * (2 / 10) * (1 / 2)),  # topic words 1 of 2; 'dog' missing
    ("Happy dog.", 1.0 - (1 / 10) * (1 - 10 / 12)),  # 10 chars, window starts at 12
])
def test_rubric_on_hand_made_responses(response, score):
  reward = TASK.verify(EXAMPLE, response)
  assert reward.format == 1.0
  assert reward.reward == pytest.approx(score), reward.components


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_references_score_one_and_degrade(difficulty):
  for example in TASK.examples("test", 30, seed=6, difficulty=difficulty):
    reference = example.reference_text
    assert TASK.score(example, reference) == pytest.approx(1.0), reference
    degraded = reference.rstrip(".").lower()
    assert TASK.preference(example, reference, degraded) == 1
    assert TASK.preference(example, degraded, reference) == -1
    assert TASK.preference(example, reference, reference) == 0
    assert TASK.rank(example, [degraded, "", reference]) == [2, 0, 1]


def test_malformed_writing_scores_zero():
  for bad in ("", "  ", "<think>The happy dog runs.", "The happy dog runs.<|end|>",
              "The h\u00e4ppy dog runs.", "word " * 100):
    r = TASK.verify(EXAMPLE, bad)
    assert (r.reward, r.format) == (0.0, 0.0) and r.category == "malformed", bad
  assert TASK.score(EXAMPLE, "<think>short</think>The happy dog runs.") == 1.0


@pytest.mark.parametrize("junk", ["eeeeeeeeeeeeeeee", "Ball!", "...", "x.y.z."])
def test_junk_without_real_sentences_scores_zero(junk):
  """No sentence of >= 2 words: every form part scores 0, so (mentions absent)
  the reward is exactly the topic share, 2/10 of the topic part."""
  task = get_task("writing")
  checked = 0
  for ex in task.examples("test", 5, seed=4):
    words = {w.lower() for w in junk.replace(".", " ").replace("!", " ").split()}
    if words & set(ex.meta.get("mentions", ())) or ex.meta["topic"] in words:
      continue
    reward = task.verify(ex, junk)
    form = {k: reward.components[k] for k in ("sentences", "capitals", "ending", "variety",
                                              "length", "mentions")}
    assert form == dict.fromkeys(form, 0.0), reward
    assert reward.reward == pytest.approx(2 / 10 * reward.components["topic"], abs=1e-12)
    checked += 1
  assert checked >= 3
