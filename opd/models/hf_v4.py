"""DeepSeek-V4 checkpoints (``model_type="deepseek_v4"``, transformers'
``DeepseekV4ForCausalLM``) ↔ ``ModelConfig.v4`` models (docs/DESIGN.md §2,
"DeepSeek-V4"); ``opd.models.hf`` and ``opd.models.hf_config`` dispatch here.

On disk the tensors keep DeepSeek's own names (transformers renames them on
load and back on save): per layer ``attn.wq_a/wq_b/wkv/wo_a/wo_b``,
``attn.q_norm`` / ``attn.norm`` (the query latent's and the key's RMSNorm),
``attn.attn_sink``, ``attn.compressor.{wkv,wgate,ape,norm}``,
``attn.indexer.{wq_b,weights_proj,compressor.*}``, ``hc_{attn,ffn}_{fn,base,scale}``,
``attn_norm`` / ``ffn_norm``, ``ffn.gate.{weight,bias,tid2eid}`` and one tensor per
expert ``ffn.experts.{e}.w{1,2,3}`` (gate, down, up) and ``ffn.shared_experts.w{1,2,3}``;
then ``model.hc_head.hc_{fn,base,scale}``, ``model.norm``, ``head``. ``_rows`` is
the full table: the HF shape, ours, and the two maps between them.
Multi-token-prediction layers (``num_nextn_predict_layers``) are not built: their
``model.layers.{n_layers + j}`` tensors (``opd.models.hf``) and DeepSeek's own
``mtp.{j}.*`` ones (which transformers ignores too) are dropped on load with a
warning (they do not change the causal-LM logits) and never written. A config
that needs anything else not built (quantised fp8 / fp4 weights, a layer or MLP
type, router or activation other than V4's) fails naming the field.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from opd.models.config import ModelConfig, YaRNConfig
from opd.models.mla import yarn_frequencies
from opd.models.moe import ROUTERS, MoEConfig
from opd.models.v4.config import LAYER_TYPES, MLP_LAYER_TYPES, V4Config, V4YaRN
from opd.models.v4.model import layer_configs

log = logging.getLogger(__name__)

MODEL_TYPE = "deepseek_v4"
_MTP = re.compile(r"(^|\.)mtp\.")  # DeepSeek's multi-token-prediction tensors
HF_CLASS = "DeepseekV4ForCausalLM"
_CSA, _HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def _need(hf: Mapping[str, Any], name: str):
  if name not in hf:
    raise ValueError(f"HF config model_type={MODEL_TYPE!r} lacks required field {name!r}")
  return hf[name]


def _rope_dicts(hf: Mapping[str, Any]) -> tuple[dict, dict]:
  """``(rope_parameters["main"], rope_parameters["compress"])`` as transformers builds them:
  a nested ``rope_parameters`` as is; a flat one (or the legacy ``rope_scaling``) is the
  compress branch's scaling, the main branch plain RoPE at ``rope_theta``, and a YaRN
  compress branch without ``attention_factor`` gets 1.0 (DeepSeek-V4's reference)."""
  rp = hf.get("rope_parameters") or {}
  if isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
    return dict(rp["main"]), dict(rp["compress"])
  flat = {k: v for k, v in (rp or hf.get("rope_scaling") or {}).items()
          if k not in ("main", "compress")}
  if "type" in flat:
    flat.setdefault("rope_type", flat.pop("type"))
  main = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
  compress = {**flat, "rope_theta": hf.get("compress_rope_theta", 160000.0)}
  compress.setdefault("rope_type", "default")
  if compress["rope_type"] == "yarn":
    compress.setdefault("attention_factor", 1.0)
  return main, compress


_YARN_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
              "mscale", "mscale_all_dim", "truncate")


