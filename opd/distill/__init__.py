"""Multi-teacher on-policy distillation: the building blocks (docs/DESIGN.md §3).

``teachers`` (Teacher, TeacherPool: hidden states, placement, teacher-sorted
batching), ``faults`` (deadlines, skips, counters), ``schedule`` (weights
``[B, T, K]``: routing, confidence, uniform, annealing, renormalisation after
skips), ``cache`` (the per-rollout-batch hidden-state cache), ``loss`` (the
OPD loss on ``pallas_kernels.fused_reverse_kl``, docs/DESIGN.md §4, and its
top-k / token estimators), ``diagnostics`` and ``server`` (out-of-process
teachers over a Unix socket, used through ``RemoteTeacher``).
"""
from opd.distill import cache, diagnostics, faults, loss, schedule, server, teachers
from opd.distill.cache import CachedBatch, HiddenStateCache, loss_batch
from opd.distill.diagnostics import (logit_diagnostics, sample_response_positions,
                                     teacher_diagnostics)
from opd.distill.faults import (REASONS, FaultTolerantTeachers, SkipCounter, TeacherAnswers,
                                call_with_deadline)
from opd.distill.loss import ESTIMATORS, OPDLossConfig, make_opd_loss
from opd.distill.schedule import (anneal, apply_availability, confidence_scores,
                                  confidence_weights, normalize, routing_weights, uniform_weights,
                                  weight_metrics)
from opd.distill.server import RemoteTeacher
from opd.distill.teachers import PLACEMENTS, Teacher, TeacherPool, check_teachers, row_groups

__all__ = [
    "CachedBatch", "ESTIMATORS", "FaultTolerantTeachers", "HiddenStateCache", "OPDLossConfig",
    "PLACEMENTS", "REASONS", "RemoteTeacher", "SkipCounter", "Teacher", "TeacherAnswers",
    "TeacherPool", "anneal", "apply_availability", "cache", "call_with_deadline",
    "check_teachers", "confidence_scores", "confidence_weights", "diagnostics", "faults",
    "logit_diagnostics", "loss", "loss_batch", "make_opd_loss", "normalize", "routing_weights",
    "row_groups", "sample_response_positions", "schedule", "server", "teacher_diagnostics", "teachers",
    "uniform_weights", "weight_metrics",
]
