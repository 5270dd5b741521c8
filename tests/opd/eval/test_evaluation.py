"""Evaluation harness: bootstrap SEs against numpy and the binomial formula,
scores of a scripted policy against frequencies counted here, a real tiny
model end to end with a bounded number of sampler calls and compiles, and
the written table/JSON/PNG read back."""
import collections
import math
import re

import jax
import numpy as np
import pytest
from PIL import Image

from opd.eval import evaluation as ev
from opd.rollout import episodes as rl
from opd.rollout import sampler
from opd.models import ModelConfig, init_params
from opd.tasks import ALL_DOMAINS, AgentEnv, get_task
from opd.text.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64)


# --- bootstrap ---------------------------------------------------------------

def _loop_bootstrap(values, B, seed):
  """Independent reference: one resample at a time, the mean of every value
  of the drawn examples (all samples of a drawn example included)."""
  values = np.asarray(values, np.float64)
  rows = values.reshape(len(values), -1)
  rng = np.random.default_rng(seed)
  means = []
  for _ in range(B):
    idx = rng.integers(0, len(rows), size=len(rows))
    means.append(rows[idx].ravel().mean())
  m = np.asarray(means)
  return math.sqrt(((m - m.mean()) ** 2).sum() / (B - 1))


@pytest.mark.parametrize("shape,B", [((37,), 500), ((23, 4), 300), ((3000,), 1500)],
                         ids=lambda x: str(x))
def test_bootstrap_se_matches_numpy_loop(shape, B):
  """Same seed, same resamples: equal to 1e-12. (3000,) x 1500 crosses the
  4M-index block boundary, so the blocked draw must continue the stream."""
  x = np.random.default_rng(1).random(shape)
  seed = ev.bootstrap_seed(5, "math")
  assert ev.bootstrap_se(x, B, seed) == pytest.approx(_loop_bootstrap(x, B, seed), rel=1e-12)


@pytest.mark.parametrize("n,k", [(50, 17), (200, 20)])
def test_bootstrap_se_matches_binomial(n, k):
  """For 0/1 values the bootstrap SE estimates sqrt(p(1-p)/n) (plug-in p).
  With B = 40000 resamples the SE of the SE is about 1/sqrt(2B) = 0.35%
  relative; the tolerance is 2%."""
  x = np.zeros(n)
  x[np.random.default_rng(n).choice(n, k, replace=False)] = 1.0
  p = k / n
  assert ev.bootstrap_se(x, 40_000, 0) == pytest.approx(math.sqrt(p * (1 - p) / n), rel=0.02)


def test_bootstrap_se_rejects_bad_input():
  with pytest.raises(ValueError, match="shape"):
    ev.bootstrap_se(np.zeros((2, 2, 2)), 10, 0)
  with pytest.raises(ValueError, match="shape"):
    ev.bootstrap_se([], 10, 0)
  with pytest.raises(ValueError, match="num_resamples"):
    ev.bootstrap_se([1.0, 0.0], 1, 0)


# --- config -------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("domains", ("math", "poetry")), ("domains", ()), ("domains", "math"),
    ("domains", ("math", "math")), ("n_per_domain", 0), ("n_per_domain", 2.5),
    ("difficulty", 4), ("seed", -1), ("num_samples", -1), ("temperature", 0.0),
    ("top_p", 1.5), ("max_new_tokens", 0), ("bootstrap_samples", 1), ("batch_size", 0),
    ("prompt_bucket", 0), ("solved_threshold", 0.0), ("greedy", 1),
])
def test_config_rejects(field, value):
  with pytest.raises(ValueError, match=rf"(?s)EvalConfig\.{field}\b.*{re.escape(repr(value))}"):
    ev.EvalConfig(**{field: value})


def test_config_nothing_to_do():
  with pytest.raises(ValueError, match="nothing to evaluate"):
    ev.EvalConfig(greedy=False, num_samples=0)


def test_config_error_names_unknown_domain():
  with pytest.raises(ValueError, match="'poetry'"):
    ev.EvalConfig(domains=("math", "poetry"))


# --- scripted policy ----------------------------------------------------------

N_EX, N_SAMPLES = 4, 3
SCRIPT_CFG = ev.EvalConfig(n_per_domain=N_EX, num_samples=N_SAMPLES, batch_size=4,
                           max_new_tokens=80, bootstrap_samples=200, seed=3, temperature=0.7)


