"""Multi-teacher on-policy distillation: the building blocks (docs/DESIGN.md §3).

``teachers`` (Teacher, TeacherPool: hidden states, placement, teacher-sorted
batching), ``faults`` (deadlines, skips, counters), ``teacher_weighting`` (weights
``[B, T, K]``: routing, confidence, uniform, annealing, renormalisation after
skips), ``cache`` (the per-rollout-batch hidden-state cache), ``loss`` (the
OPD loss on ``pallas_kernels.fused_reverse_kl``, docs/DESIGN.md §4, and its
top-k / token estimators), ``advantage`` (the advantage form: the teachers'
sampled-token log-ratio inside GRPO's policy gradient), ``crosstok`` and
``crosstok_pool`` (teachers with another tokenizer: span log-ratios at common
byte boundaries for the advantage form), ``gold`` (a GOLD-style
full-vocabulary surrogate across vocabularies), ``diagnostics`` and
``server`` (out-of-process teachers over a Unix socket, used through
``RemoteTeacher``).

``source`` (``OPDSource``, ``OPDConfig``) and ``trainer`` (``train_opd``)
compose them into the trainer on ``opd.training.loop``, roughly as below;
``cold_start`` builds SFT data from verified teacher answers::

  pool = TeacherPool(teachers, student_cfg.vocab_size, mesh)
  asked = FaultTolerantTeachers.from_pool(pool, deadline_s=60.0)
  cache = HiddenStateCache(asked, sharding=batch_sharding(mesh, rules, 3))
  step = make_train_step(make_opd_loss(student_cfg, pool.heads, OPDLossConfig(),
                                       teacher_names=pool.names), optimizer, mesh, shardings)
  # per rollout batch r (tokens, targets, mask, loss_mask from the sampler):
  cached = cache.get(r, batch["tokens"], batch["mask"])   # K forwards, once
  if cached.batch_ok:                                      # else skip the step, log it
    w = anneal(routing_weights(domains, [t.domain for t in teachers], T), step_i, total, n)
    opd_batch, row_ok = loss_batch(batch, cached, w)      # skips renormalised
    for _ in range(epochs):
      state, metrics = step(state, opd_batch)
  metrics |= asked.counter.metrics(pool.names) | weight_metrics(w, mask, pool.names)
"""
from opd.distill import (advantage, cache, cold_start, crosstok, crosstok_pool, diagnostics,
                         faults, gold, loss, server, source, teacher_weighting, teachers, trainer)
from opd.distill.crosstok_pool import CrossTokenizerPool, CrossTokenizerTeacher
from opd.distill.cold_start import AnswerSampling, ColdStartData, teacher_sft_pairs
from opd.distill.cache import CachedBatch, HiddenStateCache, loss_batch
from opd.distill.diagnostics import (logit_diagnostics, sample_response_positions,
                                     teacher_diagnostics)
from opd.distill.faults import (REASONS, FaultTolerantTeachers, SkipCounter, TeacherAnswers,
                                TeacherFaultError, call_with_deadline)
from opd.distill.loss import ESTIMATORS, OPDLossConfig, make_opd_loss
from opd.distill import merging, offpolicy
from opd.distill.merging import average_params, task_arithmetic, task_vectors
from opd.distill.offpolicy import OffPolicyConfig, train_offpolicy_kd
from opd.distill.teacher_weighting import (TeacherWeightingConfig, anneal, apply_availability,
                                  confidence_scores,
                                  confidence_weights, normalize, routing_weights, uniform_weights,
                                  weight_metrics)
from opd.distill.server import RemoteTeacher
from opd.distill.source import OPDConfig, OPDSource
from opd.distill.teachers import PLACEMENTS, Teacher, TeacherPool, check_teachers, row_groups
from opd.distill.trainer import OPDRun, make_heldout_eval, train_opd

__all__ = [
    "CachedBatch", "ColdStartData", "CrossTokenizerPool", "CrossTokenizerTeacher", "crosstok",
    "crosstok_pool", "gold", "ESTIMATORS", "FaultTolerantTeachers", "HiddenStateCache", "OPDConfig",
    "OPDLossConfig", "OPDRun", "OPDSource", "make_heldout_eval", "source", "train_opd", "trainer",
    "cold_start", "AnswerSampling", "teacher_sft_pairs", "merging", "offpolicy", "average_params",
    "task_arithmetic", "task_vectors", "OffPolicyConfig", "train_offpolicy_kd",
    "PLACEMENTS", "REASONS", "RemoteTeacher", "SkipCounter", "Teacher", "TeacherAnswers",
    "TeacherFaultError",
    "TeacherPool", "TeacherWeightingConfig", "advantage", "anneal", "apply_availability", "cache",
    "call_with_deadline",
    "check_teachers", "confidence_scores", "confidence_weights", "diagnostics", "faults",
    "logit_diagnostics", "loss", "loss_batch", "make_opd_loss", "normalize", "routing_weights",
    "row_groups", "sample_response_positions", "server", "teacher_diagnostics",
    "teacher_weighting", "teachers", "uniform_weights", "weight_metrics",
]
