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


def test_jobs_tokenizer_for_builds_the_named_tokenizer(tmp_path):
  """experiments.common.tokenizer_for: "byte" as before, "bpe:<V>" built once in the
  directory and checked against the model's vocabulary."""
  from experiments import common  # noqa: PLC0415
  from opd.models import ModelConfig  # noqa: PLC0415
  model = lambda v: ModelConfig(vocab_size=v, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                d_ff=32)
  assert isinstance(common.tokenizer_for(model(270)), ByteTokenizer)
  tok = common.tokenizer_for(model(512), "bpe:400", tmp_path / "tok")
  assert isinstance(tok, BPETokenizer) and (tmp_path / "tok" / "tokenizer.json").exists()
  with pytest.raises(ValueError, match="exceeds the model's vocab_size=300"):
    common.tokenizer_for(model(300), "bpe:400", tmp_path / "tok")
  with pytest.raises(ValueError, match="config.tokenizer='bpe'"):
    common.tokenizer_for(model(512), "bpe", tmp_path / "tok")
