"""opd.training.sft and opd.tasks.domain_examples: the SFT data that jobs share.

The end-to-end run (``train_sft`` through ``train_lm``) is the ``sft`` config's
tiny smoke test (tests/experiments/test_configs.py) and the distillation job's
teacher building (tests/experiments/test_distill_job.py).
"""
import collections

import numpy as np
import pytest

from opd import tasks as tasks_lib
from opd.text.tokenizers import ByteTokenizer
from opd.training.sft import SFTData, sft_pairs


@pytest.mark.parametrize("n, difficulties", [(7, (1, 2, 3)), (4, (2,)), (5, (1, 3))])
def test_domain_examples_spread_n_over_the_levels(n, difficulties):
  got = tasks_lib.domain_examples(("math", "instruct"), "train", n, 0, difficulties)
  counts = collections.Counter((ex.domain, ex.difficulty) for ex in got)
  for d in ("math", "instruct"):
    # The first n % L levels take one more: sizes differ by at most one and sum to n.
    want = [n // len(difficulties) + (i < n % len(difficulties))
            for i in range(len(difficulties))]
    assert [counts[(d, lvl)] for lvl in difficulties] == want
  assert all(ex.split == "train" for ex in got)
  assert [ex.domain for ex in got] == ["math"] * n + ["instruct"] * n


def test_domain_examples_unique_draws_no_repeats():
  got = tasks_lib.domain_examples(("math",), "test", 12, 3, (1, 2), unique=True)
  assert len({ex.id for ex in got}) == len(got) == 12


def test_domain_examples_refuses_no_levels():
  with pytest.raises(ValueError, match="difficulties"):
    tasks_lib.domain_examples(("math",), "train", 4, 0, ())


def test_sft_pairs_train_the_assistant_answer_only():
  tok = ByteTokenizer()
  ex = tasks_lib.domain_examples(("math",), "train", 1, 0, (1,))[0]
  (ids, mask), = sft_pairs([ex], tok)
  assert ids.shape == mask.shape
  trained = tok.decode(np.asarray(ids)[np.asarray(mask) > 0].tolist())
  answer = ex.messages()[-1]["content"]
  assert answer in trained  # the reference answer is trained ...
  assert ex.messages()[0]["content"] not in trained  # ... the user's prompt is not


@pytest.mark.parametrize("field, value", [("num_train", 0), ("seq_len", -1),
                                          ("batch_size", 0), ("mode", "ragged"),
                                          ("domains", ()), ("difficulties", ())])
def test_sft_data_names_a_bad_field(field, value):
  good = dict(domains=("math",), num_train=4, num_eval=2, difficulties=(1,), seq_len=64,
              batch_size=2)
  with pytest.raises(ValueError, match=field):
    SFTData(**{**good, field: value})


@pytest.mark.parametrize("fraction, others, want", [(0.5, 4, 1000), (0.2, 2, 500), (0.0, 4, 0)])
def test_replay_share_of_the_train_examples(fraction, others, want):
  """num_replay per replay domain = f/(1-f) of the trained examples, split evenly:
  f = 0.5 over 4 others with 4,000 own -> 4,000 replayed, 1,000 each."""
  domains = ("code", "instruct", "agent", "writing")[:others]
  d = SFTData(domains=("math",), num_train=4000, num_eval=2, difficulties=(1,), seq_len=64,
              batch_size=2, replay_domains=domains if fraction else (), replay_fraction=fraction)
  assert d.num_replay == want
  if fraction:
    replayed = d.num_replay * others
    assert replayed / (replayed + 4000) == pytest.approx(fraction, abs=1e-3)


def test_train_sft_mixes_the_replayed_domains_in(monkeypatch):
  from opd.training import sft as sft_lib  # noqa: PLC0415
  from opd.training.loop_config import Runtime  # noqa: PLC0415
  from opd.models import ModelConfig  # noqa: PLC0415
  seen = []

  def capture(examples, tok):
    seen.extend(examples)
    raise StopIteration  # stop before training

  monkeypatch.setattr(sft_lib, "sft_pairs", capture)
  data = SFTData(domains=("math",), num_train=6, num_eval=2, difficulties=(1,), seq_len=64,
                 batch_size=2, replay_domains=("code", "writing"), replay_fraction=0.5)
  cfg = ModelConfig(vocab_size=270, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
  with pytest.raises(StopIteration):
    sft_lib.train_sft(cfg, None, data, "/nonexistent", optim=None, loop=None,
                      runtime=Runtime(None))
  assert collections.Counter(e.domain for e in seen) == {"math": 6, "code": 3, "writing": 3}


@pytest.mark.parametrize("kwargs, match", [
    (dict(replay_fraction=0.5), "needs replay_domains"),
    (dict(replay_domains=("code",), replay_fraction=1.0), "replay_fraction=1.0"),
    (dict(replay_domains=("math",), replay_fraction=0.5), "repeats the trained domains"),
])
def test_bad_replay_fields_are_named(kwargs, match):
  good = dict(domains=("math",), num_train=4, num_eval=2, difficulties=(1,), seq_len=64,
              batch_size=2)
  with pytest.raises(ValueError, match=match):
    SFTData(**{**good, **kwargs})
