"""Multi-teacher on-policy distillation: model family, sampler, sharded training, OPD."""
