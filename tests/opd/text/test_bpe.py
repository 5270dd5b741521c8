"""The task BPE tokenizer: deterministic build (same config -> byte-identical
tokenizer.json, in this process and another), reuse and refusal by config,
lossless round trips on every domain and on text of the corpus alphabet,
chat special tokens as single ids, and a model with the BPE vocabulary
sampled through the ordinary rollout path."""
import hashlib
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from opd.models import ModelConfig, init_params
from opd import rollout as episodes_lib
from opd.rollout import Policy
from opd.tasks import ALL_DOMAINS, domain_examples, render_messages
from opd.tasks.tokenizer import bpe_corpus, task_tokenizer
from opd.text.bpe import (MIN_VOCAB, BPEConfig, BPETokenizer, build_bpe, parse_tokenizer_spec,
                          resolve_tokenizer)
from opd.text.tokenizers import SPECIAL_TOKENS, ByteTokenizer

# A small corpus keeps the build ~0.3 s; V <= 512 keeps the model test tiny.
CFG = BPEConfig(vocab_size=400, corpus_size=500, seed=3)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = tmp_path_factory.mktemp("bpe")
  return root, build_bpe(root / "a", CFG, bpe_corpus)


def _domain_texts():
  """Test-split conversations (prompt + reference turns) of every domain: text the
  tokenizer never saw."""
  exs = domain_examples(ALL_DOMAINS, "test", 6, seed=11, difficulties=(1, 2, 3))
  return {d: [render_messages(e.messages()) for e in exs if e.domain == d] for d in ALL_DOMAINS}


def test_same_config_gives_byte_identical_files(built, tmp_path):
  root, _ = built
  first = (root / "a" / "tokenizer.json").read_bytes()
  build_bpe(tmp_path / "b", CFG, bpe_corpus)
  assert (tmp_path / "b" / "tokenizer.json").read_bytes() == first
  # Another process (fresh hash seeds in the Rust trainer) builds the same bytes.
  code = ("import sys; from opd.text.bpe import BPEConfig, build_bpe; "
          "from opd.tasks.tokenizer import bpe_corpus; "
          f"build_bpe(sys.argv[1], BPEConfig(**{CFG.to_dict()!r}), bpe_corpus)")
  subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True, timeout=120)
  assert (tmp_path / "c" / "tokenizer.json").read_bytes() == first
  meta = json.loads((root / "a" / "bpe.json").read_text())
  assert meta["tokenizer_sha256"] == hashlib.sha256(first).hexdigest()
  assert meta["config"] == json.loads(json.dumps(CFG.to_dict()))
  assert meta["config_sha256"] == CFG.digest() and meta["build_s"] >= 0
  assert meta["vocab_size_built"] == built[1].vocab_size == CFG.vocab_size


def test_reuse_never_retrains_and_another_config_is_refused(built):
  root, tok = built

  def no_corpus(cfg):
    raise AssertionError("a built tokenizer must be reused, not retrained")

  again = build_bpe(root / "a", CFG, no_corpus)
  text = "<|user|>What is 8 - 4?<|end|>"
  assert again.encode(text) == tok.encode(text) and again.vocab_size == CFG.vocab_size
  other = BPEConfig(vocab_size=CFG.vocab_size + 1, corpus_size=CFG.corpus_size, seed=4)
  with pytest.raises(ValueError, match=r"vocab_size: built 400, asked 401.*seed: built 3"):
    build_bpe(root / "a", other, no_corpus)


def test_changed_or_half_written_directory_is_refused(tmp_path):
  build_bpe(tmp_path / "t", CFG, bpe_corpus)
  path = tmp_path / "t" / "tokenizer.json"
  path.write_bytes(path.read_bytes().replace(b'"Write"', b'"Wrote"', 1))
  with pytest.raises(ValueError, match="the file changed after the build"):
    build_bpe(tmp_path / "t", CFG, bpe_corpus)
  (tmp_path / "t" / "bpe.json").unlink()
  with pytest.raises(ValueError, match="holds only tokenizer.json"):
    build_bpe(tmp_path / "t", CFG, bpe_corpus)