def _compress_yarn(hf: Mapping[str, Any], rp: Mapping[str, Any]) -> V4YaRN:
  """The ``V4YaRN`` of a YaRN ``rope_parameters["compress"]`` (transformers' rules: a
  missing ``attention_factor`` is ``m(s, mscale) / m(s, mscale_all_dim)`` or ``m(s, 1)``)."""
  field = "rope_parameters['compress']"
  extra = sorted(set(rp) - set(_YARN_KEYS))
  if extra or rp.get("truncate", True) is not True:
    raise ValueError(f"HF config {field} (YaRN) sets {extra or {'truncate': rp['truncate']}}, "
                     f"which is not supported for {MODEL_TYPE}")
  if rp.get("factor") is None:
    raise ValueError(f"HF config {field} (YaRN) lacks 'factor'")
  orig = rp.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
  try:
    ramp = YaRNConfig(factor=float(rp["factor"]), original_max_position=orig,
                      beta_fast=float(rp.get("beta_fast") or 32.0),
                      beta_slow=float(rp.get("beta_slow") or 1.0),
                      mscale=float(rp.get("mscale") or 0.0),
                      mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0))
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
      attention_factor = yarn_frequencies(2, float(rp.get("rope_theta", 160000.0)), ramp)[1]
    return V4YaRN(factor=ramp.factor, original_max_position=ramp.original_max_position,
                  beta_fast=ramp.beta_fast, beta_slow=ramp.beta_slow,
                  attention_factor=float(attention_factor))
  except (TypeError, ValueError) as e:
    raise ValueError(f"HF config {field} (YaRN): {e}") from None


