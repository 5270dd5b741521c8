"""Teachers and the teacher pool of on-policy distillation (docs/DESIGN.md §3).

A :class:`Teacher` is any model of our decoder family (its own width and
depth) with a name, an optional domain label and its output head
``W_k = head_matrix(cfg, params)`` ``[D_k, V]``. The :class:`TeacherPool`
runs the teachers' forward passes over prompt + student response and returns
their **last hidden states** ``[B, T, D_k]``, never logits: the fused loss
rebuilds logits tile by tile from ``W_k`` (docs/DESIGN.md §4).

Placement (``TeacherPool(placement=...)``):

* ``"colocated"``: the teachers' params are sharded on the student's mesh
  with the model's logical rules and run time-shared on the same devices;
* ``"disaggregated"``: the teachers live on ``teacher_mesh``, a mesh over
  devices disjoint from the student's; each hidden-state array is moved to
  the student's batch sharding with ``jax.device_put``.

Teachers hold params only: no gradients, no optimizer state.

Validation at the door: a ``Teacher``'s parameter tree must match its config
(every path and shape of ``init_params(cfg)``; :func:`check_params`), and a
teacher loaded from files (``from_checkpoint``, ``from_hf``, the teacher
server) must also be finite everywhere; the pool refuses token ids outside
``[0, V)``. A teacher built in memory with non-finite values is accepted and
handled at run time as a fault (``opd.distill.faults``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opd.models import ModelConfig, forward, head_matrix, init_params, param_logical_axes
from opd.models import quant
from opd.parallel import sharding as sharding_lib
from opd.parallel.distributed import batch_shard_count
from opd.text.tokenizers import check_vocab

PLACEMENTS = ("colocated", "disaggregated")


@dataclasses.dataclass(frozen=True, eq=False)
class Teacher:
  """One teacher model.

  Attributes:
    name: unique name (metrics are keyed by it).
    cfg: its ``ModelConfig`` (any width / depth; the vocabulary must be the
      student's unless ``tokenizer`` is another one).
    params: its parameter tree (never differentiated).
    domain: the task domain it specialises in (prompt routing), or None.
    int8: the pool stores its matmul weights as int8 with per-channel
      scales and dequantises them inside the forward (``opd.models.quant``;
      docs/DESIGN.md §2, int8 teachers).
    tokenizer: its tokenizer when it may differ from the student's (then
      ``train_opd`` asks it through ``opd.distill.crosstok_pool``, for the
      advantage form); None: the student's.
  """
  name: str
  cfg: ModelConfig
  params: Any
  domain: str | None = None
  int8: bool = False
  tokenizer: Any = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"Teacher.name={self.name!r} must be a non-empty string")
    if not isinstance(self.cfg, ModelConfig):
      raise ValueError(f"Teacher {self.name!r}: cfg={type(self.cfg).__name__} is not a ModelConfig")
    if not isinstance(self.params, dict) or "embedding" not in self.params:
      raise ValueError(f"Teacher {self.name!r}: params (a {type(self.params).__name__}) is not a "
                       "model parameter tree (no 'embedding')")
    check_params(self.name, self.cfg, self.params)
    if not isinstance(self.int8, bool):
      raise ValueError(f"Teacher {self.name!r}: int8={self.int8!r} must be True or False")
    if self.tokenizer is not None:
      try:
        check_vocab(self.tokenizer, self.cfg)
      except ValueError as e:
        raise ValueError(f"Teacher {self.name!r}: tokenizer: {e}") from None

  @property
  def head(self) -> jax.Array:
    """``W_k`` [D_k, V]."""
    return head_matrix(self.cfg, self.params)

  @classmethod
  def from_checkpoint(cls, name: str, directory: str | os.PathLike, cfg: ModelConfig, *,
                      domain: str | None = None, step: int | None = None, mesh=None,
                      rules=None) -> "Teacher":
    """A teacher from one of our training checkpoints (``CheckpointManager`` root).

    Raises:
      ValueError: ``directory`` holds no checkpoint, or one whose config has
        no model / another architecture than ``cfg``.
    """
    from opd.training.checkpoints import load_params
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
      raise ValueError(f"teacher {name!r}: checkpoint directory={directory!r} does not exist")
    try:
      params = load_params(directory, cfg, step=step, mesh=mesh, rules=rules)
    except FileNotFoundError as e:
      hint = " (it looks like a HF model: use Teacher.from_hf)" if os.path.exists(
          os.path.join(directory, "config.json")) else ""
      raise ValueError(f"teacher {name!r}: directory={directory!r} is not a model "
                       f"checkpoint{hint}: {e}") from e
    check_params(name, cfg, params, finite=True, source=directory)
    return cls(name, cfg, params, domain)

  @classmethod
  def from_hf(cls, name: str, path: str, *, domain: str | None = None,
              config: ModelConfig | None = None, dtype: str = "float32") -> "Teacher":
    """A teacher from a HF safetensors directory (Llama / Qwen2 / Qwen3)."""
    from opd.models import hf
    cfg, params = hf.load_hf(path, dtype=dtype, config=config)
    check_params(name, cfg, params, finite=True, source=path)
    return cls(name, cfg, params, domain)

  @classmethod
  def random(cls, name: str, cfg: ModelConfig, seed: int, *, domain: str | None = None
             ) -> "Teacher":
    """A randomly initialised teacher (tests, tiny configs)."""
    return cls(name, cfg, init_params(cfg, jax.random.key(seed)), domain)


def _path(keys) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def check_params(name: str, cfg: ModelConfig, params, *, finite: bool = False,
                 source: str | None = None) -> None:
  """Checks teacher ``name``'s parameter tree against its config.

  Every path of ``init_params(cfg)`` must be present with its shape, and no
  other; with ``finite`` every value must be finite too (a pass over all
  params: done when loading from files).

  Raises:
    ValueError: naming the teacher, the parameter path and the expected and
      actual shape (or the count of non-finite values), and ``source``.
  """
  where = f" (loaded from {source!r})" if source else ""
  want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  want = {_path(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(want)[0]}
  got = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing or extra:
    raise ValueError(f"teacher {name!r}{where}: its params do not match its config: missing "
                     f"{missing}, unexpected {extra}")
  for path, shape in want.items():
    actual = tuple(np.shape(got[path]))
    if actual != shape:
      raise ValueError(f"teacher {name!r}{where}: parameter {path} has shape {actual}, but its "
                       f"config (d_model={cfg.d_model}, n_layers={cfg.n_layers}, "
                       f"vocab_size={cfg.vocab_size}) expects {shape}")
  if finite:
    for path in want:
      n_bad = int(jnp.size(got[path]) - jnp.sum(jnp.isfinite(got[path])))
      if n_bad:
        raise ValueError(f"teacher {name!r}{where}: parameter {path} holds {n_bad} non-finite "
                         f"values (of {int(jnp.size(got[path]))})")


def check_teachers(teachers: Sequence[Teacher], vocab_size: int) -> tuple[Teacher, ...]:
  """Validates a teacher list against the student's vocabulary size V.

  Raises:
    ValueError: empty list, duplicate names, or a teacher whose vocabulary
      differs from the student's (naming both values).
  """
  teachers = tuple(teachers)
  if not teachers:
    raise ValueError("teachers=[]: distillation needs at least one teacher")
  names = [t.name for t in teachers]
  if len(set(names)) != len(names):
    raise ValueError(f"teacher names must be unique; got {names}")
  for t in teachers:
    if not isinstance(t, Teacher):
      raise ValueError(f"teachers must be Teacher objects; got {type(t).__name__}")
    if t.cfg.vocab_size != vocab_size:
      raise ValueError(f"teacher {t.name!r} has vocab_size={t.cfg.vocab_size} but the student "
                       f"has vocab_size={vocab_size}; teachers must share the student's "
                       "vocabulary")
  return teachers


class TeacherPool:
  """Runs teachers' forward passes and returns last hidden states.

  Args:
    teachers: the teachers, in the order of the weights' K axis.
    vocab_size: the student's V (checked against every teacher).
    mesh: the student's mesh (hidden states come back with its batch
      sharding).
    rules: logical → mesh rules (default ``DEFAULT_RULES``).
    placement: ``"colocated"`` or ``"disaggregated"`` (see module docstring).
    teacher_mesh: for ``"disaggregated"``, a mesh whose devices are disjoint
      from ``mesh``'s.

  Attributes:
    forward_count: ``{name: number of forward calls}`` (the cache's test
      hook: one per teacher per rollout batch).
  """

  def __init__(self, teachers: Sequence[Teacher], vocab_size: int, mesh, *,
               rules=sharding_lib.DEFAULT_RULES, placement: str = "colocated",
               teacher_mesh=None):
    self.teachers = check_teachers(teachers, vocab_size)
    self.vocab_size = vocab_size
    self.mesh = mesh
    self.rules = sharding_lib.validate_rules(rules)
    if placement not in PLACEMENTS:
      raise ValueError(f"placement={placement!r}: expected one of {PLACEMENTS}")
    if placement == "colocated":
      if teacher_mesh is not None:
        raise ValueError("teacher_mesh is only for placement='disaggregated'")
      teacher_mesh = mesh
    else:
      if teacher_mesh is None:
        raise ValueError("placement='disaggregated' needs a teacher_mesh")
      shared = set(mesh.devices.flat) & set(teacher_mesh.devices.flat)
      if shared:
        raise ValueError(f"teacher_mesh shares {len(shared)} devices with the student mesh "
                         f"(e.g. {sorted(shared, key=lambda d: d.id)[0]}); placement="
                         "'disaggregated' needs disjoint devices")
    self.placement = placement
    self.teacher_mesh = teacher_mesh
    self.forward_count = {t.name: 0 for t in self.teachers}
    self._params = {t.name: self._place(t) for t in self.teachers}
    self._fns: dict[str, Callable] = {}
    self._heads: tuple[jax.Array, ...] | None = None

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(t.name for t in self.teachers)

  @property
  def heads(self) -> tuple[jax.Array, ...]:
    """The K heads ``W_k`` [D_k, V], placed for the student's loss (replicated)."""
    if self._heads is None:
      rep = sharding_lib.replicated(self.mesh)
      self._heads = tuple(jax.device_put(head_matrix(t.cfg, quant.dequantize(
          self._params[t.name], t.cfg.storage_dtype)), rep) for t in self.teachers)
    return self._heads

  def teacher(self, name: str) -> Teacher:
    for t in self.teachers:
      if t.name == name:
        return t
    raise ValueError(f"teacher={name!r} is not in the pool; teachers: {list(self.names)}")

  def _place(self, t: Teacher):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t.params)
    shardings = sharding_lib.tree_shardings(param_logical_axes(t.cfg), shapes,
                                            self.teacher_mesh, self.rules)
    placed = jax.device_put(t.params, shardings)
    return quant.quantize_int8(placed) if t.int8 else placed

  def _fn(self, t: Teacher) -> Callable:
    if t.name not in self._fns:
      out = sharding_lib.batch_sharding(self.teacher_mesh, self.rules, 3)

      def run(params, tokens, mask):
        hidden = forward(t.cfg, quant.dequantize(params, t.cfg.storage_dtype), tokens, None,
                         mask, return_logits=False, return_hidden=True).hidden
        return hidden.astype(jnp.float32)

      self._fns[t.name] = jax.jit(run, out_shardings=out)
    return self._fns[t.name]

  def _forward(self, name: str, tokens: np.ndarray, mask: np.ndarray) -> jax.Array:
    """[B, T, D_k] float32 on the teacher mesh (B divisible by its batch shards)."""
    in_sh = sharding_lib.batch_sharding(self.teacher_mesh, self.rules, 2)
    tokens_d = jax.device_put(tokens.astype(np.int32), in_sh)
    mask_d = jax.device_put(mask.astype(bool), in_sh)
    self.forward_count[name] += 1
    with jax.set_mesh(self.teacher_mesh), nn.logical_axis_rules(self.rules):
      return self._fn(self.teacher(name))(self._params[name], tokens_d, mask_d)

  def hidden_one(self, name: str, tokens, mask) -> jax.Array:
    """One teacher's last hidden states ``[B, T, D_k]`` (float32), on the
    student's batch sharding.

    Args:
      name: the teacher.
      tokens: [B, T] int prompt + response tokens.
      mask: [B, T] bool real tokens.
    """
    self.teacher(name)
    tokens, mask = _check_tokens(tokens, mask, f"teacher {name!r}", self.vocab_size)
    return jax.device_put(self._forward(name, tokens, mask),
                          sharding_lib.batch_sharding(self.mesh, self.rules, 3))

  def hidden_rows(self, name: str, tokens, mask) -> jax.Array:
    """Like :meth:`hidden_one` for any number of rows b (a routed group).

    The rows are padded to a multiple of the teacher mesh's batch shards by
    repeating the first row; returns ``[b, T, D_k]`` float32 on the default
    device.
    """
    self.teacher(name)
    tokens, mask = _check_tokens(tokens, mask, f"teacher {name!r}", self.vocab_size)
    b = tokens.shape[0]
    n_shards = batch_shard_count(sharding_lib.batch_sharding(self.teacher_mesh, self.rules, 2))
    padded = np.concatenate([np.arange(b), np.zeros(-b % n_shards, int)])
    hidden = self._forward(name, tokens[padded], mask[padded])
    return jax.device_put(hidden, jax.local_devices()[0])[:b]

  def hidden(self, name: str, tokens, mask) -> jax.Array:
    """:meth:`hidden_one` when both meshes' batch shards divide B, else
    :meth:`hidden_rows` (a routed group of any size)."""
    b = np.shape(tokens)[0]
    shards = [batch_shard_count(sharding_lib.batch_sharding(m, self.rules, 2))
              for m in (self.mesh, self.teacher_mesh)]
    if all(b % n == 0 for n in shards):
      return self.hidden_one(name, tokens, mask)
    return self.hidden_rows(name, tokens, mask)

  def hidden_states(self, tokens, mask) -> dict[str, jax.Array]:
    """Every teacher's ``[B, T, D_k]`` hidden states, keyed by name."""
    return {name: self.hidden_one(name, tokens, mask) for name in self.names}

  def hidden_routed(self, tokens, mask, teacher_of_row: Sequence[int]) -> dict[str, jax.Array]:
    """Teacher-sorted batching for prompt routing.

    Rows are grouped by their teacher; each teacher runs its forward pass
    over its group only (:meth:`hidden_rows`). Rows of other groups are zero.
    (:class:`opd.distill.faults.FaultTolerantTeachers` does the same grouping
    with deadlines, for in- and out-of-process teachers.)

    Args:
      tokens, mask: [B, T].
      teacher_of_row: [B] index into the teachers for each row.

    Returns:
      ``{name: [B, T, D_k]}`` float32 on the student's batch sharding, for
      the teachers with at least one row.
    """
    tokens, mask = _check_tokens(tokens, mask, f"teachers {list(self.names)}",
                                 self.vocab_size)
    groups = row_groups(teacher_of_row, tokens.shape[0], len(self.teachers))
    out = {}
    for t, rows in zip(self.teachers, groups):
      if rows.size:
        h = self.hidden_rows(t.name, tokens[rows], mask[rows])
        full = jnp.zeros(tokens.shape + (h.shape[-1],), jnp.float32).at[rows].set(h)
        out[t.name] = jax.device_put(full, sharding_lib.batch_sharding(self.mesh, self.rules, 3))
    return out


