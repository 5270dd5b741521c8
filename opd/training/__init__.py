"""Training: the sharded step, optimizer, the one host loop, objectives, checkpoints, metrics, data.

Every trainer (pre-training, SFT, GRPO, distillation) is a loss function and
a batch source composed into ``opd.training.loop.train`` (with a ``LoopConfig``
and a ``RunIO``).
"""
from opd.training import checkpoints, data, loop, objectives
from opd.training.checkpoints import (CheckpointCorruptError, CheckpointManager, Restored,
                                      abstract_like, load_params)
from opd.training.data import lm_dataset, sft_dataset
from opd.training.lm_trainer import LMTrainConfig, evaluate_loss, train_lm
from opd.training.loop import RolloutSource, TrainRun, resume, train
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.metrics_writer import METRICS_FILE, MetricWriter, histogram_proto, read_metrics
from opd.training.objectives import lm_loss, next_token_loss
from opd.training.optim import OptimConfig, Optimizer, make_optimizer, make_schedule
from opd.training.train_step import (RESERVED_METRICS, LossFn, NonFiniteError, TrainState,
                                     abstract_train_state, init_train_state, make_train_step,
                                     raise_if_nonfinite, shard_batch)