def test_round_trip_on_every_domain_and_shorter_than_bytes(built):
  _, tok = built
  byte = ByteTokenizer()
  for domain, texts in _domain_texts().items():
    assert texts, domain
    for text in texts:
      ids = tok.encode(text, add_bos=True, add_eos=True)
      assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
      assert tok.decode(ids) == f"<|bos|>{text}<|eos|>", domain
      assert tok.decode(ids, skip_special=True) == byte.decode(byte.encode(text),
                                                               skip_special=True)
    # Merges learnt on the train split shorten the held-out text of every domain.
    assert (sum(len(tok.encode(t)) for t in texts)
            < sum(len(byte.encode(t)) for t in texts)), domain


def test_special_tokens_are_single_special_ids(built):
  _, tok = built
  ids = [tok.encode(t) for t in SPECIAL_TOKENS]
  assert all(len(i) == 1 for i in ids)
  flat = [i[0] for i in ids]
  assert sorted(flat) == list(range(len(SPECIAL_TOKENS))) and set(flat) == tok.special_ids
  assert ((tok.bos_id, tok.eos_id, tok.pad_id)
          == tuple(tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]))
  # A special token inside text is still one id: no merge spans one.
  assert tok.encode("x<think>y") == tok.encode("x") + [tok.token_to_id("<think>")] + tok.encode("y")


_ALPHABET = sorted(set("".join(bpe_corpus(CFG))) - {"\n"}) + ["\n", "é", "☃"]


@given(st.lists(st.one_of(st.text(alphabet=_ALPHABET, max_size=30),
                          st.sampled_from(SPECIAL_TOKENS)), max_size=6))
def test_round_trip_property(built, parts):
  _, tok = built
  text = "".join(parts)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  # Special tokens become their own ids, exactly as the byte tokenizer splits them.
  byte = ByteTokenizer()
  specials = [byte.id_to_token(i) for i in byte.encode(text) if i in byte.special_ids]
  assert [tok.id_to_token(i) for i in ids if i in tok.special_ids] == specials


def test_specs_and_resolve(tmp_path):
  assert parse_tokenizer_spec("byte") is None
  assert parse_tokenizer_spec("bpe:1024") == BPEConfig(vocab_size=1024)
  for bad in ("bpe", "bpe:x", "BPE:512", "bpe:-5", None):
    with pytest.raises(ValueError, match=r"config.tokenizer=.*'byte' or 'bpe:<vocab_size>'"):
      parse_tokenizer_spec(bad, "config.tokenizer")
  with pytest.raises(ValueError, match=f"vocab_size 270 must be >= {MIN_VOCAB}"):
    parse_tokenizer_spec("bpe:270")
  with pytest.raises(ValueError, match="BPEConfig.corpus_size"):
    BPEConfig(vocab_size=400, corpus_size=0)
  with pytest.raises(ValueError, match="BPEConfig.difficulties"):
    BPEConfig(vocab_size=400, difficulties=())
  assert isinstance(task_tokenizer("byte", None), ByteTokenizer)
  with pytest.raises(ValueError, match="needs a directory"):
    resolve_tokenizer("bpe:400", None, bpe_corpus)


def test_bpe_model_samples_through_rollout(built):
  """A model with the BPE vocabulary runs the ordinary rollout path: prompts
  rendered and stopped by the BPE ids, episodes' arrays aligned."""
  _, tok = built
  assert isinstance(tok, BPETokenizer)
  model = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=64)
  exs = domain_examples(("math", "instruct", "agent"), "train", 1, seed=0, difficulties=(1,))
  for ex in exs:
    prompt = episodes_lib.prompt_ids(tok, ex)
    byte = ByteTokenizer()
    assert tok.decode(prompt) == byte.decode(episodes_lib.prompt_ids(byte, ex))
  sampling = episodes_lib.sampling_for_chat(tok, max_new_tokens=6, temperature=1.0)
  policy = Policy(model, init_params(model, jax.random.key(0)), tok)
  eps = episodes_lib.rollout(policy, exs, jax.random.key(1), sampling)
  assert [e.example.id for e in eps] == [e.id for e in exs]
  batch = episodes_lib.batch_episodes(eps, seq_len=256, pad_id=tok.pad_id)
  where = batch["loss_mask"] > 0
  for b, ep in enumerate(eps):
    assert np.all(np.asarray(ep.response_ids) < tok.vocab_size)
    np.testing.assert_array_equal(batch["targets"][b][where[b]], ep.response_ids[ep.policy_mask])
