"""The per-device memory of a training or rollout layout, as formulas (docs/SCALING.md).

``estimate_memory(cfg, mesh_shape, batch, seq, teachers=TeacherMemory(...),
rollout=RolloutMemory(...), lora=LoRAMemory(...))`` returns a ``MemoryEstimate``
whose fields are bytes per device of: the fp32 master parameters, their
gradients, AdamW's two moments, the activations the backward pass keeps
(with or without rematerialisation), the loss head (materialised logits, or
the fused kernel's transient buffers, docs/DESIGN.md §4), the rollout KV
cache and the teacher hidden-state cache. ``check_fits`` raises
``DoesNotFitError`` naming the largest terms, so a launcher can refuse a
layout before it compiles anything.

Sharding follows ``opd.parallel.sharding.DEFAULT_RULES``: matmul weights are
split over ``fsdp × tensor`` (``embed → fsdp``; ``vocab, mlp, q_heads,
kv_heads → tensor``), batch rows over ``data × fsdp``, and the activations'
head, MLP and vocabulary widths over ``tensor``; D-wide activations are not
split (no sequence parallelism). Letters as ``opd.models.config``: B rows,
T tokens per row, N = B·T, D, H, K, Dh, F, V, L layers, S keys per query.

Activations kept per token and layer without remat (counted from the ops
whose outputs the backward reads, checked against XLA in
tests/opd/parallel/test_memory.py)::

    b·(4D + 2H·Dh + 2K·Dh + 4F) + 4·3·H·S
      4D: block input, attention-norm output, mid-block residual, MLP-norm output
      2H·Dh + 2K·Dh: rotated q and the attention output before W_O; k and v
      4F: gate pre-activation, silu(gate), up, their product (input of W_down)
      (+ H·Dh + K·Dh with QK-norm: q and k before their norms)
      3·H·S (fp32): scores, their masked exponentials, the probabilities

with b the compute dtype's bytes. With remat (``cfg.remat``) only the block
input ``b·D`` is kept per layer and one layer's full set is live while that
layer's backward recomputes it. The loss head keeps ``4·(4V + 6D)`` bytes per
token materialised (fp32 logits, log-softmax, softmax, the logits'
cotangent; embedding output, final-norm input/output and their cotangents);
the fused kernel replaces the ``4V`` part by its ``2·C·V·4`` chunk buffers
(``pallas_kernels.train_loss.default_block_t``) and adds its float32
``dW_s [D, V]`` (the student head's gradient, accumulated over the chunks).

The optimizer update (``update``): ``make_train_step``'s finite guard selects
``where(finite, new, old)`` over the whole state, so the new parameters and
both new Adam moments exist at once, beside the old (donated) ones, before
the step knows it may overwrite them: ``3·P_train·master`` bytes, sharded like
the parameters. The gradients' buffer is dead once the moments are computed
(XLA reuses it) and the activations are dead after the backward, so the step
peaks at ``params + optimizer + max(grads + activations + loss_head, update)``
(``MemoryEstimate.total``). A LoRA student adds to the backward's side its
merged weights (``lora_merged``: every adapted ``W + s·a b`` in the compute
dtype, alive from the forward to the backward).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from pallas_kernels.train_loss import default_block_t

from opd.config.fields import check_int, set_field
from opd.models.config import ModelConfig
from opd.models.lora import LoRAConfig, lora_adapted_count, lora_param_count

_TERMS = ("params", "grads", "optimizer", "activations", "loss_head", "lora_merged", "update",
          "kv_cache", "teacher_cache", "teacher_params")
# Alive together during the backward; ``update`` replaces them during the optimizer step.
_BACKWARD = ("grads", "activations", "loss_head", "lora_merged")


class DoesNotFitError(ValueError):
  """A layout's per-device memory exceeds the device's; the message names the largest terms."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device of each term (see the module docstring for the formulas).

  Attributes:
    params: master parameters (``master_bytes`` each), split over fsdp × tensor
      (a LoRA student: the frozen base and the adapters).
    grads: the trained parameters' gradients (fp32; a LoRA student's adapters').
    optimizer: AdamW's first and second moments in the master dtype.
    activations: what the backward keeps of the L blocks (remat or not).
    loss_head: materialised logits and their cotangent, or the fused
      kernel's chunk buffers.
    lora_merged: a LoRA student's adapted weights ``W + s·a b`` in the compute
      dtype, materialised before the forward and kept for the backward
      (``lora_adapted_count · b``, split like the weights); 0 otherwise.
    update: the optimizer step's transient: the new trained parameters and
      both new moments, alive at once while the finite guard decides
      (``3·P_train·master`` split like the parameters; module docstring).
    kv_cache: the rollout sampler's KV cache (0 when no rollout is asked).
    teacher_cache: the teachers' cached hidden states for the batch.
    teacher_params: resident frozen teacher weights.
    shards: the mesh axes' sizes used, ``{"data", "fsdp", "tensor"}``.
  """
  params: int
  grads: int
  optimizer: int
  activations: int
  loss_head: int
  lora_merged: int
  update: int
  kv_cache: int
  teacher_cache: int
  teacher_params: int
  shards: dict

  @property
  def total(self) -> int:
    """Peak bytes per device: every term, with the backward's transient
    (``grads + activations + loss_head``) and ``update`` counted as the larger
    of the two (they are never alive together)."""
    backward = sum(getattr(self, name) for name in _BACKWARD)
    rest = sum(getattr(self, n) for n in _TERMS if n not in _BACKWARD and n != "update")
    return rest + max(backward, self.update)

  def terms(self) -> dict[str, int]:
    """``{term: bytes}``, largest first."""
    return dict(sorted(((n, getattr(self, n)) for n in _TERMS), key=lambda kv: -kv[1]))


def _mesh(mesh_shape: Sequence[int] | dict) -> dict[str, int]:
  if isinstance(mesh_shape, dict):
    shape = {a: int(mesh_shape.get(a, 1)) for a in ("data", "fsdp", "tensor")}
  else:
    mesh_shape = tuple(mesh_shape)
    if len(mesh_shape) == 3:
      shape = dict(zip(("data", "fsdp", "tensor"), mesh_shape))
    elif len(mesh_shape) == 4:  # (data, fsdp, expert, tensor): experts counted as fsdp
      d, f, e, t = mesh_shape
      shape = {"data": d, "fsdp": f * e, "tensor": t}
    else:
      raise ValueError(f"mesh_shape={mesh_shape} must be (data, fsdp, tensor) or "
                       "(data, fsdp, expert, tensor)")
  for axis, size in shape.items():
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(f"mesh_shape: axis {axis!r} has size {size!r}; must be a positive int")
  return shape


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def layer_activation_bytes(cfg: ModelConfig, keys: int, tensor: int = 1) -> int:
  """Bytes one block keeps per token for its backward (no remat; module docstring).

  Args:
    cfg: the model.
    keys: S, the keys each query attends over (T for training).
    tensor: the ``tensor`` axis size, which splits the head and MLP widths.
  """
  b = 2 if cfg.dtype in ("bfloat16", "float16") else 4
  H, K, Dh, F = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, _dense_width(cfg)
  split = lambda n: _ceil_div(n, tensor)
  qk_norm = split(H * Dh) + split(K * Dh) if cfg.qk_norm else 0  # q, k before their norms
  return b * (4 * cfg.d_model + 2 * split(H * Dh) + 2 * split(K * Dh) + 4 * split(F)
              + qk_norm) + 4 * 3 * split(H) * keys


def _dense_width(cfg: ModelConfig) -> int:
  """The MLP width activations see (an MoE layer's active experts' widths summed)."""
  if cfg.moe is None:
    return cfg.d_ff
  moe = cfg.moe
  return moe.moe_d_ff * (moe.experts_per_token + moe.n_shared_experts)


@dataclasses.dataclass(frozen=True)
class TeacherMemory:
  """The OPD teachers' share of a step's memory.

  Attributes:
    dims: each teacher's width D_k (their number also sizes the fused loss
      kernel's chunk); their cached hidden states take
      ``Σ_k D_k · cache_bytes`` per token.
    param_bytes: total bytes of the frozen teachers resident with the student
      (e.g. ``num_params · 2`` for bf16, ``opd.models.quant`` for int8),
      split like the student's weights.
    cache_bytes: bytes of one cached hidden-state element (2: bf16).
  """
  dims: tuple[int, ...] = ()
  param_bytes: int = 0
  cache_bytes: int = 2

  def __post_init__(self):
    if isinstance(self.dims, (str, bytes)) or not hasattr(self.dims, "__iter__"):
      raise ValueError(f"TeacherMemory.dims={self.dims!r} must be a sequence of widths")
    set_field(self, "dims", tuple(check_int("TeacherMemory", f"dims[{i}]", d, min_value=1)
                                  for i, d in enumerate(self.dims)))
    set_field(self, "param_bytes", check_int("TeacherMemory", "param_bytes", self.param_bytes,
                                             min_value=0))
    set_field(self, "cache_bytes", check_int("TeacherMemory", "cache_bytes", self.cache_bytes,
                                             min_value=1))


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
  """The rollout sampler's KV cache.

  Attributes:
    batch: its rows (global; split over data × fsdp like the training batch).
    cache_len: S, its KV slots per row.
  """
  batch: int
  cache_len: int

  def __post_init__(self):
    for name in ("batch", "cache_len"):
      set_field(self, name, check_int("RolloutMemory", name, getattr(self, name), min_value=1))


@dataclasses.dataclass(frozen=True)
class LoRAMemory:
  """A LoRA student (``opd.training.lora_state``): the frozen base is stored in
  ``base_bytes`` per parameter and gets no gradient (the step differentiates
  the adapters only); the adapters are fp32 and alone have a gradient, Adam
  moments and an update.

  Attributes:
    config: the adapters (rank, targets).
    base_bytes: bytes of a frozen base parameter (2: bf16).
  """
  config: LoRAConfig
  base_bytes: int = 2

  def __post_init__(self):
    if not isinstance(self.config, LoRAConfig):
      raise ValueError(f"LoRAMemory.config must be a LoRAConfig, got "
                       f"{type(self.config).__name__}")
    set_field(self, "base_bytes", check_int("LoRAMemory", "base_bytes", self.base_bytes,
                                            min_value=1))


def estimate_memory(cfg: ModelConfig, mesh_shape, batch: int, seq: int, *,
                    remat: bool | None = None, master_bytes: int = 4, fused_loss: bool = False,
                    teachers: TeacherMemory | None = None, rollout: RolloutMemory | None = None,
                    lora: LoRAMemory | None = None) -> MemoryEstimate:
  """Per-device bytes of a training step of ``cfg`` on a mesh (module docstring).

  Args:
    cfg: the student (or any trained model).
    mesh_shape: ``(data, fsdp, tensor)`` (a 4-entry shape's expert axis is
      counted with fsdp) or a dict of those axes.
    batch: B, global rows per (micro)batch; seq: T, tokens per row.
    remat: rematerialise blocks; None takes ``cfg.remat``.
    master_bytes: bytes of a master parameter and of each Adam moment (4: fp32).
    fused_loss: the loss head is the fused kernel (its ``2·C·V·4`` buffers
      with ``C = min(default_block_t(max(K, 1), V), N)``, K teachers, and its
      fp32 head gradient ``D·V·4``) instead
      of materialised logits.
    teachers: the OPD teachers' hidden-state cache and resident weights
      (None: no teachers).
    rollout: the sampler's KV cache (None: no rollout term).
    lora: a LoRA student's storage (None: a fully trained student).

  Raises:
    ValueError: naming a non-positive batch / seq, a bad mesh shape, or an
      argument of the wrong type.
  """
  for name, value in (("batch", batch), ("seq", seq)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  for name, value, kind in (("teachers", teachers, TeacherMemory),
                            ("rollout", rollout, RolloutMemory), ("lora", lora, LoRAMemory)):
    if value is not None and not isinstance(value, kind):
      raise ValueError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}")
  teachers = teachers if teachers is not None else TeacherMemory()
  shards = _mesh(mesh_shape)
  model_shards = shards["fsdp"] * shards["tensor"]
  tensor = shards["tensor"]
  rows = _ceil_div(batch, shards["data"] * shards["fsdp"])
  tokens = rows * seq
  remat = cfg.remat if remat is None else remat
  n_params = cfg.num_params()
  if lora is None:
    params = _ceil_div(n_params * master_bytes, model_shards)
    grads = _ceil_div(n_params * 4, model_shards)
    optimizer = 2 * params
    update = 3 * params  # new params, new μ, new ν
  else:
    n_lora = lora_param_count(cfg, lora.config)
    params = _ceil_div(n_params * lora.base_bytes + n_lora * 4, model_shards)
    grads = _ceil_div(n_lora * 4, model_shards)
    optimizer = _ceil_div(2 * n_lora * 4, model_shards)
    update = 3 * _ceil_div(n_lora * 4, model_shards)
  b = 2 if cfg.dtype in ("bfloat16", "float16") else 4
  merged = 0 if lora is None else _ceil_div(lora_adapted_count(cfg, lora.config) * b, model_shards)
  per_layer = layer_activation_bytes(cfg, seq, tensor)
  if remat:
    activations = tokens * (cfg.n_layers * b * cfg.d_model + per_layer)
  else:
    activations = tokens * cfg.n_layers * per_layer
  vocab = _ceil_div(cfg.vocab_size, tensor)
  if fused_loss:
    chunk = min(default_block_t(max(len(teachers.dims), 1), cfg.vocab_size), tokens)
    # + the kernel's float32 student-head gradient dW_s [D, V/t], accumulated over chunks.
    loss_head = 2 * chunk * vocab * 4 + cfg.d_model * vocab * 4 + tokens * 4 * 6 * cfg.d_model
  else:
    loss_head = tokens * 4 * (4 * vocab + 6 * cfg.d_model)
  kv_cache = 0
  if rollout is not None:
    kv_rows = _ceil_div(rollout.batch, shards["data"] * shards["fsdp"])
    if cfg.mla is not None:
      per_slot = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    else:
      per_slot = 2 * _ceil_div(cfg.n_kv_heads, tensor) * cfg.resolved_head_dim
    kv_cache = cfg.n_layers * kv_rows * rollout.cache_len * per_slot * b
  teacher_cache = tokens * sum(teachers.dims) * teachers.cache_bytes
  return MemoryEstimate(params=params, grads=grads, optimizer=optimizer, activations=activations,
                        loss_head=loss_head, lora_merged=merged, update=update, kv_cache=kv_cache, teacher_cache=teacher_cache,
                        teacher_params=_ceil_div(teachers.param_bytes, model_shards),
                        shards=shards)


@dataclasses.dataclass(frozen=True)
class ForwardMemory:
  """Bytes per device of a forward-only pass (a frozen teacher's hidden states).

  Attributes:
    params: the weights the pass reads, in their storage dtype, split over
      fsdp × tensor (an untied LM head is not read: no logits).
    hidden: the returned last hidden states ``[N, D]`` in the compute dtype.
    transient: the largest set one block holds at once (``forward_transient_bytes``
      per token): nothing is kept for a backward, so blocks reuse buffers.
  """
  params: int
  hidden: int
  transient: int

  @property
  def total(self) -> int:
    """Bytes per device, all terms."""
    return self.params + self.hidden + self.transient

  def terms(self) -> dict[str, int]:
    """``{term: bytes}``, largest first."""
    named = (("params", self.params), ("hidden", self.hidden), ("transient", self.transient))
    return dict(sorted(named, key=lambda kv: -kv[1]))


def forward_transient_bytes(cfg: ModelConfig, keys: int, tensor: int = 1) -> int:
  """Bytes per token a forward-only block holds at its peak:
  ``max(3·F·b, 4·3·H·S) + 2·D·b``, the larger of the MLP's three F-wide
  tensors (gate, up, their product) and attention's three fp32 ``[H, S]``
  score tensors, plus the residual stream and its normed copy. Arguments as
  ``layer_activation_bytes``."""
  b = 2 if cfg.dtype in ("bfloat16", "float16") else 4
  split = lambda n: _ceil_div(n, tensor)
  return max(3 * split(_dense_width(cfg)) * b, 4 * 3 * split(cfg.n_heads) * keys) \
      + 2 * cfg.d_model * b


def forward_memory(cfg: ModelConfig, mesh_shape, batch: int, seq: int) -> ForwardMemory:
  """Per-device bytes of ``forward(cfg, ..., return_logits=False, return_hidden=True)``.

  Args:
    cfg: the model (its ``param_dtype`` sizes the weights, ``dtype`` the activations).
    mesh_shape, batch, seq: as ``estimate_memory``.

  Raises:
    ValueError: naming a non-positive batch / seq or a bad mesh shape.
  """
  for name, value in (("batch", batch), ("seq", seq)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  shards = _mesh(mesh_shape)
  tokens = _ceil_div(batch, shards["data"] * shards["fsdp"]) * seq
  weight = 2 if cfg.param_dtype in ("bfloat16", "float16") else 4
  b = 2 if cfg.dtype in ("bfloat16", "float16") else 4
  read = cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
  return ForwardMemory(
      params=_ceil_div(read * weight, shards["fsdp"] * shards["tensor"]),
      hidden=tokens * cfg.d_model * b,
      transient=tokens * forward_transient_bytes(cfg, seq, shards["tensor"]))

def hidden_vs_logit_cache(teacher_dims: Sequence[int], vocab_size: int,
                          hidden_bytes: int = 2) -> tuple[int, int]:
  """Bytes per token of the teachers' hidden-state cache and of an fp32 logit cache."""
  return sum(teacher_dims) * hidden_bytes, len(teacher_dims) * vocab_size * 4


def check_fits(model_cfg: ModelConfig, mesh_shape, batch: int, seq: int, device_bytes: int,
               **kwargs) -> MemoryEstimate:
  """``estimate_memory(...)`` if its total fits ``device_bytes``; else raises.

  Args:
    model_cfg, mesh_shape, batch, seq, kwargs: as ``estimate_memory``.
    device_bytes: the accelerator's memory (e.g. 95 GiB for a TPU v5p chip).

  Raises:
    DoesNotFitError: naming the total, the device's bytes and the three
      largest terms.
  """
  if not isinstance(device_bytes, (int, float)) or device_bytes <= 0:
    raise ValueError(f"device_bytes={device_bytes!r} must be positive")
  est = estimate_memory(model_cfg, mesh_shape, batch, seq, **kwargs)
  if est.total > device_bytes:
    top = list(est.terms().items())[:3]
    named = ", ".join(f"{n} {v / 2**30:.2f} GiB" for n, v in top)
    raise DoesNotFitError(
        f"layout mesh {est.shards} batch={batch} seq={seq} needs {est.total / 2**30:.2f} GiB per "
        f"device > {device_bytes / 2**30:.2f} GiB; largest terms: {named}")
  return est


def device_bytes() -> int:
  """Memory of one local device: the accelerator's ``bytes_limit`` where the
  runtime reports it, else the host's available memory (``/proc/meminfo``
  MemAvailable, all of it if unknown) shared by the local CPU devices."""
  import jax  # noqa: PLC0415
  dev = jax.local_devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          avail = int(line.split()[1]) * 1024
          break
  except OSError:
    pass
  return avail // max(1, jax.local_device_count())


def step_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
  """FLOPs of one training step: 3 × the forward's (backward = 2 × forward)."""
  return 3.0 * batch * seq * cfg.flops_per_token(seq)


def step_seconds(cfg: ModelConfig, batch: int, seq: int, chips: int, peak_flops: float,
                 mfu: float = 0.4) -> float:
  """Step time at ``mfu`` of ``chips × peak_flops`` (a planning figure, not a measurement)."""
  return step_flops(cfg, batch, seq) / (chips * peak_flops * mfu)


__all__ = ["DoesNotFitError", "device_bytes", "ForwardMemory", "LoRAMemory", "MemoryEstimate",
           "RolloutMemory", "TeacherMemory", "check_fits", "estimate_memory", "forward_memory",
           "forward_transient_bytes", "hidden_vs_logit_cache", "layer_activation_bytes",
           "step_flops", "step_seconds"]
