"""Sequence lengths of each domain under the byte tokenizer vs task BPE tokenizers.

    python -m experiments.benchmarks.tokenizer                      # V = 512, 1024, 2048
    python -m experiments.benchmarks.tokenizer --vocab-sizes 768,4096
    python -m experiments.benchmarks.tokenizer --quick              # tiny corpus (CI smoke)

Each BPE tokenizer is built (``opd.text.bpe.build_bpe`` on
``opd.tasks.tokenizer.bpe_corpus``: by default 20 000 train-split
conversations at difficulties 1-3, what ``"bpe:<V>"`` builds) under
``--tokenizers`` and reused by later runs; its build time is the one recorded
in its ``bpe.json``. Lengths are measured on held-out text: ``--n`` test-split
examples per domain and difficulty, each as prompt + reference answer turns
(the training row of SFT / the cold start) and as the generation prompt alone
(what a rollout feeds the sampler). Reported per domain and tokenizer: the
mean token counts and ``byte / tokenizer`` ratios measured in the same run;
per BPE tokenizer the vocabulary size actually built (a corpus can run out of
merges before V).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from experiments.benchmarks import common
from opd.tasks import ALL_DOMAINS, domain_examples, render_messages
from opd.tasks.tokenizer import bpe_corpus
from opd.text.bpe import BPEConfig, build_bpe
from opd.text.tokenizers import ByteTokenizer

FULL = dict(vocab_sizes=(512, 1024, 2048), corpus_size=BPEConfig.corpus_size, n=100)
QUICK = dict(vocab_sizes=(300, 400), corpus_size=500, n=4)
DIFFICULTIES = (1, 2, 3)


def _texts(n: int, seed: int) -> dict[str, tuple[list[str], list[str]]]:
  """domain -> (prompt + answer conversations, generation prompts) of the test split."""
  out = {}
  for d in ALL_DOMAINS:
    exs = domain_examples((d,), "test", n * len(DIFFICULTIES), seed=seed,
                          difficulties=DIFFICULTIES)
    out[d] = ([render_messages(e.messages()) for e in exs],
              [render_messages(e.prompt_messages(), add_generation_prompt=True) for e in exs])
  return out


def _lengths(tok, texts) -> dict[str, dict[str, float]]:
  return {d: {"tokens": float(np.mean([len(tok.encode(t)) for t in full])),
              "prompt_tokens": float(np.mean([len(tok.encode(t)) for t in prompts]))}
          for d, (full, prompts) in texts.items()}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny corpus and sample (CI)")
  parser.add_argument("--vocab-sizes", default=None, help="comma-separated V's of the BPE runs")
  parser.add_argument("--tokenizers", default="benchmark_results/tokenizers",
                      help="where the BPE tokenizers are built and reused")
  parser.add_argument("--seed", type=int, default=0, help="the held-out examples' draw")
  parser.add_argument("--out", default="benchmark_results")
  args = parser.parse_args(argv)
  sizes = dict(QUICK if args.quick else FULL)
  if args.vocab_sizes:
    sizes["vocab_sizes"] = tuple(int(v) for v in args.vocab_sizes.split(","))

  texts = _texts(sizes["n"], args.seed)
  byte = _lengths(ByteTokenizer(), texts)
  rows = [{"tokenizer": "byte", "domain": d, **v, "ratio": 1.0, "prompt_ratio": 1.0}
          for d, v in byte.items()]
  builds = []
  for vocab in sizes["vocab_sizes"]:
    cfg = BPEConfig(vocab_size=vocab, corpus_size=sizes["corpus_size"])
    root = pathlib.Path(args.tokenizers) / f"bpe{vocab}_c{cfg.corpus_size}_{cfg.digest()[:8]}"
    reused = (root / "bpe.json").exists()
    t0 = time.perf_counter()
    tok = build_bpe(root, cfg, bpe_corpus)
    meta = json.loads((root / "bpe.json").read_text())
    builds.append({"tokenizer": f"bpe:{vocab}", "vocab_size_built": tok.vocab_size,
                   "corpus_size": cfg.corpus_size,
                   "build_s": meta["build_s"], "reused": reused,
                   "load_s": time.perf_counter() - t0, "dir": str(root)})
    for d, v in _lengths(tok, texts).items():
      rows.append({"tokenizer": f"bpe:{vocab}", "domain": d, **v,
                   "ratio": byte[d]["tokens"] / v["tokens"],
                   "prompt_ratio": byte[d]["prompt_tokens"] / v["prompt_tokens"]})
  overall = []
  for name in ["byte"] + [f"bpe:{v}" for v in sizes["vocab_sizes"]]:
    mine = [r for r in rows if r["tokenizer"] == name]
    tokens = float(np.mean([r["tokens"] for r in mine]))
    overall.append({"tokenizer": name, "mean_tokens": tokens,
                    "ratio": float(np.mean([byte[d]["tokens"] for d in byte])) / tokens,
                    "longest_domain_tokens": max(r["tokens"] for r in mine)})
  print(f"# mean tokens per held-out conversation (prompt + answer) and generation prompt, "
        f"{sizes['n'] * len(DIFFICULTIES)} test examples per domain")
  print(common.format_table(rows, ["tokenizer", "domain", "tokens", "prompt_tokens", "ratio",
                                   "prompt_ratio"]))
  print()
  print(common.format_table(overall))
  print()
  print(common.format_table(builds, ["tokenizer", "vocab_size_built", "corpus_size", "build_s",
                                     "reused"]))
  payload = {"sizes": {**sizes, "difficulties": DIFFICULTIES, "seed": args.seed}, "rows": rows,
             "overall": overall, "builds": builds, "quick": args.quick}
  path = common.write_result("tokenizer_quick" if args.quick else "tokenizer", payload, args.out)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main(sys.argv[1:])