def _check_tokens(tokens, mask, who: str, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """[B, T] tokens with ids in [0, V) (an id >= V would read past the
  embedding table: NaN hidden states, not an error) and a [B, T] mask."""
  tokens, mask = np.asarray(tokens), np.asarray(mask)
  if tokens.ndim != 2 or mask.shape != tokens.shape:
    raise ValueError(f"tokens.shape={tokens.shape} and mask.shape={mask.shape} must both be "
                     "[B, T]")
  if tokens.size and (tokens.max() >= vocab_size or tokens.min() < 0):
    bad = tokens.max() if tokens.max() >= vocab_size else tokens.min()
    raise ValueError(f"{who}: tokens hold id {bad} outside [0, V={vocab_size}) "
                     f"(max id {tokens.max()}, V={vocab_size})")
  return tokens, mask


def row_groups(teacher_of_row, b: int, k: int) -> list[np.ndarray]:
  """The row indices of each of the K teachers' groups (teacher-sorted batching).

  Args:
    teacher_of_row: [B] int, the teacher of each row (prompt routing).
    b: B; k: K.

  Raises:
    ValueError: wrong shape, or an index outside [0, K).
  """
  rows_of = np.asarray(teacher_of_row)
  if rows_of.shape != (b,) or not np.issubdtype(rows_of.dtype, np.integer):
    raise ValueError(f"teacher_of_row.shape={rows_of.shape} dtype={rows_of.dtype}: expected "
                     f"[B]=({b},) ints")
  if rows_of.size and (rows_of.min() < 0 or rows_of.max() >= k):
    raise ValueError(f"teacher_of_row must lie in [0, K={k}); got {sorted(set(rows_of.tolist()))}")
  return [np.flatnonzero(rows_of == i) for i in range(k)]
