"""Evaluation runner: scores of a scripted policy against frequencies counted
here, a real tiny model end to end with a bounded number of sampler calls and
compiles, and evaluate's keys and prompts as documented (the same episodes as
``opd.rollout.rollout`` with those keys)."""
import collections
import math

import jax
import numpy as np
import pytest

from opd.eval import evaluation as ev
from opd import rollout as rl
from opd.rollout import policy as policy_lib
from opd.rollout import sampler
from opd.models import ModelConfig, init_params
from opd.tasks import ALL_DOMAINS, AgentEnv, get_task
from opd.text.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64)


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

  def fake(policy, prompts, rng, sampling, **kw):
    seen_sampling.append((sampling.temperature, len(prompts), kw.get("batch_size")))
    out = []
    for p in prompts:
      text = policy.tokenizer.decode(p)
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
      ids = np.asarray(policy.tokenizer.encode(reply + "<|end|>"), np.int32)
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
  monkeypatch.setattr(policy_lib, "sample", _scripted_sampler(examples, greedy_ok, sample_ok, seen))
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
      # A float64 mean of n values in [0, 1], summed in another order: within
      # n eps64 (worst case). Each resample mean moves by as much, and the SE
      # (a std of those means) by at most sqrt(B / (B - 1)) times that.
      tol = 100 * np.size(per_example) * np.finfo(np.float64).eps
      assert got.value == pytest.approx(100 * value, rel=0, abs=tol), (d, m)
      assert got.se == pytest.approx(100 * ev.bootstrap_se(per_example, B, seed), rel=0,
                                     abs=2 * tol), (d, m)
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
  monkeypatch.setattr(policy_lib, "sample", _scripted_sampler(examples, dict.fromkeys(ids, True),
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
    calls.append((len(args[1]), kw.get("batch_size"), kw.get("prompt_bucket")))
    return real_sample(*args, **kw)

  monkeypatch.setattr(policy_lib, "sample", counting)
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


def test_evaluate_rejects_bad_arguments():
  with pytest.raises(ValueError, match="cfg must be an EvalConfig"):
    ev.evaluate(CFG, None, TOK, {"domains": ("math",)})
  with pytest.raises(ValueError, match="name"):
    ev.evaluate(CFG, None, TOK, ev.EvalConfig(), name="a|b")



def test_evaluate_runs_rollout_with_the_documented_keys(monkeypatch):
  """Greedy pass: the eval examples with key(seed); sampled pass: each
  example num_samples times with fold_in(key, 1); both chunked at batch_size
  and sharing one verification cache."""
  from opd import rollout as rollout_lib
  examples = ev.eval_examples(SCRIPT_CFG)
  ids = [ex.id for exs in examples.values() for ex in exs]
  monkeypatch.setattr(policy_lib, "sample", _scripted_sampler(examples, dict.fromkeys(ids, True),
                                                      dict.fromkeys(ids, 1), []))
  seen, real = [], rollout_lib.rollout

  def spy(policy, rows, key, sampling, **kw):
    seen.append(([e.id for e in rows], np.asarray(jax.random.key_data(key)).tolist(),
                 sampling.temperature, kw))
    return real(policy, rows, key, sampling, **kw)

  monkeypatch.setattr(rollout_lib, "rollout", spy)
  ev.evaluate(CFG, None, TOK, SCRIPT_CFG)
  key = jax.random.key(SCRIPT_CFG.seed)
  data = lambda k: np.asarray(jax.random.key_data(k)).tolist()
  (g_ids, g_key, g_t, g_kw), (s_ids, s_key, s_t, s_kw) = seen
  assert g_ids == ids and g_key == data(key) and g_t == 0.0
  assert s_ids == [i for i in ids for _ in range(N_SAMPLES)]
  assert s_key == data(jax.random.fold_in(key, 1)) and s_t == SCRIPT_CFG.temperature
  for kw in (g_kw, s_kw):
    assert kw["chunked"] and kw["batch_size"] == SCRIPT_CFG.batch_size
    assert kw["prompt_bucket"] == SCRIPT_CFG.prompt_bucket
  assert g_kw["log"].verify_cache is s_kw["log"].verify_cache
