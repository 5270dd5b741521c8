"""experiments.sizing: the rows of docs/SCALING.md's sizing tables follow their rule."""
import pytest

from experiments import sizing
from opd.parallel import memory


def test_each_row_fits_the_most_rows_and_nothing_fits_more():
  _, rows = sizing.full_table()
  assert len(rows) == len(sizing.STUDENTS) * len(sizing.CHIPS)
  for row in rows:
    cfg, chip = sizing.STUDENTS[row["student"]], next(c for c in sizing.CHIPS
                                                        if c.name == row["chip"])
    limit = sizing.FILL * chip.hbm
    est = sizing._estimate(cfg, row["mesh"], row["rows"], 4096, None)
    assert est.total / 2**30 == pytest.approx(row["total_gib"])
    # No layout fits twice the rows (for a row that does not fit: any rows at all); the
    # total grows with the rows, so its fewest rows at or above that (a multiple of its
    # batch shards) decide.
    more = 2 * row["rows"] if row["fits"] else 1
    for mesh in sizing.LAYOUTS:
      fewest = max(more, mesh[0] * mesh[1])
      assert sizing._estimate(cfg, mesh, fewest, 4096, None).total > limit, (row, mesh)
    assert (est.total <= limit) == row["fits"]
    assert row["flops"] == memory.step_flops(cfg, row["rows"], 4096)
