"""The pure-functional linen decoder shared by every role (docs/DESIGN.md §2).

RMSNorm, RoPE (rotate-half convention, as in Llama/Qwen), grouped-query
attention, SwiGLU, optional QK-norm, tied or untied LM head, optional scalar
value head. ``Decoder.__call__`` returns logits, the last hidden states
(after the final norm, so ``hidden @ head == logits``), or both, and threads
an explicit KV cache for decoding.

Every parameter carries logical axis names (``vocab``, ``embed``, ``q_heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``norm``, ``scalar``) and activations are
constrained with (``batch``, ``length``, ...); the config's rule table maps
them to the mesh axes ``data``, ``fsdp``, ``tensor``.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opd.models.config import ModelConfig
from opd.models.layers import INIT_STD as _INIT_STD
from opd.models.layers import RMSNorm, init_kind, rope
from opd.models.layers import param as _param
from opd.models.mla import MLAttention
from opd.models.moe import MoEMLP
from opd.models.moe_balance import stack_stats
from opd.models.v4.cache import V4Cache
from opd.models.v4.model import V4Decoder, init_v4_cache
from opd.models.v4.moe import default_tid2eid

Array = jax.Array


class KVCache(NamedTuple):
  """Per-layer keys/values for decoding; a pytree, so it crosses ``jit``.

  Attributes:
    k, v: tuples of ``n_layers`` arrays ``[B, K, S, Dh]`` (kv heads before
      slots: a decode step reads each head's slots contiguously). With
      multi-head latent attention (``cfg.mla``) ``k`` holds the compressed
      latent ``[B, 1, S, C]`` and ``v`` the shared RoPE key ``[B, 1, S, Dr]``
      (``opd.models.mla``).
    mask: ``[B, S]`` bool, True where a slot holds a real (non-pad) token.
    index: int32 scalar, the next slot to write (shared by the batch).
  """
  k: tuple[Array, ...]
  v: tuple[Array, ...]
  mask: Array
  index: Array

  @property
  def max_length(self) -> int:
    return self.mask.shape[1]


class DecoderOutput(NamedTuple):
  """What ``Decoder.__call__`` returns; fields not asked for are None.

  logits: ``[B, T, V]`` float32. hidden: ``[B, T, D]`` last hidden states
  (after the final norm) in the compute dtype. values: ``[B, T]`` float32
  scalar-head outputs (``scalar_head=True`` only). cache: the updated cache.
  moe: ``opd.models.moe_balance.RouterStats`` stacked over the MoE layers
  (``cfg.moe`` set only; ``moe_balance.aux_loss`` turns it into the balance
  loss, ``router_metrics`` into metrics).
  """
  logits: Array | None
  hidden: Array | None
  values: Array | None
  cache: KVCache | None
  moe: Any = None


def init_cache(cfg: ModelConfig, batch: int, max_length: int, dtype=None) -> KVCache | V4Cache:
  """An empty cache of ``max_length`` slots for ``batch`` sequences (a ``V4Cache`` with
  ``cfg.v4``: sliding-window rings and compressor states, ``opd.models.v4.cache``)."""
  dtype = dtype or cfg.compute_dtype
  if cfg.v4 is not None:
    return init_v4_cache(cfg, batch, max_length, dtype)
  shape = (batch, cfg.n_kv_heads, max_length, cfg.resolved_head_dim)  # [B, K, S, Dh]
  v_shape = shape
  if cfg.mla is not None:  # the latent [B, 1, S, C] and the RoPE key [B, 1, S, Dr]
    shape = (batch, 1, max_length, cfg.mla.kv_lora_rank)
    v_shape = (batch, 1, max_length, cfg.mla.qk_rope_head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.n_layers)),
                 mask=jnp.zeros((batch, max_length), bool),
                 index=jnp.zeros((), jnp.int32))


def default_positions(mask: Array) -> Array:
  """Positions that skip padding: ``cumsum(mask) - 1``, clipped at 0.

  Works for left and right padding alike: the first real token of every row
  gets position 0.
  """
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, key_mask, layer_cache):
    """x: [B, T, D]; positions: [B, T]; key_mask: [B, T, S] bool.

    layer_cache: None, or (k [B, K, S, Dh], v [B, K, S, Dh], index) where
    the new keys are written at slots [index, index + T).
    """
    cfg = self.cfg
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    wq = _param(self, "q", (D, H, Dh), ("embed", "q_heads", "head_dim"), pdt)
    wk = _param(self, "k", (D, K, Dh), ("embed", "kv_heads", "head_dim"), pdt)
    wv = _param(self, "v", (D, K, Dh), ("embed", "kv_heads", "head_dim"), pdt)
    wo = _param(self, "o", (H, Dh, D), ("q_heads", "head_dim", "embed"), pdt)
    x = x.astype(dt)
    q = jnp.einsum("BTD,DHE->BTHE", x, wq.astype(dt))
    k = jnp.einsum("BTD,DKE->BTKE", x, wk.astype(dt))
    v = jnp.einsum("BTD,DKE->BTKE", x, wv.astype(dt))
    if cfg.qkv_bias:
      q = q + _param(self, "q_bias", (H, Dh), ("q_heads", "head_dim"), pdt).astype(dt)
      k = k + _param(self, "k_bias", (K, Dh), ("kv_heads", "head_dim"), pdt).astype(dt)
      v = v + _param(self, "v_bias", (K, Dh), ("kv_heads", "head_dim"), pdt).astype(dt)
    if cfg.qk_norm:
      q = RMSNorm(cfg.norm_eps, dt, pdt, name="q_norm")(q)
      k = RMSNorm(cfg.norm_eps, dt, pdt, name="k_norm")(k)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    q = nn.with_logical_constraint(q, ("batch", "length", "q_heads", "head_dim"))
    k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))

    B, T = x.shape[:2]
    G = H // K
    # Heads before slots ([B, K, T, Dh]): only the T new rows move here, and
    # both attention einsums below batch over (B, K) with the cache as stored.
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    new_cache = None
    if layer_cache is not None:
      ck, cv, index = layer_cache
      ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), index, axis=2)
      cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), index, axis=2)
      new_cache = (ck, cv)
      k, v = ck.astype(dt), cv.astype(dt)

    qg = q.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Dh]
    scores = jnp.einsum("BKGTE,BKSE->BKGTS", qg, k,
                        preferred_element_type=jnp.float32) * (Dh ** -0.5)
    big_neg = jnp.finfo(jnp.float32).min
    scores = jnp.where(key_mask[:, None, None, :, :], scores, big_neg)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("BKGTS,BKSE->BTKGE", probs, v).reshape(B, T, H, Dh)
    out = jnp.einsum("BTHE,HED->BTD", out, wo.astype(dt))
    if cfg.o_bias:
      out = out + _param(self, "o_bias", (D,), ("embed",), pdt).astype(dt)
    return out, new_cache


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    wg = _param(self, "gate", (cfg.d_model, cfg.d_ff), ("embed", "mlp"), pdt)
    wu = _param(self, "up", (cfg.d_model, cfg.d_ff), ("embed", "mlp"), pdt)
    wd = _param(self, "down", (cfg.d_ff, cfg.d_model), ("mlp", "embed"), pdt)
    x = x.astype(dt)
    h = jax.nn.silu(x @ wg.astype(dt)) * (x @ wu.astype(dt))
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return h @ wd.astype(dt)


class Block(nn.Module):
  cfg: ModelConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x, positions, key_mask, layer_cache, mask=None):
    """Returns ``(x, new layer cache, RouterStats or None)``; ``mask`` [B, T] feeds the
    MoE block's statistics (layers ``cfg.moe.is_moe_layer(layer)``)."""
    cfg = self.cfg
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.compute_dtype, cfg.storage_dtype, name=name)
    attn_cls = Attention if cfg.mla is None else MLAttention
    attn_out, new_cache = attn_cls(cfg, name="attn")(norm("attn_norm")(x), positions,
                                                     key_mask, layer_cache)
    x = x + attn_out
    stats = None
    if cfg.moe is not None and cfg.moe.is_moe_layer(self.layer):
      mlp_out, stats = MoEMLP(cfg, name="mlp")(norm("mlp_norm")(x), mask)
    else:
      mlp_out = MLP(cfg, name="mlp")(norm("mlp_norm")(x))
    x = x + mlp_out
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x, new_cache, stats


