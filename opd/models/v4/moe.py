"""DeepSeek-V4's MoE layers: hash-routed and top-k routed, with a clipped SwiGLU
(docs/DESIGN.md §2, "DeepSeek-V4").

Per token ``x [D]`` with E routed experts of width Fe, top-k:

* router logits ``z = x W_r [E]`` (fp32), scores ``s = sqrt(softplus(z))``
  (``MoEConfig.router="sqrtsoftplus"``; softmax and sigmoid also work);
* ``mlp_type="moe"``: the chosen set 𝒯 is the top-k of ``s + b`` with the
  per-expert ``selection_bias`` b (HF ``e_score_correction_bias``), as
  ``opd.models.moe.route``;
* ``mlp_type="hash_moe"``: 𝒯 = ``tid2eid[token_id]``, a frozen ``[V, k]``
  table of expert ids (no bias);
* weights ``g_e = s_e / (Σ_{j∈𝒯} s_j + 1e-20) · routed_scaling_factor``;
* ``y = Σ_{e∈𝒯} g_e SwiGLU_e(x) + SwiGLU_shared(x)`` where every SwiGLU is
  clipped: ``silu(min(g, L)) · clip(u, -L, L)``, L = ``swiglu_limit``, and
  the shared expert is one expert of width Fe.

The routed experts reuse ``opd.models.moe``'s dropless ragged dispatch; under a
mesh its expert-parallel one (E / |expert| experts per device along the
``expert`` mesh axis, the clip included), whatever the router picked them
(hash table or top-k).

Params (our layout): ``router [D, E]``, ``selection_bias [E]`` (top-k
layers), ``gate, up [E, D, Fe]``, ``down [E, Fe, D]``, ``shared_gate,
shared_up [D, Fe]``, ``shared_down [Fe, D]``. The hash table is not a
parameter the gradient moves: it is the param ``tid2eid [V·k]`` (row-major
``[V, k]``), expert ids stored exactly as fp32 so the params stay one float
tree for the trainers; being 1-D with a zero gradient, AdamW neither moves
nor decays it (a checkpoint supplies it; ``init`` fills it with the hash
``(t·k + j) mod E``, k distinct experts per token; logical axis ``vocab``,
split by rows as the embedding).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.config.fields import check_fields
from opd.models.layers import param
from opd.models.moe import (MoEConfig, Routing, batch_mesh_axes, experts_expert_parallel,
                            experts_onehot, experts_ragged, route, router_scores, swiglu)

Array = jax.Array
MLP_TYPES = ("moe", "hash_moe")


@dataclasses.dataclass(frozen=True)
class V4MoEConfig:
  """One V4 MoE layer (transformers' ``DeepseekV4Config`` field in brackets).

  Attributes:
    d_model: D (``hidden_size``).
    moe: E (``n_routed_experts``), k (``num_experts_per_tok``), Fe
      (``moe_intermediate_size``), router (``scoring_func``),
      ``routed_scaling_factor``; ``norm_topk_prob`` must be True and
      ``n_shared_experts`` 1 (V4 always renormalises and has one shared expert
      of width Fe), ``n_group`` 1.
    mlp_type: "moe" (learnt top-k) or "hash_moe" (``tid2eid``) (``mlp_layer_types[i]``).
    vocab_size: V, rows of the hash table (``vocab_size``).
    swiglu_limit: L, the SwiGLU clip (``swiglu_limit``).
  """
  d_model: int
  moe: MoEConfig
  mlp_type: str = "moe"
  vocab_size: int = 1
  swiglu_limit: float = 10.0

  def __post_init__(self):
    check_fields(self, "V4MoEConfig", ints={"d_model": 1, "vocab_size": 1},
                 positive=("swiglu_limit",), choices={"mlp_type": MLP_TYPES})
    m = self.moe
    if not m.norm_topk_prob:
      raise ValueError("V4MoEConfig.moe.norm_topk_prob must be True (DeepSeek-V4 always "
                       f"renormalises the top-k weights), got {m.norm_topk_prob}")
    if m.n_shared_experts != 1:
      raise ValueError("V4MoEConfig.moe.n_shared_experts must be 1 (one shared expert of "
                       f"width moe_d_ff), got {m.n_shared_experts}")
    if m.n_group != 1:
      raise ValueError(f"V4MoEConfig.moe.n_group must be 1, got {m.n_group}")


def hash_route(logits: Array, token_ids: Array, tid2eid: Array, moe: MoEConfig) -> Routing:
  """Hash routing: the experts of token t are ``tid2eid[t]``, weighted by the router.

  Args:
    logits: ``[..., E]`` router logits. token_ids: ``[...]`` int token ids.
    tid2eid: ``[V, k]`` int expert ids per token id.

  Returns:
    ``Routing`` whose weights are ``s_e / (Σ_{j∈𝒯} s_j + 1e-20) · routed_scaling_factor``.
  """
  if tid2eid.shape[-1] != moe.experts_per_token:
    raise ValueError(f"tid2eid has {tid2eid.shape[-1]} experts per token, "
                     f"MoEConfig.experts_per_token={moe.experts_per_token}")
  if token_ids.shape != logits.shape[:-1]:
    raise ValueError(f"hash routing needs one token id per row: {token_ids.shape=}, "
                     f"{logits.shape=}")
  scores = router_scores(logits.astype(jnp.float32), moe.router)
  experts = jnp.take(tid2eid, token_ids, axis=0).astype(jnp.int32)  # [..., k]
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return Routing(experts, weights * moe.routed_scaling_factor, scores)


def default_tid2eid(vocab_size: int, moe: MoEConfig) -> Array:
  """``[V, k]`` table ``(t·k + j) mod E``: k distinct experts per token, balanced over E."""
  t = jnp.arange(vocab_size, dtype=jnp.int32)[:, None]
  j = jnp.arange(moe.experts_per_token, dtype=jnp.int32)[None, :]
  return (t * moe.experts_per_token + j) % moe.n_routed_experts


class V4MoE(nn.Module):
  """``(x [B, T, D], token_ids [B, T] | None) -> (y [B, T, D], Routing)``.

  ``token_ids`` is required by a "hash_moe" layer. Computes in ``x``'s dtype
  with fp32 router logits; params are fp32.
  """
  cfg: V4MoEConfig

  @nn.compact
  def __call__(self, x: Array, token_ids: Array | None = None):
    cfg, moe = self.cfg, self.cfg.moe
    D, E, Fe = cfg.d_model, moe.n_routed_experts, moe.moe_d_ff
    if x.ndim != 3 or x.shape[-1] != D:
      raise ValueError(f"V4MoE: x must be [B, T, d_model={D}], got {x.shape=}")
    B, T, _ = x.shape
    dt = x.dtype
    w_router = param(self, "router", (D, E), ("embed", None), jnp.float32)
    logits = jnp.einsum("BTD,DE->BTE", x, w_router.astype(dt), preferred_element_type=jnp.float32)
    if cfg.mlp_type == "hash_moe":
      if token_ids is None:
        raise ValueError("V4MoE: a 'hash_moe' layer needs token_ids, got None")
      V, k = cfg.vocab_size, moe.experts_per_token
      init = lambda key, shape, dtype: default_tid2eid(V, moe).reshape(shape).astype(dtype)
      table = self.param("tid2eid", nn.with_logical_partitioning(init, ("vocab",)), (V * k,),
                         jnp.float32)
      # The ids are stored exactly as floats; the int cast carries no gradient.
      ids = jax.lax.stop_gradient(table).reshape(V, k).astype(jnp.int32)
      r = hash_route(logits, token_ids, ids, moe)
    else:
      bias = param(self, "selection_bias", (E,), (None,), jnp.float32)
      r = route(logits, moe, bias)
    wg = param(self, "gate", (E, D, Fe), ("expert", "embed", "mlp"), jnp.float32)
    wu = param(self, "up", (E, D, Fe), ("expert", "embed", "mlp"), jnp.float32)
    wd = param(self, "down", (E, Fe, D), ("expert", "mlp", "embed"), jnp.float32)
    flat = lambda a: a.reshape(B * T, -1)
    weights = r.weights.astype(dt)
    if moe.dispatch == "onehot":
      y = experts_onehot(flat(x), flat(r.experts), flat(weights), wg, wu, wd, cfg.swiglu_limit)
    elif not jax.sharding.get_abstract_mesh().empty:  # expert-parallel (opd.models.moe)
      y, _ = experts_expert_parallel(x, r.experts, weights, wg, wu, wd, moe, batch_mesh_axes(),
                                     cfg.swiglu_limit)
    else:
      y, _ = experts_ragged(flat(x), flat(r.experts), flat(weights), wg, wu, wd,
                            limit=cfg.swiglu_limit)
    sg = param(self, "shared_gate", (D, Fe), ("embed", "mlp"), jnp.float32)
    su = param(self, "shared_up", (D, Fe), ("embed", "mlp"), jnp.float32)
    sd = param(self, "shared_down", (Fe, D), ("mlp", "embed"), jnp.float32)
    shared = swiglu(x @ sg.astype(dt), x @ su.astype(dt), cfg.swiglu_limit) @ sd.astype(dt)
    return y.reshape(B, T, D) + shared, r
