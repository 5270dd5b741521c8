"""grm.verify.sampling: prompts rendered as user turns, fixed-size chunks, fresh keys, cut samples marked."""
import jax
import numpy as np
import pytest

import grm.verify.sampling as sampling_lib
from grm.format import user_prompt_ids
from grm.verify.format import parse_analysis
from opd.rollout.episodes import Completion, sampling_for_chat
from opd.text.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def test_chunks_keys_and_truncation(monkeypatch):
  seen = []

  def fake_sample(policy, prompts, rng, sampling, *, batch_size, **kw):
    seen.append((len(prompts), batch_size, jax.random.key_data(rng).tolist(),
                 [policy.tokenizer.decode(p) for p in prompts]))
    # Echo a score line; the prompt "cut" is a sample that hit the budget after "Score: 0".
    return [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), "cut" not in text,
                       "No issues.\nScore: 0" if "cut" in text else "No issues.\nScore: 1")
            for text in (policy.tokenizer.decode(p) for p in prompts)]

  monkeypatch.setattr(sampling_lib, "sample", fake_sample)
  fn = sampling_lib.sampler_fn(None, None, TOK, sampling_for_chat(TOK, max_new_tokens=4), seed=3,
                               batch_size=2)
  out = fn(["p1", "p2", "cut"])
  assert [s[:2] for s in seen] == [(2, 2), (1, 2)]          # fixed rows per sampler call
  assert seen[0][3][0] == TOK.decode(user_prompt_ids(TOK, "p1"))
  assert out[:2] == ["No issues.\nScore: 1"] * 2
  # A cut "Score: 0" (maybe of "Score: 0.5") must not parse as a complete analysis.
  assert out[2].endswith(sampling_lib.TRUNCATED) and not parse_analysis(out[2]).valid
  fn(["p1"])
  keys = [tuple(np.ravel(s[2])) for s in seen]
  assert len(set(keys)) == 3                                # every chunk of every call differs
  again = sampling_lib.sampler_fn(None, None, TOK, sampling_for_chat(TOK, max_new_tokens=4),
                                  seed=3, batch_size=2)
  seen.clear()
  again(["p1", "p2"])
  assert tuple(np.ravel(seen[0][2])) == keys[0]             # reproducible from the seed
  with pytest.raises(ValueError, match="batch_size"):
    sampling_lib.sampler_fn(None, None, TOK, sampling_for_chat(TOK, max_new_tokens=4),
                            batch_size=0)


def test_constrained_samples_of_a_random_model_parse_valid():
  """A random tiny verifier: under the analysis grammar every finished sample parses
  valid; unconstrained, none does. The grammar ends a sample with probability about 1/2
  at each line break (a near-uniform model picks "Line" or "Score" alike), and a
  line is <= 23 tokens, so 128 tokens cut a sample only after >= 5 issue lines
  (probability ~2^-5 per row): at least 12 of 16 rows finish."""
  from grm.verify.format import ANALYSIS_PATTERN, verifier_prompt  # noqa: PLC0415
  from opd.models import ModelConfig, init_params  # noqa: PLC0415
  cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                    d_ff=64)
  params = init_params(cfg, jax.random.key(0))
  sampling = sampling_for_chat(TOK, max_new_tokens=128, temperature=1.0)
  prompts = [verifier_prompt("What is 2 + 3?", f"Answer: {i}") for i in range(16)]
  texts = {}
  for constrained in (ANALYSIS_PATTERN, False):
    texts[bool(constrained)] = sampling_lib.sampler_fn(
        cfg, params, TOK, sampling, seed=0, batch_size=16, constrained=constrained)(prompts)
  finished = [t for t in texts[True] if not t.endswith(sampling_lib.TRUNCATED)]
  assert len(finished) >= 12
  assert all(parse_analysis(t).valid for t in finished), finished
  assert not any(parse_analysis(t).valid for t in texts[False])
  with pytest.raises(ValueError, match="constrained=''"):
    sampling_lib.sampler_fn(cfg, params, TOK, sampling, constrained="")
