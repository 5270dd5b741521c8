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