def config_from_hf(hf: Mapping[str, Any], *, dtype: str, param_dtype: str) -> ModelConfig:
  """A DeepSeek-V4 ``config.json`` → ``ModelConfig`` with ``v4`` set.

  Raises:
    ValueError: naming the HF field and value of anything not built (YaRN, several
      key/value heads, biases, other activations) or a missing required field.
  """
  quant = hf.get("quantization_config")
  if quant is not None:
    method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
    raise ValueError(f"HF config quantization_config (quant_method={method!r}) is not "
                     f"supported for {MODEL_TYPE}: the fp8 / fp4 weights and their scales "
                     "are not dequantised here; convert the checkpoint to bf16 / fp32 first")
  for name, ok in (("hidden_act", ("silu", "swish")), ("attention_bias", (False,)),
                   ("mlp_bias", (False,)), ("num_key_value_heads", (1,)),
                   ("n_shared_experts", (1,)), ("norm_topk_prob", (True,)),
                   ("scoring_func", ROUTERS)):
    if name in hf and hf[name] not in ok:
      raise ValueError(f"HF config {name}={hf[name]!r} is not supported for {MODEL_TYPE} "
                       f"(expected one of {ok})")
  for name, ok in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
    for i, value in enumerate(_need(hf, name)):
      if value not in ok:
        raise ValueError(f"HF config {name}[{i}]={value!r} is not supported for "
                         f"{MODEL_TYPE} (built: {ok})")
  Dh = _need(hf, "head_dim")
  main, compress = _rope_dicts(hf)
  for kind, rp in (("main", main), ("compress", compress)):
    rope_type = rp.get("rope_type", "default")
    if rope_type not in (("default", "yarn") if kind == "compress" else ("default",)):
      raise ValueError(f"HF config rope_parameters[{kind!r}].rope_type={rope_type!r} is not "
                       f"supported for {MODEL_TYPE} (the main branch: plain RoPE; the "
                       "compressed branches: plain or YaRN)")
  yarn = _compress_yarn(hf, compress) if compress["rope_type"] == "yarn" else None
  default_factor = float(hf.get("partial_rotary_factor") or 1.0)
  theta, c_theta = (float(rp.get("rope_theta", hf.get(name, default))) for rp, name, default in (
      (main, "rope_theta", 10000.0), (compress, "compress_rope_theta", 160000.0)))
  factor, c_factor = (float(rp.get("partial_rotary_factor", default_factor))
                      for rp in (main, compress))
  rope_dim = int(hf.get("qk_rope_head_dim") or round(Dh * factor))
  if round(Dh * c_factor) != rope_dim:
    raise ValueError(f"HF config rope_parameters['compress'].partial_rotary_factor={c_factor} "
                     f"gives {round(Dh * c_factor)} RoPE dims, the main branch {rope_dim}: "
                     "one rope_dim is built")
  rates = _need(hf, "compress_rates")
  layer_types = tuple(_need(hf, "layer_types"))
  v4 = V4Config(layer_types=layer_types, mlp_layer_types=tuple(_need(hf, "mlp_layer_types")),
                q_lora_rank=_need(hf, "q_lora_rank"), rope_dim=rope_dim,
                sliding_window=_need(hf, "sliding_window"), o_groups=_need(hf, "o_groups"),
                o_lora_rank=_need(hf, "o_lora_rank"),
                csa_compress_rate=int(rates.get(_CSA, 4)),
                hca_compress_rate=int(rates.get(_HCA, 128)), compress_rope_theta=c_theta,
                index_n_heads=hf.get("index_n_heads", 64),
                index_head_dim=hf.get("index_head_dim", 128),
                index_topk=hf.get("index_topk", 512), n_streams=hf.get("hc_mult", 4),
                sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
                hc_eps=float(hf.get("hc_eps", 1e-6)),
                swiglu_limit=float(hf.get("swiglu_limit", 10.0)), compress_yarn=yarn)
  moe = MoEConfig(n_routed_experts=_need(hf, "n_routed_experts"),
                  experts_per_token=_need(hf, "num_experts_per_tok"),
                  moe_d_ff=_need(hf, "moe_intermediate_size"), n_shared_experts=1,
                  router=hf.get("scoring_func", "sqrtsoftplus"),
                  routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
  return ModelConfig(
      vocab_size=_need(hf, "vocab_size"), d_model=_need(hf, "hidden_size"),
      n_layers=_need(hf, "num_hidden_layers"), n_heads=_need(hf, "num_attention_heads"),
      n_kv_heads=1, head_dim=Dh, d_ff=moe.moe_d_ff, rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe, v4=v4,
      dtype=dtype, param_dtype=param_dtype)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The ``config.json`` fields of a ``ModelConfig`` with ``v4`` set."""
  v4, moe, Dh = cfg.v4, cfg.moe, cfg.resolved_head_dim
  factor = v4.rope_dim / Dh
  compress = {"rope_type": "default", "rope_theta": v4.compress_rope_theta,
              "partial_rotary_factor": factor}
  if v4.compress_yarn is not None:
    y = v4.compress_yarn
    compress.update(rope_type="yarn", factor=y.factor,
                    original_max_position_embeddings=y.original_max_position,
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow,
                    attention_factor=y.attention_factor)
  return {
      "architectures": [HF_CLASS], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": 1, "head_dim": Dh,
      "q_lora_rank": v4.q_lora_rank, "qk_rope_head_dim": v4.rope_dim,
      "partial_rotary_factor": factor, "sliding_window": v4.sliding_window,
      "o_groups": v4.o_groups, "o_lora_rank": v4.o_lora_rank,
      "layer_types": list(v4.layer_types), "mlp_layer_types": list(v4.mlp_layer_types),
      "compress_rates": {_CSA: v4.csa_compress_rate, _HCA: v4.hca_compress_rate},
      "rope_theta": cfg.rope_theta, "compress_rope_theta": v4.compress_rope_theta,
      "rope_parameters": {
          "main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                   "partial_rotary_factor": factor},
          "compress": compress},
      "index_n_heads": v4.index_n_heads, "index_head_dim": v4.index_head_dim,
      "index_topk": v4.index_topk, "hc_mult": v4.n_streams,
      "hc_sinkhorn_iters": v4.sinkhorn_iters, "hc_eps": v4.hc_eps,
      "swiglu_limit": v4.swiglu_limit, "n_routed_experts": moe.n_routed_experts,
      "num_experts_per_tok": moe.experts_per_token, "moe_intermediate_size": moe.moe_d_ff,
      "n_shared_experts": 1, "norm_topk_prob": True, "scoring_func": moe.router,
      "routed_scaling_factor": moe.routed_scaling_factor, "num_nextn_predict_layers": 0,
      "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": 1048576,
      "dtype": cfg.param_dtype}


class _Row(NamedTuple):
  hf_name: str
  path: tuple[str, ...]
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]  # ours (one expert's slice when ``index`` is set)
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  index: int | None = None  # slice of our stacked [E, ...] param


def _linear(name, path, hf_shape, shape, index=None) -> _Row:
  """An ``nn.Linear`` ``[out, in]`` weight ↔ our ``[in, ...out]`` (``x.T`` reshaped)."""
  return _Row(name, tuple(path.split("/")), hf_shape, shape,
              lambda x: x.T.reshape(shape), lambda x: x.reshape(hf_shape[::-1]).T, index)


def _same(name, path, shape) -> _Row:
  return _Row(name, tuple(path.split("/")), shape, shape, lambda x: x, lambda x: x)


def _rows(cfg: ModelConfig) -> list[_Row]:
  """The full HF ↔ ours table for ``cfg`` (HF names relative to the file)."""
  D, V, H, Dh = cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.resolved_head_dim
  v4, moe = cfg.v4, cfg.moe
  N, Cq, G, R = v4.n_streams, v4.q_lora_rank, v4.o_groups, v4.o_lora_rank
  E, Fe, k = moe.n_routed_experts, moe.moe_d_ff, moe.experts_per_token
  I, W = H // G * Dh, (2 + N) * N
  rows = [_same("model.embed_tokens.weight", "embedding", (V, D))]
  for i, lc in enumerate(layer_configs(cfg)):
    p, o = f"model.layers.{i}.", f"layers_{i}/"
    for hf_site, site in (("attn", "attn_hc"), ("ffn", "mlp_hc")):
      rows += [_linear(f"{p}hc_{hf_site}_fn", f"{o}{site}/proj", (W, N * D), (N * D, W)),
               _same(f"{p}hc_{hf_site}_base", f"{o}{site}/bias", (W,)),
               _same(f"{p}hc_{hf_site}_scale", f"{o}{site}/scale", (3,))]
    rows += [_same(f"{p}attn_norm.weight", f"{o}attn_norm/scale", (D,)),
             _same(f"{p}ffn_norm.weight", f"{o}mlp_norm/scale", (D,)),
             _same(f"{p}attn.attn_sink", f"{o}attn/sink_bias", (H,)),
             _linear(f"{p}attn.wq_a.weight", f"{o}attn/q_a", (Cq, D), (D, Cq)),
             _same(f"{p}attn.q_norm.weight", f"{o}attn/q_a_norm/scale", (Cq,)),
             _linear(f"{p}attn.wq_b.weight", f"{o}attn/q_b", (H * Dh, Cq), (Cq, H, Dh)),
             _linear(f"{p}attn.wkv.weight", f"{o}attn/kv", (Dh, D), (D, Dh)),
             _same(f"{p}attn.norm.weight", f"{o}attn/kv_norm/scale", (Dh,)),
             # wo_a is grouped: rows g·R..(g+1)·R map group g's [I] inputs to its R outputs.
             _Row(f"{p}attn.wo_a.weight", (f"layers_{i}", "attn", "o_a"), (G * R, I), (G, I, R),
                  lambda x: x.reshape(G, R, I).transpose(0, 2, 1),
                  lambda x: x.transpose(0, 2, 1).reshape(G * R, I)),
             _linear(f"{p}attn.wo_b.weight", f"{o}attn/o_b", (D, G * R), (G, R, D))]
    comps = [("attn.compressor.", "attn/compressor/", lc.attention.compressor)]
    if lc.attention.indexer is not None:
      ix = lc.attention.indexer
      comps.append(("attn.indexer.compressor.", "attn/indexer/compressor/", ix.compressor))
      rows += [_linear(f"{p}attn.indexer.wq_b.weight", f"{o}attn/indexer/q",
                       (ix.n_heads * ix.compressor.width, Cq),
                       (Cq, ix.n_heads, ix.compressor.width)),
               _linear(f"{p}attn.indexer.weights_proj.weight", f"{o}attn/indexer/weights",
                       (ix.n_heads, D), (D, ix.n_heads))]
    for hf_c, c, cc in comps:
      if cc is None:
        continue
      cw = 2 * cc.width if cc.overlap else cc.width
      rows += [_linear(f"{p}{hf_c}wkv.weight", f"{o}{c}kv", (cw, D), (D, cw)),
               _linear(f"{p}{hf_c}wgate.weight", f"{o}{c}gate", (cw, D), (D, cw)),
               _same(f"{p}{hf_c}ape", f"{o}{c}position_bias", (cc.compress_rate, cw)),
               _same(f"{p}{hf_c}norm.weight", f"{o}{c}kv_norm/scale", (cc.width,))]
    rows.append(_linear(f"{p}ffn.gate.weight", f"{o}mlp/router", (E, D), (D, E)))
    if lc.moe.mlp_type == "hash_moe":  # int expert ids on disk, exact floats in our params
      rows.append(_Row(f"{p}ffn.gate.tid2eid", (f"layers_{i}", "mlp", "tid2eid"), (V, k),
                       (V * k,), lambda x: x.reshape(-1),
                       lambda x: np.rint(x).astype(np.int64).reshape(V, k)))
    else:
      rows.append(_same(f"{p}ffn.gate.bias", f"{o}mlp/selection_bias", (E,)))
    for e in range(E):
      rows += [_linear(f"{p}ffn.experts.{e}.w1.weight", f"{o}mlp/gate", (Fe, D), (D, Fe), e),
               _linear(f"{p}ffn.experts.{e}.w2.weight", f"{o}mlp/down", (D, Fe), (Fe, D), e),
               _linear(f"{p}ffn.experts.{e}.w3.weight", f"{o}mlp/up", (Fe, D), (D, Fe), e)]
    rows += [_linear(f"{p}ffn.shared_experts.w1.weight", f"{o}mlp/shared_gate", (Fe, D), (D, Fe)),
             _linear(f"{p}ffn.shared_experts.w2.weight", f"{o}mlp/shared_down", (D, Fe),
                     (Fe, D)),
             _linear(f"{p}ffn.shared_experts.w3.weight", f"{o}mlp/shared_up", (Fe, D), (D, Fe))]
  rows += [_linear("model.hc_head.hc_fn", "hc_head/proj", (N, N * D), (N * D, N)),
           _same("model.hc_head.hc_base", "hc_head/bias", (N,)),
           _same("model.hc_head.hc_scale", "hc_head/scale", (1,)),
           _same("model.norm.weight", "final_norm/scale", (D,))]
  if not cfg.tie_embeddings:
    rows.append(_linear("head.weight", "lm_head", (V, D), (D, V)))
  if cfg.scalar_head:
    rows += [_linear("value_head.weight", "value_head", (1, D), (D, 1)),
             _same("value_head.bias", "value_bias", (1,))]
  return rows


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, Any], dtype) -> dict[str, Any]:
  """``{hf_name: array}`` (possibly lazy: ``keys``, ``shape_of``, ``__getitem__``) → params.

  Raises:
    ValueError: naming missing / unexpected tensors or a tensor of the wrong shape
      (DeepSeek's ``mtp.*`` tensors are dropped with a warning).
  """
  rows = _rows(cfg)
  expected, names = {r.hf_name for r in rows}, set(tensors.keys())
  mtp = sorted(n for n in names if _MTP.search(n))
  if mtp:
    log.warning("dropping %d multi-token-prediction tensors (%s, ...): they do not affect the "
                "causal-LM logits", len(mtp), mtp[0])
    names -= set(mtp)
  missing, unexpected = sorted(expected - names), sorted(names - expected)
  if missing or unexpected:
    raise ValueError(f"{MODEL_TYPE} checkpoint tensors do not match the config (layer_types / "
                     f"mlp_layer_types / tie_embeddings): missing {missing[:8]} "
                     f"({len(missing)}), unexpected {unexpected[:8]} ({len(unexpected)})")
  shape_of = getattr(tensors, "shape_of", lambda n: tuple(np.shape(tensors[n])))
  params: dict[str, Any] = {}
  for r in rows:
    if tuple(shape_of(r.hf_name)) != r.hf_shape:
      raise ValueError(f"checkpoint tensor {r.hf_name} has shape {tuple(shape_of(r.hf_name))}, "
                       f"expected {r.hf_shape} from the config")
    node = params
    for key in r.path[:-1]:
      node = node.setdefault(key, {})
    x = r.to_ours(np.asarray(tensors[r.hf_name]))
    if r.index is None:
      node[r.path[-1]] = jnp.asarray(x, dtype=dtype)
    else:  # experts come in order 0..E-1
      node.setdefault(r.path[-1], []).append(x)
  for r in rows:
    if r.index == 0:
      node = params
      for key in r.path[:-1]:
        node = node[key]
      node[r.path[-1]] = jnp.asarray(np.stack(node[r.path[-1]]), dtype=dtype)
  return params


def params_to_hf(cfg: ModelConfig, params, dtype=None) -> dict[str, np.ndarray]:
  """Our params → ``{hf_name: np.ndarray}`` (``tid2eid`` as int64, the rest in ``dtype``).

  Raises:
    ValueError: a param is missing or has the wrong shape (naming it).
  """
  rows = _rows(cfg)
  have = {"/".join(str(getattr(k, "key", k)) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
  extra = sorted(have - {"/".join(r.path) for r in rows})
  if extra:
    raise ValueError(f"params hold {extra}, which the config does not describe (check "
                     f"tie_embeddings={cfg.tie_embeddings}, scalar_head={cfg.scalar_head})")
  out = {}
  for r in rows:
    node = params
    for key in r.path:
      if not isinstance(node, Mapping) or key not in node:
        raise ValueError(f"params lack {'/'.join(r.path)} (needed for {r.hf_name})")
      node = node[key]
    x = np.asarray(node)
    want = r.shape if r.index is None else (cfg.moe.n_routed_experts,) + r.shape
    if x.shape != want:
      raise ValueError(f"params {'/'.join(r.path)} has shape {x.shape}, expected {want}")
    x = x if r.index is None else x[r.index]
    if dtype is not None and r.path[-1] != "tid2eid":
      x = x.astype(jnp.dtype(dtype))
    out[r.hf_name] = np.ascontiguousarray(r.to_hf(x))
  return out