def _wrong_text(ex):
  """A wrong response: well-formed but wrong, or partly right."""
  if ex.domain in ("instruct", "writing"):  # one word short: partial credit
    return " ".join(ex.reference_text.split()[:-1]) or "x"
  return {"math": "Answer: 99999", "code": "def f(x): return 0",
          "agent": "Answer: 99999"}[ex.domain]


def _expected_reward(ex, correct: bool):
  """(reward, format, category) of the reference or the wrong response,
  computed here with the verifier/environment directly."""
  if ex.domain == "agent":
    env = AgentEnv()
    env.reset(ex)
    turns = [c for r, c in ex.reference if r == "assistant"] if correct else [_wrong_text(ex)]
    for t in turns:
      env.step(t)
    r = env.reward()
  else:
    r = get_task(ex.domain).verify(ex, ex.reference_text if correct else _wrong_text(ex))
  return r.reward, r.format, r.category


def _scripted_sampler(examples, greedy_ok, sample_ok, seen_sampling):
  """A fake ``rl.sample``: answers example i correctly greedily iff
  greedy_ok[id], and in exactly sample_ok[id] of its N sampled rollouts."""
  by_prompt = {ex.prompt: ex for exs in examples.values() for ex in exs}
  counts = collections.Counter()

  def fake(model_cfg, params, tokenizer, prompts, rng, sampling, **kw):
    seen_sampling.append((sampling.temperature, len(prompts), kw.get("batch_size")))
    out = []
    for p in prompts:
      text = tokenizer.decode(p)
      ex = by_prompt[text.split("<|user|>")[1].split("<|end|>")[0]]
      turn = text.count("<|assistant|>") - 1
      if turn > 0:  # only episodes whose first turn was right get here
        ok = True
      elif sampling.greedy:
        ok = greedy_ok[ex.id]
      else:
        ok = counts[ex.id] < sample_ok[ex.id]
        counts[ex.id] += 1
      assistant = [c for r, c in ex.reference if r == "assistant"]
      reply = assistant[turn] if ok else _wrong_text(ex)
      ids = np.asarray(tokenizer.encode(reply + "<|end|>"), np.int32)
      out.append(rl.Completion(ids, np.zeros(len(ids), np.float32), True, reply))
    return out

  return fake


def _scripted_run(monkeypatch, seed, name):
  examples = ev.eval_examples(SCRIPT_CFG)
  rng = np.random.default_rng(seed)
  ids = [ex.id for exs in examples.values() for ex in exs]
  greedy_ok = dict(zip(ids, (rng.random(len(ids)) < 0.5).tolist()))
  sample_ok = dict(zip(ids, rng.integers(0, N_SAMPLES + 1, len(ids)).tolist()))
  seen = []
  monkeypatch.setattr(rl, "sample", _scripted_sampler(examples, greedy_ok, sample_ok, seen))
  result = ev.evaluate(CFG, None, TOK, SCRIPT_CFG, name=name)
  return result, examples, greedy_ok, sample_ok, seen


@pytest.fixture(scope="module")
def scripted_results():
  """Two scripted 'models' with different answer patterns."""
  mp = pytest.MonkeyPatch()
  try:
    runs = [_scripted_run(mp, seed, f"scripted{seed}") for seed in (0, 1)]
  finally:
    mp.undo()
  return runs


