"""Old config layouts: the one map from their field paths to today's.

A config group changes shape now and then (``OPDConfig`` went from 34 flat
fields to nested ``rollout`` / ``weighting`` / ``loss`` groups, issue #24).
Runs recorded before such a change (a workdir's ``config.json``, a stage's
``config.json``, a checkpoint's config) must still be recognised as the same
config, and an old command-line path must be refused with the new one named.
Both read :data:`MOVED` and :data:`FILLED`, here only:

* ``migrate(saved)`` rewrites every group named in :data:`MOVED` (at any depth
  of ``saved``: ``opd``, ``world.opd``, ``experiment.opd``, ...) that still
  holds old paths into today's layout, and adds the fields new in that
  layout at the values the old runs used (:data:`FILLED`);
* ``moved_to("opd.estimator")`` is ``"opd.loss.estimator"``: the launcher's
  overrides (``opd.config.overrides.apply_overrides``) and the dict ->
  dataclass converter (``opd.config.fields.from_group``) name it in their
  errors.

Fields added to a group later, in either layout, at a value that reproduces
the older runs are a different matter: ``experiments.common.ADDED_FIELDS``
(stage configs) lists them under their current path.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MOVED", "FILLED", "migrate", "moved_to"]

# Group name -> {old field: new path inside the group}. The OPD group before
# the nesting of #24 (its flat fields that stayed flat are not listed:
# updates_per_batch, deadline_s, fault_window, cache_dtype, diag_every,
# diag_tokens, verify).
MOVED: dict[str, dict[str, str]] = {
    "opd": {
        # opd.rollout.batches.RolloutConfig
        "prompts_per_step": "rollout.prompts_per_step",
        "group_size": "rollout.group_size",
        "temperature": "rollout.temperature",
        "max_new_tokens": "rollout.max_new_tokens",
        "seq_len": "rollout.seq_len",
        "length_bucket": "rollout.length_bucket",
        "domain_balance": "rollout.domain_balance",
        # opd.distill.teacher_weighting.TeacherWeightingConfig
        "schedule": "weighting.schedule",
        "confidence_by": "weighting.confidence_by",
        "confidence_temperature": "weighting.confidence_temperature",
        "confidence_per_token": "weighting.confidence_per_token",
        "anneal_steps": "weighting.anneal_steps",
        "anneal_to": "weighting.anneal_to",
        # opd.distill.loss.OPDLossConfig
        "estimator": "loss.estimator",
        "top_k": "loss.top_k",
        "kl_temperature": "loss.temperature",
        "teacher_temperature": "loss.teacher_temperature",
        "aggregation": "loss.aggregation",
        "forward_kl_coef": "loss.forward_kl_coef",
        "grpo_coef": "loss.grpo_coef",
        "grpo_clip_eps_low": "loss.grpo_clip_eps_low",
        "grpo_clip_eps_high": "loss.grpo_clip_eps_high",
        "loss_form": "loss.form",
        "adv_gamma": "loss.adv_gamma",
        "adv_beta": "loss.adv_beta",
        "adv_alpha": "loss.adv_alpha",
        "is_cap": "loss.is_cap",
    },
}

# Group name -> {new path: value}: fields the new layout holds that the old
# one did not, at the value every old run used. The flat OPD group sampled
# untruncated and built its loss with OPDLossConfig's kernel defaults.
FILLED: dict[str, dict[str, Any]] = {
    "opd": {"rollout.top_k": 0, "rollout.top_p": 1.0, "loss.impl": "auto",
            "loss.gradient_in_forward": True},
}


def moved_to(path: str) -> str | None:
  """Today's path of an old dotted field path, else None.

  ``"opd.estimator"`` -> ``"opd.loss.estimator"``; the group may sit anywhere
  (``"world.opd.kl_temperature"`` -> ``"world.opd.loss.temperature"``); a
  leading ``"config."`` is kept.
  """
  parts = path.split(".")
  if len(parts) < 2 or parts[-2] not in MOVED or parts[-1] not in MOVED[parts[-2]]:
    return None
  return ".".join(parts[:-1] + [MOVED[parts[-2]][parts[-1]]])


def _set(tree: dict, path: str, value: Any, *, overwrite: bool = True) -> None:
  *groups, leaf = path.split(".")
  for g in groups:
    tree = tree.setdefault(g, {})
  if overwrite or leaf not in tree:
    tree[leaf] = value


def _migrate_group(name: str, group: Mapping[str, Any]) -> dict[str, Any]:
  old = MOVED[name]
  out: dict[str, Any] = {}
  for key, value in group.items():
    if key in old:
      _set(out, old[key], value)
    else:
      out[key] = value
  for path, value in FILLED.get(name, {}).items():
    _set(out, path, value, overwrite=False)
  return out


def migrate(saved: Any) -> Any:
  """``saved`` (a JSON-ready nested dict) in today's layout.

  Every group named in :data:`MOVED` that holds any of its old fields is
  rewritten (those fields moved to their new paths, :data:`FILLED` added);
  groups already in today's layout, and everything else, are returned
  unchanged. ``saved`` itself is not modified.
  """
  if not isinstance(saved, Mapping):
    return saved
  out = {}
  for key, value in saved.items():
    value = migrate(value)
    if key in MOVED and isinstance(value, Mapping) and set(value) & set(MOVED[key]):
      value = _migrate_group(key, value)
    out[key] = value
  return out
