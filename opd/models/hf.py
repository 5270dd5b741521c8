"""Hugging Face interop: Llama / Qwen2 / Qwen3 / DeepSeek-V3 / DeepSeek-V4 ``safetensors``
checkpoints (docs/DESIGN.md §2).

``load_hf`` reads a checkpoint directory (``config.json`` plus either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``)
into a ``ModelConfig`` and our param tree; ``save_hf`` writes the same layout
so ``transformers.AutoModelForCausalLM.from_pretrained`` loads it. Only
``safetensors`` and ``json`` are used here: neither torch nor transformers is
a runtime dependency.

The ``config.json`` mapping (and its refusals of anything the decoder does
not implement, naming the HF field and value) is ``opd.models.hf_config``;
its functions are re-exported here. DeepSeek-V3's multi-head latent
attention tensors and multi-token-prediction layers are
``opd.models.hf_deepseek``'s; DeepSeek-V4 (``ModelConfig.v4``) has its own
config schema and tensor table in ``opd.models.hf_v4``.

Weight layout: HF ``nn.Linear`` stores ``[out, in]``, we store ``[in, out]``
with heads split out, e.g. ``self_attn.q_proj.weight [H*Dh, D]`` ↔
``attn/q [D, H, Dh]``, ``o_proj.weight [D, H*Dh]`` ↔ ``attn/o [H, Dh, D]``,
``q_proj.bias [H*Dh]`` ↔ ``attn/q_bias [H, Dh]``, ``mlp.down_proj.weight
[D, F]`` ↔ ``mlp/down [F, D]``, ``lm_head.weight [V, D]`` ↔ ``lm_head [D, V]``;
``_tensor_specs`` is the full table.

The value head (``scalar_head=True``) is our extension; ``transformers``
ignores the two extra tensors (with a warning) when it loads such a
checkpoint.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from opd.models import hf_deepseek, hf_moe, hf_v4
from opd.models.config import ModelConfig
from opd.models.hf_config import (  # noqa: F401 - re-exported: opd.models.hf is the entry
    ARCHS, HF_CLASS, check_config_matches, config_from_hf, config_to_hf, infer_arch)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# Non-parameter buffers some older checkpoints carry; safe to ignore.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# ---------------------------------------------------------------------------
# Tensor mapping.


@dataclasses.dataclass(frozen=True)
class _Spec:
  hf_name: str
  path: tuple[str, ...]
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]
  transpose: bool  # HF [out, in] Linear weight
  fields: str  # the config fields that set the shape, for error messages
  index: int | None = None  # slice `index` of our param's leading (expert) axis


def _tensor_specs(cfg: ModelConfig) -> list[_Spec]:
  """The full HF ↔ ours table for ``cfg``, in HF's save order."""
  D, F, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
  H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
  hd = "head_dim, d_model"
  # (HF name, our path, HF shape, our shape, transpose, fields behind the shape)
  layer = [("input_layernorm.weight", "attn_norm/scale", (D,), (D,), False, "d_model"),
           ("post_attention_layernorm.weight", "mlp_norm/scale", (D,), (D,), False, "d_model")]
  if cfg.mla is not None:
    layer += hf_deepseek.attention_rows(cfg)
  else:
    layer += [("self_attn.q_proj.weight", "attn/q", (H * Dh, D), (D, H, Dh), True,
               "n_heads, " + hd),
              ("self_attn.k_proj.weight", "attn/k", (K * Dh, D), (D, K, Dh), True,
               "n_kv_heads, " + hd),
              ("self_attn.v_proj.weight", "attn/v", (K * Dh, D), (D, K, Dh), True,
               "n_kv_heads, " + hd),
              ("self_attn.o_proj.weight", "attn/o", (D, H * Dh), (H, Dh, D), True,
               "n_heads, " + hd)]
  if cfg.qkv_bias:
    layer += [("self_attn.q_proj.bias", "attn/q_bias", (H * Dh,), (H, Dh), False,
               "n_heads, head_dim"),
              ("self_attn.k_proj.bias", "attn/k_bias", (K * Dh,), (K, Dh), False,
               "n_kv_heads, head_dim"),
              ("self_attn.v_proj.bias", "attn/v_bias", (K * Dh,), (K, Dh), False,
               "n_kv_heads, head_dim")]
  if cfg.o_bias:
    layer.append(("self_attn.o_proj.bias", "attn/o_bias", (D,), (D,), False, "d_model"))
  if cfg.qk_norm:
    layer += [("self_attn.q_norm.weight", "attn/q_norm/scale", (Dh,), (Dh,), False, "head_dim"),
              ("self_attn.k_norm.weight", "attn/k_norm/scale", (Dh,), (Dh,), False, "head_dim")]
  dense = [("mlp.gate_proj.weight", "mlp/gate", (F, D), (D, F), True, "d_ff, d_model"),
           ("mlp.up_proj.weight", "mlp/up", (F, D), (D, F), True, "d_ff, d_model"),
           ("mlp.down_proj.weight", "mlp/down", (D, F), (F, D), True, "d_model, d_ff")]
  moe = [] if cfg.moe is None else hf_moe.mlp_rows(cfg.moe, D)
  mlp = lambda i: moe if cfg.moe is not None and cfg.moe.is_moe_layer(i) else dense
  rows = [("model.embed_tokens.weight", "embedding", (V, D), (V, D), False, "vocab_size, d_model")]
  rows += [(f"model.layers.{i}.{name}", f"layers_{i}/{path}", *rest)
           for i in range(cfg.n_layers) for name, path, *rest in layer + mlp(i)]
  rows.append(("model.norm.weight", "final_norm/scale", (D,), (D,), False, "d_model"))
  if not cfg.tie_embeddings:
    rows.append(("lm_head.weight", "lm_head", (V, D), (D, V), True, "vocab_size, d_model"))
  if cfg.scalar_head:
    rows += [("value_head.weight", "value_head", (1, D), (D, 1), True, "d_model"),
             ("value_head.bias", "value_bias", (1,), (1,), False, "scalar_head")]
  return [_Spec(name, tuple(path.split("/")), *rest) for name, path, *rest in rows]


