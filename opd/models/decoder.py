"""The pure-functional linen decoder shared by every role (SPEC §2).

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

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.models.config import ModelConfig

Array = jax.Array
_INIT_STD = 0.02  # as transformers' initializer_range default


class KVCache(NamedTuple):
  """Per-layer keys/values for decoding; a pytree, so it crosses ``jit``.

  Attributes:
    k, v: tuples of ``n_layers`` arrays ``[B, S, K, Dh]``.
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
  """
  logits: Array | None
  hidden: Array | None
  values: Array | None
  cache: KVCache | None


def init_cache(cfg: ModelConfig, batch: int, max_length: int, dtype=None) -> KVCache:
  """An empty cache of ``max_length`` slots for ``batch`` sequences."""
  dtype = dtype or cfg.compute_dtype
  shape = (batch, max_length, cfg.n_kv_heads, cfg.resolved_head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
                 mask=jnp.zeros((batch, max_length), bool),
                 index=jnp.zeros((), jnp.int32))


def default_positions(mask: Array) -> Array:
  """Positions that skip padding: ``cumsum(mask) - 1``, clipped at 0.

  Works for left and right padding alike: the first real token of every row
  gets position 0.
  """
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
  eps: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",),
                   self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # As transformers: normalise in fp32, cast, then scale in the input dtype.
    return scale.astype(self.dtype) * x32.astype(self.dtype)


def rope(x: Array, positions: Array, theta: float) -> Array:
  """Rotary embedding, rotate-half convention. x: [B, T, N, Dh]; positions: [B, T]."""
  dh = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))  # [Dh/2]
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
  return out.astype(x.dtype)


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, key_mask, layer_cache):
    """x: [B, T, D]; positions: [B, T]; key_mask: [B, T, S] bool.

    layer_cache: None, or (k [B, S, K, Dh], v [B, S, K, Dh], index) where the
    new keys are written at slots [index, index + T).
    """
    cfg = self.cfg
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    init = nn.initializers.normal(_INIT_STD)
    wq = _param(self, "q", init, (D, H, Dh), ("embed", "q_heads", "head_dim"), pdt)
    wk = _param(self, "k", init, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pdt)
    wv = _param(self, "v", init, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pdt)
    wo = _param(self, "o", init, (H, Dh, D), ("q_heads", "head_dim", "embed"), pdt)
    x = x.astype(dt)
    q = jnp.einsum("BTD,DHE->BTHE", x, wq.astype(dt))
    k = jnp.einsum("BTD,DKE->BTKE", x, wk.astype(dt))
    v = jnp.einsum("BTD,DKE->BTKE", x, wv.astype(dt))
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      q = q + _param(self, "q_bias", zeros, (H, Dh), ("q_heads", "head_dim"), pdt).astype(dt)
      k = k + _param(self, "k_bias", zeros, (K, Dh), ("kv_heads", "head_dim"), pdt).astype(dt)
      v = v + _param(self, "v_bias", zeros, (K, Dh), ("kv_heads", "head_dim"), pdt).astype(dt)
    if cfg.qk_norm:
      q = RMSNorm(cfg.norm_eps, dt, pdt, name="q_norm")(q)
      k = RMSNorm(cfg.norm_eps, dt, pdt, name="k_norm")(k)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    q = nn.with_logical_constraint(q, ("batch", "length", "q_heads", "head_dim"))
    k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))

    new_cache = None
    if layer_cache is not None:
      ck, cv, index = layer_cache
      ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), index, axis=1)
      cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), index, axis=1)
      new_cache = (ck, cv)
      k, v = ck.astype(dt), cv.astype(dt)

    B, T = x.shape[:2]
    G = H // K
    qg = q.reshape(B, T, K, G, Dh)
    scores = jnp.einsum("BTKGE,BSKE->BKGTS", qg, k,
                        preferred_element_type=jnp.float32) * (Dh ** -0.5)
    big_neg = jnp.finfo(jnp.float32).min
    scores = jnp.where(key_mask[:, None, None, :, :], scores, big_neg)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", probs, v).reshape(B, T, H, Dh)
    out = jnp.einsum("BTHE,HED->BTD", out, wo.astype(dt))
    if cfg.o_bias:
      out = out + _param(self, "o_bias", nn.initializers.zeros, (D,), ("embed",), pdt).astype(dt)
    return out, new_cache


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    init = nn.initializers.normal(_INIT_STD)
    wg = _param(self, "gate", init, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), pdt)
    wu = _param(self, "up", init, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), pdt)
    wd = _param(self, "down", init, (cfg.d_ff, cfg.d_model), ("mlp", "embed"), pdt)
    x = x.astype(dt)
    h = jax.nn.silu(x @ wg.astype(dt)) * (x @ wu.astype(dt))
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return h @ wd.astype(dt)


class Block(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, key_mask, layer_cache):
    cfg = self.cfg
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.compute_dtype, cfg.storage_dtype, name=name)
    attn_out, new_cache = Attention(cfg, name="attn")(norm("attn_norm")(x), positions,
                                                       key_mask, layer_cache)
    x = x + attn_out
    x = x + MLP(cfg, name="mlp")(norm("mlp_norm")(x))
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x, new_cache


class Decoder(nn.Module):
  """The decoder. See the module docstring."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, positions: Array | None = None,
               mask: Array | None = None, cache: KVCache | None = None, *,
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
      return_logits / return_hidden: which of logits ``[B, T, V]`` (fp32) and
        last hidden states ``[B, T, D]`` to return.
    """
    cfg = self.cfg
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    B, T = tokens.shape
    if mask is None:
      mask = jnp.ones((B, T), bool)
    mask = mask.astype(bool)
    if positions is None:
      if cache is not None:
        raise ValueError("positions must be given when decoding with a cache")
      positions = default_positions(mask)

    embedding = _param(self, "embedding", nn.initializers.normal(_INIT_STD),
                       (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt)
    x = jnp.take(embedding, tokens, axis=0).astype(dt)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

    if cache is None:
      causal = jnp.tril(jnp.ones((T, T), bool))
      key_mask = causal[None] & mask[:, None, :]  # [B, T, T]
      new_mask, index = None, None
    else:
      index = cache.index
      new_mask = jax.lax.dynamic_update_slice_in_dim(cache.mask, mask, index, axis=1)
      slots = jnp.arange(cache.max_length)
      causal = slots[None, :] <= (index + jnp.arange(T))[:, None]  # [T, S]
      key_mask = causal[None] & new_mask[:, None, :]  # [B, T, S]

    block_cls = nn.remat(Block) if cfg.remat else Block
    new_k, new_v = [], []
    for i in range(cfg.n_layers):
      layer_cache = None if cache is None else (cache.k[i], cache.v[i], index)
      x, layer_new = block_cls(cfg, name=f"layers_{i}")(x, positions, key_mask, layer_cache)
      if layer_new is not None:
        new_k.append(layer_new[0])
        new_v.append(layer_new[1])

    hidden = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(x)
    logits = None
    if return_logits:
      if cfg.tie_embeddings:
        head = embedding.T
      else:
        head = _param(self, "lm_head", nn.initializers.normal(_INIT_STD),
                      (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)
      logits = jnp.einsum("BTD,DV->BTV", hidden, head.astype(dt),
                          preferred_element_type=jnp.float32)
      logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

    values = None
    if cfg.scalar_head:
      w = _param(self, "value_head", nn.initializers.normal(_INIT_STD), (cfg.d_model, 1),
                 ("embed", "scalar"), pdt)
      b = _param(self, "value_bias", nn.initializers.zeros, (1,), ("scalar",), pdt)
      values = (jnp.einsum("BTD,DO->BTO", hidden, w.astype(dt),
                           preferred_element_type=jnp.float32) + b.astype(jnp.float32))[..., 0]

    new_cache = None
    if cache is not None:
      new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), mask=new_mask,
                          index=(index + T).astype(jnp.int32))
    return DecoderOutput(logits=logits, hidden=hidden if return_hidden else None,
                         values=values, cache=new_cache)


# ---------------------------------------------------------------------------
# Functional helpers: params in, arrays out.


def init_params(cfg: ModelConfig, rng: Array, *, boxed: bool = False):
  """Random parameters (unboxed plain arrays unless ``boxed``)."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  variables = Decoder(cfg).init(rng, tokens, return_hidden=True)
  params = variables["params"]
  return params if boxed else nn.meta.unbox(params)


def param_logical_axes(cfg: ModelConfig):
  """Pytree (same structure as the params) of logical-axis ``PartitionSpec``s."""
  abstract = jax.eval_shape(lambda r: init_params(cfg, r, boxed=True), jax.random.key(0))
  return nn.get_partition_spec(abstract)


def head_matrix(cfg: ModelConfig, params) -> Array:
  """The LM head as ``[D, V]`` (the transposed embedding when tied)."""
  if cfg.tie_embeddings:
    return params["embedding"].T
  return params["lm_head"]


def forward(cfg: ModelConfig, params, tokens, positions=None, mask=None, cache=None, *,
            return_logits=True, return_hidden=False) -> DecoderOutput:
  """``Decoder(cfg).apply`` with the params dict; the usual entry point."""
  return Decoder(cfg).apply({"params": params}, tokens, positions, mask, cache,
                            return_logits=return_logits, return_hidden=return_hidden)


def token_logprobs(logits: Array, targets: Array, temperature: float = 1.0) -> Array:
  """``log softmax(logits / temperature)[targets]``: [B, T, V], [B, T] -> [B, T] fp32."""
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