def test_scripted_scores_equal_counted_frequencies(scripted_results):
  result, examples, greedy_ok, sample_ok, seen = scripted_results[0]
  N, B = N_SAMPLES, SCRIPT_CFG.bootstrap_samples
  # Both paths ran, at the configured temperatures, always with full batches.
  assert {t for t, _, _ in seen} == {0.0, SCRIPT_CFG.temperature}
  assert all(bs == SCRIPT_CFG.batch_size for _, _, bs in seen if bs is not None)
  for d in ALL_DOMAINS:
    g_ok, g_rew, g_fmt, g_cat, s_rew, s_fmt, s_solved = [], [], [], [], [], [], []
    for ex in examples[d]:
      r_ok, f_ok, c_ok = _expected_reward(ex, True)
      r_bad, f_bad, c_bad = _expected_reward(ex, False)
      assert r_ok == pytest.approx(1.0) and r_bad < 1.0, (d, r_ok, r_bad)
      ok = greedy_ok[ex.id]
      g_ok.append(float(ok))
      g_rew.append(r_ok if ok else r_bad)
      g_fmt.append(f_ok if ok else f_bad)
      g_cat.append(c_ok if ok else c_bad)
      c = sample_ok[ex.id]
      s_rew.append([r_ok] * c + [r_bad] * (N - c))
      s_fmt.append([f_ok] * c + [f_bad] * (N - c))
      s_solved.append(c / N)
    dr = result.domains[d]
    seed = ev.bootstrap_seed(SCRIPT_CFG.seed, d)
    expect = {
        "pass@1": (np.mean(g_ok), g_ok),
        "reward@1": (np.mean(g_rew), g_rew),
        "format@1": (np.mean(g_fmt), g_fmt),
        f"mean@{N}": (np.mean(s_rew), s_rew),
        f"solved@{N}": (np.mean(s_solved), s_solved),
        f"format@{N}": (np.mean(s_fmt), s_fmt),
    }
    assert set(dr.metrics) == set(expect)
    for m, (value, per_example) in expect.items():
      got = dr.metrics[m]
      assert got.value == pytest.approx(100 * value, abs=1e-9), (d, m)
      assert got.se == pytest.approx(100 * ev.bootstrap_se(per_example, B, seed), abs=1e-9)
      assert 0 <= got.value <= 100
    assert dr.reasons["greedy"] == dict(collections.Counter(g_cat))
    assert sum(dr.reasons["sampled"].values()) == N_EX * N
    assert dr.example_ids == [e.id for e in examples[d]]
    assert len(dr.transcripts) == SCRIPT_CFG.num_transcripts
    t = dr.transcripts[0]
    assert t["prompt"] == examples[d][0].prompt and t["reward"] == pytest.approx(g_rew[0])
  # Partial credit shows up as reward@1 > pass@1 somewhere (instruct/writing/code/agent).
  assert any(dr.metrics["reward@1"].value > dr.metrics["pass@1"].value
             for dr in result.domains.values())


def test_scripted_greedy_only_and_sampled_only(monkeypatch):
  """Each pass alone produces exactly its metrics; sampled-only keeps
  transcripts from the first sample of each example."""
  examples = ev.eval_examples(SCRIPT_CFG)
  ids = [ex.id for exs in examples.values() for ex in exs]
  seen = []
  monkeypatch.setattr(rl, "sample", _scripted_sampler(examples, dict.fromkeys(ids, True),
                                                      dict.fromkeys(ids, 1), seen))
  cfg = ev.EvalConfig(domains=("math", "agent"), n_per_domain=N_EX, num_samples=0,
                      batch_size=4, max_new_tokens=80, seed=3)
  r = ev.evaluate(CFG, None, TOK, cfg)
  assert set(r.domains["math"].metrics) == set(ev.GREEDY_METRICS)
  assert all(r.score(d, "pass@1").value == 100.0 for d in cfg.domains)
  assert r.domains["math"].sampled_rewards is None
  cfg = ev.EvalConfig(domains=("math", "agent"), n_per_domain=N_EX, num_samples=2,
                      greedy=False, batch_size=4, max_new_tokens=80, seed=3)
  r = ev.evaluate(CFG, None, TOK, cfg)
  assert set(r.domains["math"].metrics) == {"mean@2", "solved@2", "format@2"}
  # One of two samples right per example: exactly 50 with zero spread.
  assert r.score("math", "solved@2") == ev.Estimate(50.0, 0.0)
  assert r.domains["agent"].transcripts[0]["reward"] == pytest.approx(1.0)


# --- real tiny model ----------------------------------------------------------