def _fields_values(cfg: ModelConfig, fields: str) -> str:
  out = []
  for name in fields.split(", "):
    value = (cfg.resolved_head_dim if name == "head_dim"
             else functools.reduce(getattr, name.split("."), cfg))  # "mla.kv_lora_rank"
    out.append(f"{name}={value}")
  return ", ".join(out)


def params_to_hf(cfg: ModelConfig, params, dtype=None) -> dict[str, np.ndarray]:
  """Our param tree → ``{hf_name: np.ndarray}`` in HF layout.

  Raises:
    ValueError: a param is missing or has the wrong shape (naming it).
  """
  if cfg.v4 is not None:  # DeepSeek-V4's own table (opd.models.hf_v4)
    return hf_v4.params_to_hf(cfg, params, dtype)
  specs = _tensor_specs(cfg)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  have = {tuple(str(getattr(k, "key", k)) for k in path) for path, _ in flat}
  extra = sorted("/".join(p) for p in have - {s.path for s in specs})
  if extra:
    raise ValueError(f"params hold {extra}, which the config does not describe (check "
                     f"tie_embeddings={cfg.tie_embeddings}, scalar_head={cfg.scalar_head}, "
                     "qkv_bias / o_bias / qk_norm / n_layers)")
  out = {}
  for s in specs:
    node = params
    for key in s.path:
      if not isinstance(node, Mapping) or key not in node:
        raise ValueError(f"params lack {'/'.join(s.path)} (needed for {s.hf_name})")
      node = node[key]
    x = np.asarray(node)
    shape = s.shape if s.index is None else (cfg.moe.n_routed_experts,) + s.shape
    if x.shape != shape:
      raise ValueError(f"params {'/'.join(s.path)} has shape {x.shape}, expected {shape} "
                       f"from {_fields_values(cfg, s.fields)}")
    if s.index is not None:
      x = x[s.index]
    if dtype is not None:
      x = x.astype(jnp.dtype(dtype))
    x = x.reshape(s.hf_shape[::-1]).T if s.transpose else x.reshape(s.hf_shape)
    out[s.hf_name] = np.ascontiguousarray(x)
  return out


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, Any], dtype=None):
  """``{hf_name: array}`` → our param tree (jax arrays in ``dtype``).

  ``tensors`` may be a lazy mapping (only ``keys()``, ``shape_of`` and
  ``__getitem__`` are used), so large checkpoints are read one tensor at a time.

  Raises:
    ValueError: naming missing / unexpected tensors or a shape mismatch.
  """
  dtype = jnp.dtype(dtype or cfg.storage_dtype)
  if cfg.v4 is not None:  # DeepSeek-V4's own table (opd.models.hf_v4)
    return hf_v4.params_from_hf(cfg, tensors, dtype)
  specs = _tensor_specs(cfg)
  expected = {s.hf_name for s in specs}
  names = set(tensors.keys())
  unexpected = sorted(n for n in names - expected if not _IGNORED.fullmatch(n))
  tied_head = cfg.tie_embeddings and "lm_head.weight" in unexpected
  if tied_head:
    unexpected.remove("lm_head.weight")
  missing = sorted(expected - names)
  if missing or unexpected:
    hint = _layer_hint(cfg, names, missing, unexpected)
    raise ValueError(f"checkpoint tensors do not match the config{hint}: "
                     f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                     f"({len(missing)}), unexpected {unexpected[:8]}"
                     f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
  shape_of = getattr(tensors, "shape_of", lambda n: tuple(np.shape(tensors[n])))
  for s in specs:
    found = tuple(shape_of(s.hf_name))
    if found != s.hf_shape:
      raise ValueError(f"checkpoint tensor {s.hf_name} has shape {found}, expected "
                       f"{s.hf_shape} from {_fields_values(cfg, s.fields)}")
  params: dict[str, Any] = {}
  for s in specs:
    x = np.asarray(tensors[s.hf_name])
    x = (x.T if s.transpose else x).reshape(s.shape)
    node = params
    for key in s.path[:-1]:
      node = node.setdefault(key, {})
    if s.index is None:
      node[s.path[-1]] = jnp.asarray(x, dtype=dtype)
    else:  # one expert of a stacked [E, ...] param; the table lists experts in order
      node.setdefault(s.path[-1], []).append(x)
  stacked = {s.path for s in specs if s.index is not None}
  for path in stacked:
    node = params
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = jnp.asarray(np.stack(node[path[-1]]), dtype=dtype)
  if tied_head:
    head = np.asarray(tensors["lm_head.weight"])
    if head.shape != (cfg.vocab_size, cfg.d_model) or not np.array_equal(
        head, np.asarray(tensors["model.embed_tokens.weight"])):
      raise ValueError("checkpoint has tie_word_embeddings=True but lm_head.weight differs "
                       "from model.embed_tokens.weight; load it with tie_embeddings=False")
  return params


def _layer_hint(cfg: ModelConfig, names, missing, unexpected) -> str:
  """Names the config field most likely behind a tensor-set mismatch."""
  layer = re.compile(r"model\.layers\.(\d+)\.")
  found = {int(m.group(1)) for n in names if (m := layer.match(n))}
  if found and max(found) + 1 != cfg.n_layers:
    return f" (the checkpoint has {max(found) + 1} layers, but n_layers={cfg.n_layers})"
  flags = {"q_norm": "qk_norm", "q_proj.bias": "qkv_bias", "o_proj.bias": "o_bias",
           "lm_head": "tie_embeddings", "value_head": "scalar_head"}
  for needle, field in flags.items():
    if any(needle in n for n in list(missing) + list(unexpected)):
      return f" (check {field}={getattr(cfg, field)})"
  return ""


# ---------------------------------------------------------------------------
# Files.


def _safe_open(file: str):
  """``safe_open`` whose failure (truncated, garbage, unreadable) names the file."""
  try:
    return safe_open(file, framework="np")
  except Exception as e:  # safetensors raises its own SafetensorError (an Exception) or OSError
    raise ValueError(f"cannot read safetensors file {file!r}: {e} (truncated or not a "
                     "safetensors file?)") from e


def _read_json_object(file: str, what: str) -> dict[str, Any]:
  """A JSON file whose top level must be an object; any failure names the file."""
  try:
    with open(file, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {what} {file!r}: {e}") from e
  if not isinstance(value, dict):
    raise ValueError(f"{what} {file!r} must hold a JSON object, got a {type(value).__name__}")
  return value


class _Checkpoint:
  """Lazy ``{name: np.ndarray}`` view over one or several safetensors files."""

  def __init__(self, files: Mapping[str, str]):
    self._file_of = dict(files)  # tensor name -> file path
    self._handles: dict[str, Any] = {}

  def _handle(self, path):
    if path not in self._handles:
      self._handles[path] = _safe_open(path)
    return self._handles[path]

  def keys(self):
    return self._file_of.keys()

  def drop(self, names):
    for name in names:
      del self._file_of[name]

  def close(self):
    for handle in self._handles.values():
      handle.__exit__(None, None, None)
    self._handles.clear()

  def shape_of(self, name):
    return tuple(self._handle(self._file_of[name]).get_slice(name).get_shape())

  def __getitem__(self, name):
    file = self._file_of[name]
    try:
      return self._handle(file).get_tensor(name)
    except ValueError:
      raise
    except Exception as e:  # a file damaged after its header was read
      raise ValueError(f"cannot read tensor {name} from {file!r}: {e}") from e


def _open_checkpoint(path: str) -> _Checkpoint:
  single, index = os.path.join(path, _SINGLE_FILE), os.path.join(path, _INDEX_FILE)
  if os.path.exists(index):
    weight_map = _read_json_object(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, Mapping):
      raise ValueError(f"{index} has no 'weight_map' dict")
    files = {name: os.path.join(path, file) for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
      if not os.path.exists(file):
        raise ValueError(f"{index} lists shard {file}, which does not exist")
    ckpt = _Checkpoint(files)
    for name, file in files.items():  # the index must not lie about where a tensor is
      if name not in ckpt._handle(file).keys():
        raise ValueError(f"{index} maps {name} to {file}, which does not contain it")
    return ckpt
  if os.path.exists(single):
    with _safe_open(single) as f:
      names = list(f.keys())
    return _Checkpoint({n: single for n in names})
  raise ValueError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in {path!r}")


def read_hf_config(path: str) -> dict[str, Any]:
  """The parsed ``config.json`` of a checkpoint directory.

  Raises ValueError naming the file when it is missing, not JSON or not an object.
  """
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise ValueError(f"no config.json in {path!r}")
  return _read_json_object(file, "HF config")


def load_hf(path: str, *, dtype: str = "float32", compute_dtype: str | None = None,
            config: ModelConfig | None = None):
  """Loads a HF Llama / Qwen2 / Qwen3 / DeepSeek-V3 / DeepSeek-V4 checkpoint directory.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` or a
      sharded ``model.safetensors.index.json``.
    dtype: storage dtype of the returned params (``param_dtype``).
    compute_dtype: the returned config's ``dtype``; defaults to ``dtype``.
    config: the config the caller expects. When given, every architecture
      field must agree with ``config.json`` (else ``ValueError`` naming the
      field), and its ``scalar_head`` / dtypes / ``remat`` are kept.

  Returns:
    ``(cfg, params)``: a ``ModelConfig`` and our nested param dict.
  """
  hf = read_hf_config(path)
  try:
    cfg = config_from_hf(hf, dtype=compute_dtype or dtype, param_dtype=dtype)
  except ValueError as e:
    raise ValueError(f"{os.path.join(path, 'config.json')}: {e}") from e
  ckpt = _open_checkpoint(path)
  if cfg.mla is not None or cfg.v4 is not None:
    ckpt.drop(hf_deepseek.mtp_tensors(hf, cfg.n_layers, ckpt.keys()))
  if config is not None:
    check_config_matches(config, cfg, path)
    cfg = config.replace(param_dtype=dtype, dtype=compute_dtype or config.dtype)
  elif "value_head.weight" in ckpt.keys():
    cfg = cfg.replace(scalar_head=True)
  try:
    return cfg, params_from_hf(cfg, ckpt)
  finally:
    ckpt.close()


def parse_size(size: int | str) -> int:
  """``5_000_000``, ``"5MB"``, ``"4GiB"`` → bytes (HF convention: KB = 1000, KiB = 1024)."""
  if isinstance(size, int) and not isinstance(size, bool):
    value = size
  elif isinstance(size, str):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
    unit = m.group(2).upper() if m else None
    if m is None or (unit or "B") not in _SIZE_UNITS:
      raise ValueError(f"max_shard_size={size!r} is not a size like 5GB, 500MiB or an int")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit or "B"])
  else:
    raise ValueError(f"max_shard_size={size!r} must be an int or a string like '5GB'")
  if value <= 0:
    raise ValueError(f"max_shard_size={size!r} must be positive")
  return value


# Files only an Orbax checkpoint (a step directory or one of its items) holds.
_ORBAX_MARKERS = frozenset({"_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt",
                            "commit_success.txt"})


def _orbax_marker(path: str, depth: int = 3) -> str | None:
  """A file showing that ``path`` (or a folder up to ``depth`` levels below) is Orbax's."""
  top = path.rstrip(os.sep).count(os.sep)
  for root, dirs, files in os.walk(path):
    hit = sorted(_ORBAX_MARKERS.intersection(files))
    if hit:
      return os.path.join(root, hit[0])
    if root.count(os.sep) - top >= depth - 1:
      dirs[:] = []
  return None


def _check_output_dir(path: str, overwrite: bool) -> None:
  """Refuses a ``save_hf`` target that holds anything but (with ``overwrite``) an HF export."""
  if not os.path.exists(path):
    return
  if not os.path.isdir(path):
    raise ValueError(f"save_hf path {path!r} exists and is not a directory")
  entries = sorted(os.listdir(path))
  if not entries:
    return
  marker = _orbax_marker(path)
  if marker is not None:
    raise ValueError(f"save_hf path {path!r} holds an Orbax checkpoint ({marker}); an HF export "
                     "never goes into a checkpoint directory, even with overwrite=True: choose "
                     "another path")
  if not overwrite:
    shown = ", ".join(entries[:8]) + (f", ... ({len(entries)} entries)" if len(entries) > 8 else "")
    raise ValueError(f"save_hf path {path!r} is not empty (it holds {shown}); pass "
                     "overwrite=True to replace the HF export there, or choose an empty directory")


def save_hf(path: str, cfg: ModelConfig, params, *, arch: str | None = None,
            max_shard_size: int | str = "5GB", dtype: str | None = None,
            hf_overrides: Mapping[str, Any] | None = None, overwrite: bool = False) -> list[str]:
  """Writes ``params`` as a HF checkpoint directory ``transformers`` can load.

  Args:
    path: output directory (created). It must be absent or empty unless
      ``overwrite``; a directory holding an Orbax checkpoint is always
      refused (ValueError naming the path and what it holds).
    cfg, params: the model.
    arch: "llama", "qwen2", "qwen3", "deepseek_v3" or "deepseek_v4"; ``None`` →
      ``infer_arch(cfg)``.
    max_shard_size: bytes per file (int or "5GB"-style string). One file
      → ``model.safetensors``; more → ``model-0000i-of-0000n.safetensors``
      plus ``model.safetensors.index.json``. A tensor larger than the limit
      gets a file of its own.
    dtype: tensor dtype on disk; defaults to ``cfg.param_dtype``.
    hf_overrides: extra ``config.json`` fields (e.g. ``eos_token_id``).
    overwrite: write into a non-empty directory, replacing an earlier
      export's ``config.json`` and weight files (other files are kept).

  Returns:
    The paths of the written weight files.
  """
  _check_output_dir(path, overwrite)
  limit = parse_size(max_shard_size)
  dtype = dtype or cfg.param_dtype
  hf = config_to_hf(cfg, arch, **{**(hf_overrides or {}), "dtype": dtype})  # on-disk dtype
  tensors = params_to_hf(cfg, params, dtype=jnp.dtype(dtype))
  shards: list[dict[str, np.ndarray]] = [{}]
  used = 0
  for name, x in tensors.items():
    if shards[-1] and used + x.nbytes > limit:
      shards.append({})
      used = 0
    shards[-1][name] = x
    used += x.nbytes
  os.makedirs(path, exist_ok=True)
  # A previous save's files would otherwise shadow or mix with this one's.
  for stale in os.listdir(path):
    if stale in (_SINGLE_FILE, _INDEX_FILE) or re.fullmatch(
        r"model-\d+-of-\d+\.safetensors", stale):
      os.remove(os.path.join(path, stale))
  metadata = {"format": "pt"}  # transformers 4.x refuses files without it
  written = []
  if len(shards) == 1:
    written.append(os.path.join(path, _SINGLE_FILE))
    save_file(shards[0], written[0], metadata=metadata)
  else:
    n = len(shards)
    width = max(5, int(math.log10(n)) + 1)
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:0{width}d}-of-{n:0{width}d}.safetensors"
      written.append(os.path.join(path, fname))
      save_file(shard, written[-1], metadata=metadata)
      weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
             "weight_map": weight_map}
    with open(os.path.join(path, _INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  return written
