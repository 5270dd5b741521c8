"""Weight-space baselines for merging specialists (docs/DESIGN.md §3, Baselines).

Two ways to turn N specialists of one architecture into one model without
any training, the baselines OPD is compared against:

* **parameter averaging** ("model soup"): ``θ = (1/N) Σ_i θ_i``;
* **task arithmetic** (Ilharco et al., arXiv 2212.04089): each specialist's
  *task vector* ``τ_i = θ_i − θ_base`` is what fine-tuning added to the
  shared base, and ``θ = θ_base + λ Σ_i τ_i``. ``λ = 1/N`` is the average;
  larger ``λ`` keeps more of each specialist at the risk of interference.

Both work on any pytree of arrays (the plain nested dicts of
``opd.models.init_params``) with identical structure, shapes and dtypes;
arithmetic is done in float32 (or the leaf's dtype if wider) and cast back
to the leaf's dtype. Integer leaves are refused, as an average of them is
not a parameter.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["average_params", "task_arithmetic", "task_vectors"]

PyTree = Any


def _leaves(tree: PyTree, what: str) -> tuple[list[str], list[Any], Any]:
  """Leaf paths (``a/b/c``), leaves and the treedef of ``tree``."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if not flat:
    raise ValueError(f"{what} has no array leaves")
  paths = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
           for path, _ in flat]
  return paths, [leaf for _, leaf in flat], treedef


def _check_same(trees: Sequence[PyTree], names: Sequence[str]) -> tuple[list[str], list, Any]:
  """Paths, per-tree leaves and treedef; raises naming the first mismatch."""
  paths0, leaves0, treedef0 = _leaves(trees[0], names[0])
  all_leaves = [leaves0]
  for tree, name in zip(trees[1:], names[1:]):
    paths, leaves, _ = _leaves(tree, name)
    if paths != paths0:
      only_a = sorted(set(paths0) - set(paths))[:3]
      only_b = sorted(set(paths) - set(paths0))[:3]
      raise ValueError(f"{name} has another parameter structure than {names[0]}: leaves only in "
                       f"{names[0]}: {only_a}; only in {name}: {only_b}")
    for path, a, b in zip(paths0, leaves0, leaves):
      if tuple(np.shape(a)) != tuple(np.shape(b)):
        raise ValueError(f"{name}[{path!r}].shape={tuple(np.shape(b))} differs from "
                         f"{names[0]}[{path!r}].shape={tuple(np.shape(a))}")
      if jnp.result_type(a) != jnp.result_type(b):
        raise ValueError(f"{name}[{path!r}].dtype={jnp.result_type(b)} differs from "
                         f"{names[0]}[{path!r}].dtype={jnp.result_type(a)}")
    all_leaves.append(leaves)
  for path, leaf in zip(paths0, leaves0):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise ValueError(f"{names[0]}[{path!r}].dtype={jnp.result_type(leaf)} is not floating: "
                       "only float parameters can be merged")
  return paths0, all_leaves, treedef0


def _compute_dtype(leaf) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def _names(n: int, names: Sequence[str] | None, what: str) -> list[str]:
  if names is None:
    return [f"{what}[{i}]" for i in range(n)]
  names = [str(x) for x in names]
  if len(names) != n:
    raise ValueError(f"names has {len(names)} entries for {n} {what}")
  return names


def average_params(params: Sequence[PyTree], *, names: Sequence[str] | None = None) -> PyTree:
  """The parameter average ``(1/N) Σ_i θ_i`` of N same-architecture models.

  Args:
    params: N >= 1 pytrees with identical structure, leaf shapes and dtypes
      (e.g. each leaf ``[D, V]``, ``[D, H, Dh]``, ...).
    names: N names used in error messages (default ``params[i]``).

  Returns:
    A pytree of the same structure, each leaf in its original dtype.

  Raises:
    ValueError: no models, or a structure/shape/dtype mismatch (naming the
      leaf path, both shapes or dtypes and the models).
  """
  params = list(params)
  if not params:
    raise ValueError("params=[]: averaging needs at least one model")
  names = _names(len(params), names, "params")
  _, leaves, treedef = _check_same(params, names)
  n = len(params)
  out = []
  for per_model in zip(*leaves):
    dt = _compute_dtype(per_model[0])
    total = sum(jnp.asarray(x, dt) for x in per_model)
    out.append((total / n).astype(jnp.result_type(per_model[0])))
  return jax.tree_util.tree_unflatten(treedef, out)


def task_vectors(base: PyTree, params: Sequence[PyTree], *,
                 names: Sequence[str] | None = None) -> list[PyTree]:
  """``τ_i = θ_i − θ_base`` per model, in float32 (or wider)."""
  params = list(params)
  if not params:
    raise ValueError("params=[]: task vectors need at least one fine-tuned model")
  names = ["base"] + _names(len(params), names, "params")
  _, leaves, treedef = _check_same([base] + params, names)
  base_leaves = leaves[0]
  return [jax.tree_util.tree_unflatten(
      treedef, [jnp.asarray(x, _compute_dtype(x)) - jnp.asarray(b, _compute_dtype(b))
                for x, b in zip(model, base_leaves)]) for model in leaves[1:]]


def task_arithmetic(base: PyTree, params: Sequence[PyTree], scale: float, *,
                    names: Sequence[str] | None = None) -> PyTree:
  """``θ = θ_base + λ Σ_i (θ_i − θ_base)`` (task arithmetic).

  Args:
    base: the shared pre-trained model every ``params[i]`` was fine-tuned from.
    params: N >= 1 fine-tuned models (same structure, shapes, dtypes as ``base``).
    scale: λ, a finite float > 0 (``1/N`` gives the parameter average; 1
      adds every task vector in full).
    names: N names for error messages.

  Returns:
    The merged pytree, each leaf in ``base``'s dtype.

  Raises:
    ValueError: ``scale`` not a finite positive number, or a mismatch.
  """
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
    raise ValueError(f"scale={scale!r} must be a float (λ of task arithmetic)")
  scale = float(scale)
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"scale={scale!r} must be finite and > 0 (λ of task arithmetic)")
  vectors = task_vectors(base, params, names=names)
  total = jax.tree.map(lambda *v: sum(v), *vectors)
  return jax.tree.map(
      lambda b, t: (jnp.asarray(b, _compute_dtype(b)) + scale * t).astype(jnp.result_type(b)),
      base, total)
