"""The tokenizer benchmark (--quick): its JSON holds the same-run ratios, each
equal to a recount with the built tokenizers, and a second run reuses them."""
import json

import numpy as np
import pytest

from experiments.benchmarks import tokenizer as bench
from opd.tasks import domain_examples, render_messages
from opd.text.bpe import BPETokenizer
from opd.text.tokenizers import ByteTokenizer


def test_quick_run_reports_recountable_ratios_and_reuses_builds(tmp_path):
  args = ["--quick", "--out", str(tmp_path), "--tokenizers", str(tmp_path / "tok")]
  payload = bench.main(args)
  record = json.loads((tmp_path / "tokenizer_quick.json").read_text())
  assert record["rows"] == json.loads(json.dumps(payload["rows"])) and "machine" in record
  build = payload["builds"][0]
  tok = BPETokenizer(build["dir"])
  exs = domain_examples(("writing",), "test", bench.QUICK["n"] * 3, seed=0,
                        difficulties=(1, 2, 3))
  texts = [render_messages(e.messages()) for e in exs]
  want = (np.mean([len(ByteTokenizer().encode(t)) for t in texts])
          / np.mean([len(tok.encode(t)) for t in texts]))
  row = next(r for r in payload["rows"]
             if r["tokenizer"] == build["tokenizer"] and r["domain"] == "writing")
  assert row["ratio"] == want and row["ratio"] > 1
  assert not build["reused"] and all(b["reused"] for b in bench.main(args)["builds"])


def test_jobs_tokenizer_for_builds_the_named_tokenizer(tmp_path, monkeypatch):
  """experiments.common.tokenizer_for: the model config's tokenizer; "byte" as
  before, "bpe:<V>" built once under the workdir, a second workdir of the same
  process gets a byte-identical copy (no second build), and a tokenizer that is
  not the model's is refused."""
  from experiments import common  # noqa: PLC0415
  from opd.models import ModelConfig  # noqa: PLC0415
  from opd.tasks import tokenizer as task_tok  # noqa: PLC0415
  from opd.text.tokenizers import check_vocab  # noqa: PLC0415
  monkeypatch.setattr(common, "_TOKENIZERS_BUILT", {})
  model = lambda v, spec="byte": ModelConfig(vocab_size=v, d_model=16, n_layers=1, n_heads=2,
                                             n_kv_heads=1, d_ff=32, tokenizer=spec)
  assert isinstance(common.tokenizer_for(model(270)), ByteTokenizer)
  tok = common.tokenizer_for(model(512, "bpe:400"), tmp_path / "a")
  first = tmp_path / "a" / "tokenizer" / "bpe_400" / "tokenizer.json"
  assert isinstance(tok, BPETokenizer) and tok.spec == "bpe:400" and first.exists()
  builds = []
  monkeypatch.setattr(task_tok, "bpe_corpus", lambda cfg: builds.append(cfg) or [])
  again = common.tokenizer_for(model(512, "bpe:400"), tmp_path / "b")
  second = tmp_path / "b" / "tokenizer" / "bpe_400" / "tokenizer.json"
  assert builds == [] and second.read_bytes() == first.read_bytes()
  text = "What is 17 + 25? Answer: 42"
  assert again.encode(text) == tok.encode(text)
  with pytest.raises(ValueError, match="vocab_size=300 is smaller than the tokenizer's 'bpe:400'"):
    model(300, "bpe:400")
  with pytest.raises(ValueError, match="ModelConfig.tokenizer='bpe'"):
    model(512, "bpe")
  with pytest.raises(ValueError, match="needs a workdir"):
    common.tokenizer_for(model(512, "bpe:400"))
  with pytest.raises(ValueError, match="the model's tokenizer='byte'"):
    check_vocab(tok, model(512))
  with pytest.raises(ValueError, match="the model's tokenizer='bpe:400'"):
    check_vocab(ByteTokenizer(), model(512, "bpe:400"))
