"""Random preference groups shared by the GRM evaluation and yardstick tests."""
from grm.data import PreferenceGroup


def random_groups(rng, num):
  """Groups of n in 1..4: n >= 2 with distinct rewards, n == 1 with a rating in 1..10."""
  out = []
  for e in range(num):
    n = int(rng.integers(1, 5))
    ratings = (int(rng.integers(1, 11)),) if n == 1 else tuple(rng.permutation(n) / n)
    out.append(PreferenceGroup(domain="math", example_id=f"g{e}", split="test", query=f"q{e}",
                               responses=tuple(f"r{e}_{i}" for i in range(n)),
                               ratings=ratings, reasons=("",) * n))
  return out
