"""Mixture-of-experts feed-forward block (docs/DESIGN.md §2, "Mixture of experts").

Public API (stable; the Qwen3-MoE and DeepSeek-V3 families both use it):

* ``MoEConfig``: the frozen sub-config ``ModelConfig.moe`` holds (``None`` =
  dense model). One config expresses either router style:

  - Qwen3-MoE: ``router="softmax"``, ``norm_topk_prob`` as the checkpoint,
    ``n_shared_experts=0``, ``aux_loss_coef`` (HF ``router_aux_loss_coef``).
  - DeepSeek-V3: ``router="sigmoid"`` (adds the per-expert
    ``selection_bias``, HF ``e_score_correction_bias``), ``n_group`` /
    ``topk_group`` (group-limited choice), ``routed_scaling_factor``,
    ``n_shared_experts``, ``first_k_dense`` (HF ``first_k_dense_replace``),
    ``bias_update_rate`` and ``seq_aux_loss_coef``.

* ``route(logits, moe, bias=None) -> Routing``: pure top-k selection.
* ``experts_ragged`` / ``experts_onehot``: the routed experts' SwiGLU, dropless,
  through ``jax.lax.ragged_dot`` over tokens sorted by expert, or the dense
  one-hot reference (every expert on every token).
* ``MoEMLP(cfg)``: the linen block, ``(x [B, T, D], mask [B, T]) -> (y, RouterStats)``.
  Parameters (E routed experts, Fe = ``moe_d_ff``, S = ``n_shared_experts``)::

    router          [D, E]        ("embed", None)
    selection_bias  [E]           (None,)             router == "sigmoid" only
    gate, up        [E, D, Fe]    ("expert", "embed", "mlp")
    down            [E, Fe, D]    ("expert", "mlp", "embed")
    shared_gate, shared_up [D, S*Fe], shared_down [S*Fe, D]   S > 0 only

  Under a mesh (``jax.set_mesh``) the routed experts run in ``shard_map`` on
  each device's own tokens; if its ``expert`` axis has size > 1 they run
  expert-parallel: each device holds E / |expert| experts,
  the tokens of its expert group are all-gathered over ``expert``, each
  device applies its own experts, and a reduce-scatter (``psum_scatter``)
  returns each token's sum of expert outputs to the device that owns it.
* ``RouterStats`` / ``router_stats``: one MoE layer's routing statistics
  (stacked over layers by the decoder). ``aux_loss(moe, stats)``,
  ``router_metrics(stats)`` and ``update_selection_bias(cfg, params, counts)``
  (DeepSeek-V3's bias update, applied outside the gradient) live in
  ``opd.models.moe_balance``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from opd.config.fields import check_fields, from_group

Array = jax.Array
ROUTERS = ("softmax", "sigmoid", "sqrtsoftplus")
DISPATCHES = ("ragged", "onehot")
EXPERT_AXIS = "expert"  # the mesh axis experts are sharded along
_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Routed + shared experts replacing the dense MLP of layers >= ``first_k_dense``.

  Attributes:
    n_routed_experts: E, experts a token can be routed to.
    experts_per_token: k, experts each token is routed to (top-k).
    moe_d_ff: Fe, SwiGLU width of one expert (HF ``moe_intermediate_size``).
    n_shared_experts: S, experts every token goes through, fused into one
      SwiGLU of width ``S * moe_d_ff`` (DeepSeek-V3); 0 for Qwen3-MoE.
    router: "softmax" (probabilities over all E) or "sigmoid" (independent
      scores, plus the per-expert ``selection_bias`` used for selection only);
      "sqrtsoftplus" scores ``sqrt(softplus(z))`` (DeepSeek-V4's ``route``;
      its selection bias is passed by ``opd.models.v4.moe``).
    norm_topk_prob: divide the k selected scores by their sum.
    routed_scaling_factor: multiplies the routed experts' weights.
    n_group: experts are split in ``n_group`` equal groups; a token first
      keeps the ``topk_group`` groups with the largest sum of their top-2
      scores, then picks its k experts inside them. 1 = no groups.
    topk_group: groups kept per token (<= ``n_group``).
    first_k_dense: the first layers keep the dense MLP (width ``d_ff``).
    aux_loss_coef: Switch/Qwen3-MoE load-balancing loss coefficient.
    seq_aux_loss_coef: DeepSeek-V3's sequence-wise balance loss coefficient.
    bias_update_rate: gamma of DeepSeek-V3's auxiliary-loss-free balancing
      (``moe_balance.update_selection_bias``); the sigmoid router, or
      sqrtsoftplus with ``ModelConfig.v4``.
    dispatch: "ragged" (grouped matmul, the default) or "onehot" (dense
      reference: every expert on every token; tests and benchmarks).
  """
  n_routed_experts: int = 8
  experts_per_token: int = 2
  moe_d_ff: int = 64
  n_shared_experts: int = 0
  router: str = "softmax"
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  n_group: int = 1
  topk_group: int = 1
  first_k_dense: int = 0
  aux_loss_coef: float = 0.0
  seq_aux_loss_coef: float = 0.0
  bias_update_rate: float = 0.0
  dispatch: str = "ragged"

  def __post_init__(self):
    check_fields(self, "MoEConfig",
                 ints={"n_routed_experts": 1, "experts_per_token": 1, "moe_d_ff": 1,
                       "n_shared_experts": 0, "n_group": 1, "topk_group": 1,
                       "first_k_dense": 0},
                 positive=("routed_scaling_factor",),
                 non_negative=("aux_loss_coef", "seq_aux_loss_coef", "bias_update_rate"),
                 bools=("norm_topk_prob",),
                 choices={"router": ROUTERS, "dispatch": DISPATCHES})
    E, k, G = self.n_routed_experts, self.experts_per_token, self.n_group
    if k > E:
      raise ValueError(f"MoEConfig.experts_per_token={k} exceeds n_routed_experts={E}")
    if E % G:
      raise ValueError(f"MoEConfig.n_routed_experts={E} is not divisible by n_group={G}")
    if self.topk_group > G:
      raise ValueError(f"MoEConfig.topk_group={self.topk_group} exceeds n_group={G}")
    if G > 1 and E // G < 2:
      raise ValueError(f"MoEConfig.n_group={G} leaves {E // G} expert per group; group scores "
                       "sum each group's top 2, so groups need >= 2 experts")
    if G > 1 and k > self.topk_group * (E // G):
      raise ValueError(f"MoEConfig.experts_per_token={k} exceeds the "
                       f"topk_group={self.topk_group} x {E // G} experts the kept groups hold")
    if self.bias_update_rate > 0 and self.router not in ("sigmoid", "sqrtsoftplus"):
      raise ValueError(f"MoEConfig.bias_update_rate={self.bias_update_rate} needs "
                       f"router='sigmoid' or 'sqrtsoftplus' (DeepSeek-V4; the selection "
                       f"bias), got router={self.router!r}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "MoEConfig":
    return from_group(cls, d, "MoEConfig")

  def is_moe_layer(self, layer: int) -> bool:
    return layer >= self.first_k_dense


def router_scores(logits: Array, router: str) -> Array:
  """The router's scores ``s [..., E]`` of ``logits [..., E]`` (fp32), ``router`` in ROUTERS."""
  if router == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if router == "sigmoid":
    return jax.nn.sigmoid(logits)
  if router == "sqrtsoftplus":
    return jnp.sqrt(jax.nn.softplus(logits))
  raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")


class Routing(NamedTuple):
  """``route``'s result for N tokens.

  experts: ``[N, k]`` int32 chosen expert ids (best first). weights:
  ``[N, k]`` float32 combine weights. scores: ``[N, E]`` float32 router
  scores (softmax probabilities or sigmoid scores, without the bias).
  """
  experts: Array
  weights: Array
  scores: Array


def route(logits: Array, moe: MoEConfig, bias: Array | None = None) -> Routing:
  """Top-k routing of ``logits [N, E]`` (docs/DESIGN.md §2, "Mixture of experts").

  s = softmax(logits), sigmoid(logits) or sqrt(softplus(logits)); selection
  uses c = s + bias (``MoEMLP`` passes a bias with the sigmoid router only),
  restricted to the ``topk_group`` groups with the largest top-2 sums of c
  when ``n_group > 1``; the weights are the
  *unbiased* s of the chosen experts, optionally renormalised, times
  ``routed_scaling_factor``. Ties go to the lower expert (group) index.
  """
  E, k, G = moe.n_routed_experts, moe.experts_per_token, moe.n_group
  logits = logits.astype(jnp.float32)
  if logits.shape[-1] != E:
    raise ValueError(f"router logits have {logits.shape[-1]} experts, "
                     f"MoEConfig.n_routed_experts={E}")
  scores = router_scores(logits, moe.router)
  choice = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
  choice = jax.lax.stop_gradient(choice)  # selection is discrete: no gradient through it
  if G > 1:
    grouped = choice.reshape(*choice.shape[:-1], G, E // G)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
    kept = jax.lax.top_k(group_scores, moe.topk_group)[1]  # [N, topk_group]
    keep = jnp.any(kept[..., :, None] == jnp.arange(G), axis=-2)  # [N, G]
    choice = jnp.where(jnp.repeat(keep, E // G, axis=-1), choice, -jnp.inf)
  experts = jax.lax.top_k(choice, k)[1].astype(jnp.int32)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if moe.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return Routing(experts, weights * moe.routed_scaling_factor, scores)


def swiglu(g: Array, u: Array, limit: float | None = None) -> Array:
  """``silu(g) · u``; with ``limit`` (DeepSeek-V4's ``swiglu_limit``) g is first
  clipped to ``<= limit`` and u to ``[-limit, limit]``."""
  if limit is not None:
    g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
  return jax.nn.silu(g) * u


def _swiglu_ragged(xs, wg, wu, wd, group_sizes, limit=None):
  dt = xs.dtype
  h = swiglu(jax.lax.ragged_dot(xs, wg.astype(dt), group_sizes),
             jax.lax.ragged_dot(xs, wu.astype(dt), group_sizes), limit)
  return jax.lax.ragged_dot(h, wd.astype(dt), group_sizes)


def experts_ragged(x: Array, experts: Array, weights: Array, wg: Array, wu: Array, wd: Array,
                   expert_offset: Array | int = 0, limit: float | None = None
                   ) -> tuple[Array, Array]:
  """Σ_j w_j · SwiGLU_{e_j}(x) over the experts held locally, dropless.

  Args:
    x: ``[N, D]`` tokens. experts, weights: ``[N, k]`` from ``route``.
    wg, wu: ``[El, D, Fe]``; wd: ``[El, Fe, D]``: experts
      ``[expert_offset, expert_offset + El)`` (all of them when unsharded).
    limit: the SwiGLU clip (``swiglu``); None = unclipped.

  Returns:
    ``([N, D] output, number of (token, expert) pairs computed here)``.
    Pairs whose expert is not local contribute zero.

  The N·k (token, expert) pairs are sorted by local expert id (non-local
  ones last), gathered into one ``[N·k, D]`` buffer and run through three
  ``ragged_dot`` grouped matmuls with per-expert group sizes; the inverse
  permutation brings the rows back to ``[N, k, D]``.
  """
  N, k = experts.shape
  El = wg.shape[0]
  local = experts.reshape(-1) - expert_offset
  local = jnp.where((local >= 0) & (local < El), local, El)  # El: not held here
  order = jnp.argsort(local, stable=True)
  group_sizes = jnp.bincount(local, length=El + 1)[:El].astype(jnp.int32)
  xs = jnp.take(x, order // k, axis=0)  # [N*k, D]
  ys = _swiglu_ragged(xs, wg, wu, wd, group_sizes, limit)
  held = (jnp.take(local, order) < El)[:, None]
  ys = jnp.where(held, ys, 0)  # rows past the last group are not defined by ragged_dot
  ys = jnp.take(ys, jnp.argsort(order), axis=0).reshape(N, k, -1)  # back to token order
  out = jnp.einsum("NKD,NK->ND", ys, weights.astype(ys.dtype))
  return out, jnp.sum(group_sizes)


def experts_onehot(x: Array, experts: Array, weights: Array, wg: Array, wu: Array,
                   wd: Array, limit: float | None = None) -> Array:
  """The dense reference of ``experts_ragged``: every expert on every token."""
  dt = x.dtype
  E = wg.shape[0]
  combine = jnp.einsum("NKE,NK->NE", jax.nn.one_hot(experts, E, dtype=dt), weights.astype(dt))
  h = swiglu(jnp.einsum("ND,EDF->NEF", x, wg.astype(dt)),
             jnp.einsum("ND,EDF->NEF", x, wu.astype(dt)), limit)
  y = jnp.einsum("NEF,EFD->NED", h, wd.astype(dt))
  return jnp.einsum("NED,NE->ND", y, combine)


def expert_axis_size(mesh=None) -> int:
  """The size of the current (``jax.set_mesh``) mesh's ``expert`` axis; 1 if none."""
  mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
    return 1
  return dict(mesh.shape)[EXPERT_AXIS]


def check_expert_mesh(moe: MoEConfig, expert_shards: int) -> None:
  """Raises unless the mesh's ``expert`` axis divides the routed experts."""
  if moe.n_routed_experts % expert_shards:
    raise ValueError(f"MoEConfig.n_routed_experts={moe.n_routed_experts} is not divisible by "
                     f"the mesh's '{EXPERT_AXIS}' axis of size {expert_shards}")


def experts_expert_parallel(x: Array, experts: Array, weights: Array, wg: Array, wu: Array,
                            wd: Array, moe: MoEConfig, batch_axes,
                            limit: float | None = None) -> tuple[Array, Array]:
  """``experts_ragged`` under the current mesh, experts sharded over its ``expert`` axis.

  x, experts, weights: ``[B, T, ...]`` with B sharded over ``batch_axes``
  (the mesh axes the ``batch`` rule names). Inside ``shard_map`` each device
  all-gathers its expert group's tokens (if ``expert`` is a batch axis),
  applies its E / |expert| experts, and reduce-scatters the partial sums back
  (a ``psum`` when the batch is replicated over ``expert``). Without an
  ``expert`` axis (or of size 1) every device applies all experts to its own
  tokens, with no collective: left to the SPMD partitioner, ``ragged_dot``
  on batch-sharded tokens gathers every token onto every device (global
  group sizes), which made data-parallel MoE ~10x slower on 8 devices.
  ``limit``: the SwiGLU clip (DeepSeek-V4's ``swiglu_limit``; ``swiglu``).
  """
  mesh = jax.sharding.get_abstract_mesh()
  n = expert_axis_size(mesh)
  check_expert_mesh(moe, n)
  batch_axes = tuple(a for a in batch_axes if dict(mesh.shape).get(a, 1) > 1)
  if x.shape[0] % math.prod(dict(mesh.shape)[a] for a in batch_axes):
    batch_axes = ()  # rows the batch shards do not divide: every device takes them all
  gather = EXPERT_AXIS in batch_axes
  tok = P(batch_axes or None)
  w = P(EXPERT_AXIS) if n > 1 else P()

  def local(x, experts, weights, wg, wu, wd):
    if n == 1:
      B, T, D = x.shape
      y, pairs = experts_ragged(x.reshape(B * T, D), experts.reshape(B * T, -1),
                                weights.reshape(B * T, -1), wg, wu, wd, limit=limit)
      return y.reshape(B, T, D), (jax.lax.psum(pairs, batch_axes) if batch_axes else pairs)
    if gather:
      x, experts, weights = (jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
                             for a in (x, experts, weights))
    else:
      # Replicated over `expert`: mark the tokens varying so the backward pass
      # sums their cotangents over the expert shards (ragged_dot's transpose
      # does not insert that psum for an invariant operand by itself).
      x, weights = (jax.lax.pcast(a, EXPERT_AXIS, to="varying") for a in (x, weights))
    B, T, D = x.shape
    offset = jax.lax.axis_index(EXPERT_AXIS) * wg.shape[0]
    y, pairs = experts_ragged(x.reshape(B * T, D), experts.reshape(B * T, -1),
                              weights.reshape(B * T, -1), wg, wu, wd, offset, limit)
    y = y.reshape(B, T, D)
    if gather:
      y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    else:
      y = jax.lax.psum(y, EXPERT_AXIS)
    return y, jax.lax.psum(pairs, tuple(dict.fromkeys(batch_axes + (EXPERT_AXIS,))))

  return jax.shard_map(local, in_specs=(tok, tok, tok, w, w, w), out_specs=(tok, P()))(
      x, experts, weights, wg, wu, wd)


def batch_mesh_axes() -> tuple[str, ...]:
  """The mesh axes the current logical rules (``nn.logical_axis_rules``) give ``batch``."""
  axes = nn.logical_to_mesh_axes(("batch",))[0]
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


class RouterStats(NamedTuple):
  """Sums over one layer's real tokens (leading axis L once stacked).

  counts: ``[E]`` times each expert was chosen. prob_sum: ``[E]`` Σ_t p_t
  with p the softmax probabilities (sigmoid router: the scores normalised
  to sum 1). tokens: real tokens. seq_aux: DeepSeek-V3's
  ``Σ_e f_e P_e`` per sequence, averaged over sequences with a real token.
  entropy_sum: Σ_t H(p_t). dropped: (token, expert) pairs not computed.
  """
  counts: Array
  prob_sum: Array
  tokens: Array
  seq_aux: Array
  entropy_sum: Array
  dropped: Array


def router_stats(moe: MoEConfig, r: Routing, mask: Array | None, dropped: Array) -> RouterStats:
  """``RouterStats`` of ``route``'s result ``r`` for ``[B, T]`` tokens."""
  E, k = moe.n_routed_experts, moe.experts_per_token
  B, T = r.experts.shape[:2]
  m = jnp.ones((B, T), jnp.float32) if mask is None else mask.astype(jnp.float32)
  p = r.scores if moe.router == "softmax" else r.scores / jnp.sum(r.scores, -1, keepdims=True)
  chosen = jnp.sum(jax.nn.one_hot(r.experts, E, dtype=jnp.float32), axis=-2)  # [B, T, E]
  chosen = chosen * m[..., None]
  probs = p * m[..., None]
  # Sequence-wise: f_e = E / (k T_b) Σ_t 1[e chosen], P_e = 1 / T_b Σ_t p'_e.
  t_b = jnp.sum(m, axis=1)  # [B]
  denom = jnp.maximum(t_b, 1.0)[:, None]
  f = E / k * jnp.sum(chosen, axis=1) / denom
  P = jnp.sum(probs, axis=1) / denom
  per_seq = jnp.sum(f * P, axis=-1)  # [B]
  has = (t_b > 0).astype(jnp.float32)
  seq_aux = jnp.sum(per_seq * has) / jnp.maximum(jnp.sum(has), 1.0)
  entropy = -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)  # [B, T]
  return RouterStats(counts=jnp.sum(chosen, axis=(0, 1)), prob_sum=jnp.sum(probs, axis=(0, 1)),
                     tokens=jnp.sum(m), seq_aux=seq_aux, entropy_sum=jnp.sum(entropy * m),
                     dropped=jnp.asarray(dropped, jnp.int32))


def _param(module: nn.Module, name: str, shape, axes, dtype):
  init = nn.initializers.zeros if name.endswith("bias") else nn.initializers.normal(_INIT_STD)
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class MoEMLP(nn.Module):
  """Routed (+ shared) experts; see the module docstring for params and sharding.

  ``cfg`` is a ``ModelConfig`` with ``cfg.moe`` set (d_model, dtypes are read
  from it). ``__call__(x [B, T, D], mask [B, T] | None)`` returns
  ``(y [B, T, D], RouterStats)``; ``mask`` (True = real token) keeps padding
  out of the statistics and balance losses, not out of the computation.
  """
  cfg: Any

  @nn.compact
  def __call__(self, x: Array, mask: Array | None = None):
    cfg, moe = self.cfg, self.cfg.moe
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    D, E, Fe = cfg.d_model, moe.n_routed_experts, moe.moe_d_ff
    B, T, _ = x.shape
    x = x.astype(dt)
    w_router = _param(self, "router", (D, E), ("embed", None), pdt)
    bias = (_param(self, "selection_bias", (E,), (None,), pdt)
            if moe.router == "sigmoid" else None)
    wg = _param(self, "gate", (E, D, Fe), ("expert", "embed", "mlp"), pdt)
    wu = _param(self, "up", (E, D, Fe), ("expert", "embed", "mlp"), pdt)
    wd = _param(self, "down", (E, Fe, D), ("expert", "mlp", "embed"), pdt)
    logits = jnp.einsum("BTD,DE->BTE", x, w_router.astype(dt),
                        preferred_element_type=jnp.float32)
    r = route(logits, moe, bias)  # [B, T, k], [B, T, k], [B, T, E]
    weights = r.weights.astype(dt)
    if moe.dispatch == "onehot":
      y = experts_onehot(x.reshape(B * T, D), r.experts.reshape(B * T, -1),
                         weights.reshape(B * T, -1), wg, wu, wd).reshape(B, T, D)
      pairs = jnp.asarray(B * T * moe.experts_per_token, jnp.int32)
    elif not jax.sharding.get_abstract_mesh().empty:
      y, pairs = experts_expert_parallel(x, r.experts, weights, wg, wu, wd, moe,
                                         batch_mesh_axes())
    else:
      y, pairs = experts_ragged(x.reshape(B * T, D), r.experts.reshape(B * T, -1),
                                weights.reshape(B * T, -1), wg, wu, wd)
      y = y.reshape(B, T, D)
    if moe.n_shared_experts:
      Fs = moe.n_shared_experts * Fe
      sg = _param(self, "shared_gate", (D, Fs), ("embed", "mlp"), pdt)
      su = _param(self, "shared_up", (D, Fs), ("embed", "mlp"), pdt)
      sd = _param(self, "shared_down", (Fs, D), ("mlp", "embed"), pdt)
      h = jax.nn.silu(x @ sg.astype(dt)) * (x @ su.astype(dt))
      h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
      y = y + h @ sd.astype(dt)
    dropped = B * T * moe.experts_per_token - pairs
    return y, router_stats(moe, r, mask, dropped)
