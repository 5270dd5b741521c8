"""Reports: markdown tables, JSON and heatmaps of hand-built results, read back."""
import re

import numpy as np
import pytest
from PIL import Image

from opd.eval import report
from opd.eval.results import DomainResult, EvalConfig, EvalResult
from opd.eval.stats import Estimate
from opd.tasks import ALL_DOMAINS

CONFIG = EvalConfig(n_per_domain=2, num_samples=3, bootstrap_samples=10)


def _result(name: str, seed: int) -> EvalResult:
  """Random scores in every domain and metric (the report only formats them)."""
  rng = np.random.default_rng(seed)
  domains = {}
  for d in ALL_DOMAINS:
    metrics = {m: Estimate(float(rng.uniform(0, 100)), float(rng.uniform(0, 10)))
               for m in CONFIG.metrics}
    domains[d] = DomainResult(
        d, metrics, [f"{d}-0", f"{d}-1"], rng.random(2).tolist(), [1.0, 0.0],
        rng.random((2, 3)).tolist(), np.ones((2, 3)).tolist(), {"greedy": {"ok": 1,
                                                                           "malformed": 1}},
        [{"id": f"{d}-0", "prompt": "p?", "response": "r", "reference": "x", "reward": 0.5,
          "reason": "partial"}])
  return EvalResult(name, CONFIG, domains, {"generate": 1.0, "verify": 0.5, "metrics": 0.1,
                                           "total": 1.6})


@pytest.fixture(scope="module")
def results():
  return [_result("model_a", 0), _result("model_b", 1)]


def _parse_table(md: str, metric: str):
  """{model: {column: (value, se)}} from the first table for ``metric``."""
  lines = [ln for ln in md.splitlines() if ln.startswith("|")]
  start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {metric} |"))
  header = [c.strip() for c in lines[start].strip("|").split("|")]
  out = {}
  for ln in lines[start + 2:]:
    cells = [c.strip() for c in ln.strip("|").split("|")]
    if cells[0] == header[0] or not re.match(r"[-\d.]+ ± [\d.]+", cells[1]):
      break
    out[cells[0]] = {h: tuple(map(float, c.split(" ± "))) for h, c in zip(header[1:], cells[1:])}
  return out


def test_save_results_markdown_json_heatmap(results, tmp_path):
  paths = report.save_results(results, str(tmp_path / "out"))
  # JSON round-trips exactly.
  loaded = report.load_results(paths["json"])
  assert [r.to_dict() for r in loaded] == [r.to_dict() for r in results]
  md = open(paths["markdown"]).read()
  for metric in CONFIG.metrics:
    table = _parse_table(md, metric)
    assert list(table) == [r.name for r in results]
    for r in results:
      row = table[r.name]
      for d in ALL_DOMAINS:
        s = r.score(d, metric)
        assert row[d] == pytest.approx((s.value, s.se), abs=0.051)
      values = [r.score(d, metric).value for d in ALL_DOMAINS]
      ses = [r.score(d, metric).se for d in ALL_DOMAINS]
      avg = (np.mean(values), np.sqrt(np.sum(np.square(ses))) / len(ses))
      assert row["avg"] == pytest.approx(avg, abs=0.051)
  # Heatmap: the PNG is written at figure size x dpi, and the cell labels
  # carry each model's numbers in grid order.
  png = report.heatmap(results, str(tmp_path / "plots" / "h.png"), metric="mean@3")
  fig = report.heatmap_figure(results, metric="mean@3")
  with Image.open(png) as im:
    assert im.format == "PNG"
    assert im.size == tuple(int(round(v * 100)) for v in fig.get_size_inches())
  texts = [t.get_text() for t in fig.axes[0].texts]
  expected = [f"{r.score(d, 'mean@3').value:.1f}\n±{r.score(d, 'mean@3').se:.1f}"
              for r in results for d in ALL_DOMAINS]
  assert texts == expected


def test_outputs_reject_bad_metric(results, tmp_path):
  with pytest.raises(ValueError, match="metric='pass@9'"):
    report.results_table(results, "pass@9")
  with pytest.raises(ValueError, match="metric='mean@4'"):
    report.heatmap(results, str(tmp_path / "h.png"), metric="mean@4")
  with pytest.raises(ValueError, match="results must not be empty"):
    report.results_table([], "pass@1")
  with pytest.raises(ValueError, match="no domain 'poetry'"):
    results[0].score("poetry", "pass@1")


def test_table_marks_missing_domains(results):
  """Models evaluated on different domains: absent cells show '–'."""
  full = results[0]
  part = EvalResult("part", full.config, {"math": full.domains["math"]}, dict(full.seconds))
  md = report.results_table([full, part], "pass@1")
  last = md.strip().splitlines()[-1]
  cells = [c.strip() for c in last.strip("|").split("|")]
  assert cells[0] == "part" and cells[1] == str(full.score("math", "pass@1"))
  assert cells[2:] == ["–"] * (len(ALL_DOMAINS) - 1) + ["–"]
