"""Closed vocabularies of the toy domains.

Small on purpose: a byte-level model of a few million parameters has to learn
each domain's language in a few hundred SFT steps, so every domain draws its
words from these short lists (all lowercase ASCII, no word repeated within a
topic).
"""

NAMES = ("Ann", "Bob", "Cal", "Dee", "Eli", "Fay", "Gus", "Ivy")
OBJECTS = ("apple", "book", "coin", "cup", "egg", "hat", "pen", "shell")

# Writing and instruction following: a topic, how the prompt names it, and its
# words split by part of speech (verbs in the third person singular).
TOPICS = {
    "dog": {"phrase": "a dog", "nouns": ("dog", "ball", "park", "grass", "bone"),
            "verbs": ("runs", "jumps", "barks", "plays", "sleeps"),
            "adjs": ("happy", "fast", "brown", "loud", "small")},
    "sea": {"phrase": "the sea", "nouns": ("sea", "wave", "fish", "boat", "sand"),
            "verbs": ("rolls", "shines", "moves", "glows", "rests"),
            "adjs": ("blue", "deep", "calm", "cold", "wide")},
    "rain": {"phrase": "the rain", "nouns": ("rain", "cloud", "storm", "roof", "puddle"),
             "verbs": ("falls", "drips", "pours", "stops", "taps"),
             "adjs": ("wet", "grey", "soft", "heavy", "cool")},
    "city": {"phrase": "the city", "nouns": ("city", "bus", "street", "tower", "light"),
             "verbs": ("hums", "wakes", "glows", "moves", "sleeps"),
             "adjs": ("busy", "tall", "bright", "loud", "old")},
    "garden": {"phrase": "a garden", "nouns": ("garden", "rose", "bee", "tree", "seed"),
               "verbs": ("grows", "blooms", "hums", "sways", "waits"),
               "adjs": ("green", "sweet", "quiet", "red", "fresh")},
    "bread": {"phrase": "bread", "nouns": ("bread", "oven", "flour", "crust", "loaf"),
              "verbs": ("bakes", "rises", "cools", "smells", "cracks"),
              "adjs": ("warm", "brown", "soft", "fresh", "golden")},
}


def topic_words(topic: str) -> tuple[str, ...]:
  """Every word of ``topic`` (nouns, verbs, adjectives)."""
  t = TOPICS[topic]
  return t["nouns"] + t["verbs"] + t["adjs"]


# Agent domain: entities whose attribute values live in a per-example table.
ENTITIES = ("pear", "fig", "plum", "lime", "kiwi", "date", "melon", "grape",
            "cat", "cow", "hen", "fox", "owl", "yak", "bee", "ant")
ATTRIBUTES = ("price", "weight", "age", "count")