class Decoder(nn.Module):
  """The decoder. See the module docstring."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, positions: Array | None = None,
               mask: Array | None = None, cache: KVCache | None = None, *,
               segment_ids: Array | None = None,
               return_logits: bool = True, return_hidden: bool = False) -> DecoderOutput:
    """Runs the decoder.

    Args:
      tokens: ``[B, T]`` int token ids.
      positions: ``[B, T]`` RoPE positions. Defaults to ``cumsum(mask) - 1``;
        required when ``cache`` is given.
      mask: ``[B, T]`` bool, True for real tokens; padding may be on either
        side. Pad keys are never attended to; outputs at pad positions are
        finite but meaningless.
      cache: a ``KVCache``; the T new keys go to slots
        ``[cache.index, cache.index + T)`` and queries attend to every valid
        earlier slot.
      segment_ids: ``[B, T]`` int, for packed rows: a query attends only to
        keys of its own segment (pass per-document ``positions`` too).
        Not supported together with ``cache``.
      return_logits / return_hidden: which of logits ``[B, T, V]`` (fp32) and
        last hidden states ``[B, T, D]`` to return.
    """
    cfg = self.cfg
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    B, T = tokens.shape
    if mask is None:
      mask = jnp.ones((B, T), bool)
    mask = mask.astype(bool)
    if segment_ids is not None and cache is not None:
      raise ValueError("segment_ids (packed rows) cannot be combined with a KV cache")
    if positions is None:
      if cache is not None:
        raise ValueError("positions must be given when decoding with a cache")
      positions = default_positions(mask)

    embedding = _param(self, "embedding", (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt)
    x = jnp.take(embedding, tokens, axis=0).astype(dt)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

    if cache is None:
      causal = jnp.tril(jnp.ones((T, T), bool))
      key_mask = causal[None] & mask[:, None, :]  # [B, T, T]
      if segment_ids is not None:
        key_mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
      new_mask, index = None, None
    else:
      index = cache.index
      new_mask = jax.lax.dynamic_update_slice_in_dim(cache.mask, mask, index, axis=1)
      slots = jnp.arange(cache.max_length)
      causal = slots[None, :] <= (index + jnp.arange(T))[:, None]  # [T, S]
      key_mask = causal[None] & new_mask[:, None, :]  # [B, T, S]

    block_cls = nn.remat(Block) if cfg.remat else Block
    new_k, new_v, moe_stats = [], [], []
    for i in range(cfg.n_layers):
      layer_cache = None if cache is None else (cache.k[i], cache.v[i], index)
      x, layer_new, stats = block_cls(cfg, i, name=f"layers_{i}")(x, positions, key_mask,
                                                                   layer_cache, mask)
      if stats is not None:
        moe_stats.append(stats)
      if layer_new is not None:
        new_k.append(layer_new[0])
        new_v.append(layer_new[1])

    hidden = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(x)
    logits = None
    if return_logits:
      if cfg.tie_embeddings:
        head = embedding.T
      else:
        head = _param(self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)
      logits = jnp.einsum("BTD,DV->BTV", hidden, head.astype(dt),
                          preferred_element_type=jnp.float32)
      logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

    values = None
    if cfg.scalar_head:
      w = _param(self, "value_head", (cfg.d_model, 1),
                 ("embed", "scalar"), pdt)
      b = _param(self, "value_bias", (1,), ("scalar",), pdt)
      values = (jnp.einsum("BTD,DO->BTO", hidden, w.astype(dt),
                           preferred_element_type=jnp.float32) + b.astype(jnp.float32))[..., 0]

    new_cache = None
    if cache is not None:
      new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), mask=new_mask,
                          index=(index + T).astype(jnp.int32))
    return DecoderOutput(logits=logits, hidden=hidden if return_hidden else None,
                         values=values, cache=new_cache,
                         moe=stack_stats(moe_stats) if moe_stats else None)


# ---------------------------------------------------------------------------
# Functional helpers: params in, arrays out.


# Above this many normal-initialised elements, draw per parameter: a flat
# buffer would cost a second copy of the model, while the per-op XLA compile
# time the flat draw saves (~0.5 s per distinct shape on CPU) no longer matters.
_FLAT_INIT_MAX_ELEMENTS = 1 << 26


def _module(cfg: ModelConfig) -> nn.Module:
  """The family member ``cfg`` names: ``V4Decoder`` with ``cfg.v4``, else ``Decoder``."""
  return Decoder(cfg) if cfg.v4 is None else V4Decoder(cfg)


def _abstract_boxed_params(cfg: ModelConfig):
  tokens = jnp.zeros((1, 2), jnp.int32)
  return jax.eval_shape(lambda: _module(cfg).init(jax.random.key(0), tokens,
                                                  return_hidden=True))["params"]


@functools.partial(jax.jit, static_argnums=0, static_argnames=("boxed",))
def init_params(cfg: ModelConfig, rng: Array, *, boxed: bool = False):
  """Random parameters; jitted with ``cfg`` static.

  Norm scales are ones, biases zeros, everything else N(0, 0.02²) (as
  ``transformers``' default ``initializer_range``). All normal parameters of
  a small model come from ONE ``random.normal`` draw, sliced: XLA on CPU
  compiles each distinct random op separately (~0.5 s each), which made a
  per-parameter init of a 2-layer model take ~13 s. Returns plain arrays, or
  ``nn.LogicallyPartitioned`` boxes carrying logical axis names if ``boxed``.
  """
  abstract = _abstract_boxed_params(cfg)
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_box)
  kinds = [init_kind(path[-1].key) for path, _ in flat]
  shapes = [(box.value if is_box(box) else box) for _, box in flat]
  normal_sizes = [x.size for x, k in zip(shapes, kinds) if k == "normal"]
  dtype = cfg.storage_dtype
  if sum(normal_sizes) <= _FLAT_INIT_MAX_ELEMENTS:
    buffer = jax.random.normal(rng, (sum(normal_sizes),), jnp.float32) * _INIT_STD
    offsets = iter(np.cumsum([0] + normal_sizes[:-1]))
    draw = lambda x, i: jax.lax.dynamic_slice_in_dim(buffer, next(offsets), x.size).reshape(x.shape)
  else:
    draw = lambda x, i: jax.random.normal(jax.random.fold_in(rng, i), x.shape, jnp.float32) * _INIT_STD
  values = []
  for i, (x, kind) in enumerate(zip(shapes, kinds)):
    if kind == "normal":
      v = draw(x, i)
    elif kind == "table":  # DeepSeek-V4's hash routing table (opd.models.v4.moe)
      v = default_tid2eid(cfg.vocab_size, cfg.moe).reshape(x.shape)
    else:
      v = (jnp.ones if kind == "ones" else jnp.zeros)(x.shape, jnp.float32)
    values.append(v.astype(dtype))
  if boxed:
    values = [box.replace_boxed(v) if is_box(box) else v for (_, box), v in zip(flat, values)]
  return jax.tree_util.tree_unflatten(treedef, values)


def param_logical_axes(cfg: ModelConfig):
  """Pytree (same structure as the params) of logical-axis ``PartitionSpec``s."""
  return nn.get_partition_spec(_abstract_boxed_params(cfg))


def head_matrix(cfg: ModelConfig, params) -> Array:
  """The LM head as ``[D, V]`` (the transposed embedding when tied)."""
  if cfg.tie_embeddings:
    return params["embedding"].T
  return params["lm_head"]


@jax.jit
def _id_range(ids: Array) -> tuple[Array, Array]:
  return jnp.min(ids), jnp.max(ids)


def check_token_ids(ids, vocab_size: int, name: str = "tokens") -> None:
  """Raises ValueError unless concrete ``ids`` are integers in ``[0, vocab_size)``.

  Every position counts, padding included: an embedding row of NaN at a pad
  key still reaches the real queries through ``0 * NaN`` in attention.

  Inside ``jit`` the ids are tracers and are not checked (checking them would
  cost a device round trip per step): there an id >= V reads a NaN embedding
  row or logit (``jnp.take``'s fill mode) and a negative id wraps around to
  another token. The contract is that ids are checked where they enter from
  the host: ``forward`` and ``token_logprobs`` on concrete arrays (this
  function), the sampler's prompts (``opd.rollout.sampler.generate``) and the
  data pipeline (``opd.training.data.DataConfig(vocab_size=...)``).

  Args:
    ids: token ids of any shape (numpy, list or a concrete ``jax.Array``;
      a tracer is let through).
    vocab_size: V.
    name: the argument's name, for the message.
  """
  if isinstance(ids, jax.core.Tracer):
    return
  if not isinstance(ids, jax.Array):
    ids = np.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
  if ids.size == 0:
    return
  if isinstance(ids, jax.Array):
    lo, hi = (int(v) for v in jax.device_get(_id_range(ids)))  # one small fused reduction
  else:
    lo, hi = int(ids.min()), int(ids.max())
  if lo < 0 or hi >= vocab_size:
    raise ValueError(f"{name} ids must lie in [0, vocab_size={vocab_size}); got "
                     f"{'max ' + str(hi) if hi >= vocab_size else 'min ' + str(lo)} "
                     f"(min {lo}, max {hi}, shape {tuple(ids.shape)})")


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_logits", "return_hidden"))
def _forward_jit(cfg: ModelConfig, params, tokens, positions=None, mask=None, cache=None, *,
                 segment_ids=None, return_logits=True, return_hidden=False) -> DecoderOutput:
  out = _module(cfg).apply({"params": params}, tokens, positions, mask, cache,
                           segment_ids=segment_ids, return_logits=return_logits,
                           return_hidden=return_hidden)
  return out if cfg.v4 is None else DecoderOutput(*out)


def forward(cfg: ModelConfig, params, tokens, positions=None, mask=None, cache=None, *,
            segment_ids=None, return_logits=True, return_hidden=False) -> DecoderOutput:
  """``Decoder(cfg).apply`` with the params dict; the usual entry point.

  Jitted with ``cfg`` static (one compile per config and shape); calling it
  inside another jitted function simply inlines it. Concrete ``tokens`` are
  checked first (``check_token_ids``: ValueError naming the offending id and
  V); traced ones are the caller's contract, as documented there.
  """
  check_token_ids(tokens, cfg.vocab_size, "tokens")
  return _forward_jit(cfg, params, tokens, positions, mask, cache, segment_ids=segment_ids,
                      return_logits=return_logits, return_hidden=return_hidden)


def token_logprobs(logits: Array, targets: Array, temperature: float = 1.0) -> Array:
  """``log softmax(logits / temperature)[targets]``: [B, T, V], [B, T] -> [B, T] fp32.

  Concrete ``targets`` outside ``[0, V)`` raise (``check_token_ids``).
  """
  check_token_ids(targets, logits.shape[-1], "targets")
  logits = logits.astype(jnp.float32) / temperature
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return picked - lse


def last_token_values(values: Array, mask: Array) -> Array:
  """Scalar-head output at each row's last real token. [B, T], [B, T] -> [B].

  Rows are assumed right-padded or left-padded; the last True of ``mask`` is
  used in both cases.
  """
  T = mask.shape[1]
  last = T - 1 - jnp.argmax(mask[:, ::-1].astype(jnp.int32), axis=1)
  return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]
