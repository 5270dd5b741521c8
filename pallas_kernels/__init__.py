"""Fused LM-head + divergence kernels (depends on jax only).

The core is :func:`fused_reverse_kl`: the student's per-token reverse KL to K
teachers over the full vocabulary, computed from hidden states and output
heads without materialising ``[T, V]`` logits (docs/DESIGN.md §3–4), with Pallas
(TPU tiled / GPU looped layouts, interpret mode on CPU), chunked-XLA and
materialised-reference implementations and a vocabulary-sharded variant.
The companion losses (cross-entropy, forward KL, JSD(β), top-k and
token-level estimators) share its chunked machinery.

For training, :func:`fused_reverse_kl_train` returns the scalar
``Σ_t c_t · loss_t`` with its gradients computed in the same pass
(gradient in forward, docs/DESIGN.md §4); :func:`fused_cross_entropy_train`
is its cross-entropy counterpart.

Module map: ``api`` (public call, dispatch), ``train_loss`` (training
entry, chunked grads function), ``train_grads`` (the grads functions'
contract and reference, below every implementation), ``train_ce``, ``inputs`` (validation),
``tile_math`` (online accumulators, shared by every path), ``chunked``,
``pallas_kl`` (+ ``pallas_kl_tiled``, ``pallas_kl_looped``), ``pallas_train``
(+ ``pallas_train_looped``: the training entry's Pallas kernels), ``reference``,
``sharded``, ``sharded_train``, ``divergence`` + ``losses`` (companion losses).
"""
from pallas_kernels.api import fused_reverse_kl, stats_function
from pallas_kernels.chunked import ChunkSizes, vocab_stats_chunked
from pallas_kernels.losses import (fused_cross_entropy, fused_forward_kl, fused_jsd,
                                   fused_token_level_kl, fused_topk_kl)
from pallas_kernels.pallas_kl import BlockSizes, vocab_stats_pallas
from pallas_kernels.pallas_train import TrainBlockSizes, train_grads_pallas
from pallas_kernels.reference import reverse_kl_reference, vocab_stats_reference
from pallas_kernels.sharded import fused_reverse_kl_sharded, vocab_stats_sharded
from pallas_kernels.sharded_train import fused_reverse_kl_train_sharded
from pallas_kernels.tile_math import Stats
from pallas_kernels.train_ce import fused_cross_entropy_train
from pallas_kernels.train_loss import TrainChunkSizes, fused_reverse_kl_train

__all__ = [
    "BlockSizes", "ChunkSizes", "Stats", "TrainBlockSizes", "TrainChunkSizes",
    "fused_cross_entropy", "fused_reverse_kl_train_sharded", "train_grads_pallas",
    "fused_cross_entropy_train", "fused_forward_kl", "fused_jsd", "fused_reverse_kl",
    "fused_reverse_kl_sharded", "fused_reverse_kl_train", "fused_token_level_kl", "fused_topk_kl",
    "reverse_kl_reference", "stats_function", "vocab_stats_chunked", "vocab_stats_pallas",
    "vocab_stats_reference", "vocab_stats_sharded",
]