def test_real_tiny_model_all_domains(monkeypatch):
  """Random-init tiny model, every domain: finite scores in [0, 100], a
  bounded number of fixed-size sampler calls, and a second model of the
  same config compiles nothing new."""
  cfg = ev.EvalConfig(n_per_domain=3, num_samples=2, max_new_tokens=8, batch_size=8,
                      bootstrap_samples=50)
  calls = []
  real_sample = rl.sample

  def counting(*args, **kw):
    calls.append((len(args[3]), kw.get("batch_size"), kw.get("prompt_bucket")))
    return real_sample(*args, **kw)

  monkeypatch.setattr(rl, "sample", counting)
  params = init_params(CFG, jax.random.key(0))
  compiled_before = sampler._generate_jit._cache_size()
  r0 = ev.evaluate(CFG, params, TOK, cfg, name="base")
  compiled = sampler._generate_jit._cache_size()
  assert compiled - compiled_before <= 2  # greedy, sampled: agent turn 1 shares the shape
  # Single-turn: ceil(12/8) greedy + ceil(24/8) sampled calls; agent: one
  # padded chunk per pass, at most max_turns (4 at difficulty 1) turns each.
  assert 2 + 3 + 2 <= len(calls) <= 2 + 3 + 2 * 4, calls
  # Every call samples exactly 8 rows (agent chunks are padded to 8
  # examples, single-turn calls pad inside sample), single-turn prompts at
  # one padded length.
  assert all(bs == 8 and n <= 8 for n, bs, _ in calls), calls
  assert {b for _, _, b in calls} == {64}
  for d in ALL_DOMAINS:
    for m in cfg.metrics:
      s = r0.score(d, m)
      assert math.isfinite(s.value) and math.isfinite(s.se) and 0 <= s.value <= 100, (d, m, s)
      assert 0 <= s.se <= 100
  assert r0.seconds["total"] >= r0.seconds["generate"] > 0
  calls.clear()
  r1 = ev.evaluate(CFG, init_params(CFG, jax.random.key(1)), TOK, cfg, name="other")
  assert sampler._generate_jit._cache_size() == compiled
  assert len(calls) >= 7
  # Same params and key: the same responses.
  r0b = ev.evaluate(CFG, params, TOK, cfg, name="base")
  assert [d.transcripts for d in r0b.domains.values()] == [d.transcripts
                                                          for d in r0.domains.values()]
  assert r1.name == "other"


# --- outputs ------------------------------------------------------------------

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


def test_save_results_markdown_json_heatmap(scripted_results, tmp_path):
  results = [run[0] for run in scripted_results]
  paths = ev.save_results(results, str(tmp_path / "out"))
  # JSON round-trips exactly.
  loaded = ev.load_results(paths["json"])
  assert [r.to_dict() for r in loaded] == [r.to_dict() for r in results]
  md = open(paths["markdown"]).read()
  for metric in SCRIPT_CFG.metrics:
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
  png = ev.heatmap(results, str(tmp_path / "plots" / "h.png"), metric="mean@3")
  fig = ev.heatmap_figure(results, metric="mean@3")
  with Image.open(png) as im:
    assert im.format == "PNG"
    assert im.size == tuple(int(round(v * 100)) for v in fig.get_size_inches())
  texts = [t.get_text() for t in fig.axes[0].texts]
  expected = [f"{r.score(d, 'mean@3').value:.1f}\n±{r.score(d, 'mean@3').se:.1f}"
              for r in results for d in ALL_DOMAINS]
  assert texts == expected


def test_outputs_reject_bad_metric(scripted_results, tmp_path):
  results = [run[0] for run in scripted_results]
  with pytest.raises(ValueError, match="metric='pass@9'"):
    ev.results_table(results, "pass@9")
  with pytest.raises(ValueError, match="metric='mean@4'"):
    ev.heatmap(results, str(tmp_path / "h.png"), metric="mean@4")
  with pytest.raises(ValueError, match="results must not be empty"):
    ev.results_table([], "pass@1")
  with pytest.raises(ValueError, match="no domain 'poetry'"):
    results[0].score("poetry", "pass@1")


def test_table_marks_missing_domains(scripted_results):
  """Models evaluated on different domains: absent cells show '–'."""
  full = scripted_results[0][0]
  part = ev.EvalResult("part", full.config, {"math": full.domains["math"]}, dict(full.seconds))
  md = ev.results_table([full, part], "pass@1")
  last = md.strip().splitlines()[-1]
  cells = [c.strip() for c in last.strip("|").split("|")]
  assert cells[0] == "part" and cells[1] == str(full.score("math", "pass@1"))
  assert cells[2:] == ["–"] * (len(ALL_DOMAINS) - 1) + ["–"]


def test_evaluate_rejects_bad_arguments():
  with pytest.raises(ValueError, match="cfg must be an EvalConfig"):
    ev.evaluate(CFG, None, TOK, {"domains": ("math",)})
  with pytest.raises(ValueError, match="name"):
    ev.evaluate(CFG, None, TOK, ev.EvalConfig(), name="a|b")
