"""Early stopping in opd/training/loop.py (``LoopConfig.early_stop_*``, opd/training/early_stop.py).

The eval values are a hand-written sequence (``EVALS``); the step each rule
stops at is worked out in the comments, eval by eval. One tiny model on one
device; the compiled step is shared by every test.
"""
import logging

import jax
import numpy as np
import pytest

from opd.models import ModelConfig
from opd.parallel import sharding
from opd.training.checkpoints import CheckpointManager
from opd.training.loop import LoopConfig, RunIO, train
from opd.training.objectives import next_token_loss
from opd.training.train_step import OptimConfig, init_train_state, make_optimizer, make_train_step

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32)
FAST = {"xla_backend_optimization_level": 0}
ROWS = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 9)).astype(np.int32)

# eval/loss at the 1st, 2nd, ... eval. With mode "min", min_delta 0.12, patience 3:
#   #1 5.00 best            #2 4.00 best (gain 1.0)
#   #3 3.95 gain .05 bad 1  #4 3.90 gain .10 bad 2   (below min_delta: not improvements)
#   #5 3.85 gain .15 best   (measured from the best 4.00, not from #4: a rule that
#                            compared with the previous eval would stop here)
#   #6 3.84 bad 1  #7 3.83 bad 2  #8 3.90 bad 3 -> stop after the 8th eval.
# The tail would let a tracker that forgot its state on resume (best from #6
# on: #6 best, #7 .01 bad 1, #8 bad 2, #9 bad 3) stop one eval later.
EVALS = [5.0, 4.0, 3.95, 3.90, 3.85, 3.84, 3.83, 3.90, 3.95, 3.99, 4.0, 4.1]
RULE = dict(early_stop_metric="eval/loss", early_stop_patience=3, early_stop_min_delta=0.12)
EVAL_EVERY = 2
STOP_STEP = 8 * EVAL_EVERY  # the 8th eval


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  optimizer = make_optimizer(OptimConfig(lr=1e-2))
  state, shardings = init_train_state(CFG, optimizer, mesh, rng=0, compiler_options=FAST)
  step = make_train_step(next_token_loss(CFG), optimizer, mesh, shardings,
                         compiler_options=FAST)
  initial = jax.device_get(state)
  return dict(step=step, fresh=lambda: jax.tree.map(jax.device_put, initial, shardings))


class Batches:
  """The same batch forever, with a position the checkpoints carry."""

  def __init__(self):
    self.i = 0

  def __next__(self):
    self.i += 1
    return {"tokens": ROWS}

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


def _evals(values, start=0):
  """``eval_fn`` handing out ``values[start]``, ``values[start + 1]``, ... (calls recorded)."""
  calls = []

  def eval_fn(params):
    calls.append(start + len(calls))
    return {"loss": values[start + len(calls) - 1]}

  eval_fn.calls = calls
  return eval_fn


def _train(setup, steps, eval_fn, manager=None, **rule):
  loop = LoopConfig(steps, eval_every=EVAL_EVERY, save_every=100 if manager else 0,
                    progress=False, **rule)
  return train(setup["fresh"](), setup["step"], Batches(), loop,
               RunIO(checkpoint_manager=manager, eval_fn=eval_fn))


def test_stops_after_patience_evals_without_a_min_delta_improvement(setup, tmp_path, caplog):
  manager = CheckpointManager(tmp_path, max_to_keep=3)
  eval_fn = _evals(EVALS)
  with caplog.at_level(logging.WARNING, logger="opd.training.loop"):
    run = _train(setup, 30, eval_fn, manager, **RULE)
  assert len(run.history) == STOP_STEP and int(run.state.step) == STOP_STEP
  assert len(eval_fn.calls) == 8
  # A final checkpoint of the stopping step (save_every=100 would not save it).
  assert manager.all_steps() == [STOP_STEP]
  assert (f"early stop after step {STOP_STEP}: eval/loss has not improved by >= 0.12 (min) "
          f"for 3 evals (patience 3); best 3.85 at step {5 * EVAL_EVERY}") in caplog.text


def test_mode_max_reads_the_same_sequence_mirrored(setup):
  # -values with "max" is the same walk as values with "min": the same stop.
  run = _train(setup, 30, _evals([-v for v in EVALS]), early_stop_mode="max", **RULE)
  assert len(run.history) == STOP_STEP
  # Patience 1, no min_delta: #3 (3.95 < 4.00) improves, so does every eval
  # until #8 (3.90 > 3.83), the first not below the best: stop after #8 too;
  # patience 4 would need #9-#11 as well: #8..#11 bad -> stop after #11.
  assert len(_train(setup, 30, _evals(EVALS), early_stop_metric="eval/loss").history) == 16
  assert len(_train(setup, 30, _evals(EVALS), early_stop_metric="eval/loss",
                    early_stop_patience=4).history) == 11 * EVAL_EVERY


def test_a_resumed_run_stops_where_the_straight_run_does(setup, tmp_path):
  manager = CheckpointManager(tmp_path, max_to_keep=3)
  # 5 evals (steps 2..10), no stop yet; the relaunch to 30 steps continues
  # from the 6th eval value with the restored best / bad count.
  first = _train(setup, 10, _evals(EVALS), manager, **RULE)
  assert len(first.history) == 10 and manager.all_steps() == [10]
  resumed = _train(setup, 30, _evals(EVALS, start=5), manager, **RULE)
  assert len(resumed.history) == STOP_STEP - 10 and int(resumed.state.step) == STOP_STEP
  assert manager.all_steps() == [10, STOP_STEP]


def test_a_stopped_run_relaunched_trains_no_further_unless_the_rule_is_off(setup, tmp_path,
                                                                           caplog):
  manager = CheckpointManager(tmp_path, max_to_keep=3)
  _train(setup, 30, _evals(EVALS), manager, **RULE)
  again = _evals(EVALS, start=8)
  with caplog.at_level(logging.WARNING, logger="opd.training.loop"):
    relaunched = _train(setup, 30, again, manager, **RULE)
  assert relaunched.history == [] and int(relaunched.state.step) == STOP_STEP
  assert again.calls == [] and manager.all_steps() == [STOP_STEP]
  assert "a relaunch with the same rule trains no further" in caplog.text
  # Early stopping off: the run goes on to its 30 steps.
  off = _train(setup, 30, _evals(EVALS * 3), manager)
  assert len(off.history) == 30 - STOP_STEP and int(off.state.step) == 30


def test_a_target_stops_at_the_first_eval_that_reaches_it(setup, tmp_path, caplog):
  # Target 3.9 alone (patience None): #4 (3.90 <= 3.9) is the first eval at or
  # below it -> stop after the 4th eval. Mode "max" on -values with target -3.9
  # is the same walk.
  target_only = dict(early_stop_metric="eval/loss", early_stop_patience=None,
                     early_stop_target=3.9)
  manager = CheckpointManager(tmp_path, max_to_keep=3)
  with caplog.at_level(logging.WARNING, logger="opd.training.loop"):
    run = _train(setup, 30, _evals(EVALS), manager, **target_only)
  assert len(run.history) == 4 * EVAL_EVERY and manager.all_steps() == [4 * EVAL_EVERY]
  assert (f"early stop after step {4 * EVAL_EVERY}: eval/loss = 3.9 reached the target 3.9 "
          "(min)") in caplog.text
  assert len(_train(setup, 30, _evals([-v for v in EVALS]), early_stop_mode="max",
                    **{**target_only, "early_stop_target": -3.9}).history) == 4 * EVAL_EVERY
  # With the patience rule as well, whichever comes first: target 3.84 is
  # reached at #6, before the patience rule's stop after #8; target 3.5 is
  # never reached, so the patience rule stops after #8.
  assert len(_train(setup, 30, _evals(EVALS), early_stop_target=3.84,
                    **RULE).history) == 6 * EVAL_EVERY
  assert len(_train(setup, 30, _evals(EVALS), early_stop_target=3.5,
                    **RULE).history) == STOP_STEP
  # Relaunched with the same rule, the stopped run trains no further; with
  # another target the rule starts afresh: 3.83 is first reached at the
  # relaunch's 3rd eval (values from #5 on: 3.85, 3.84, 3.83).
  again = _evals(EVALS, start=4)
  assert _train(setup, 30, again, manager, **target_only).history == [] and again.calls == []
  moved = _train(setup, 30, _evals(EVALS, start=4), manager,
                 **{**target_only, "early_stop_target": 3.83})
  assert len(moved.history) == 3 * EVAL_EVERY and int(moved.state.step) == 7 * EVAL_EVERY


def test_a_missing_metric_names_the_ones_the_eval_has(setup):
  with pytest.raises(ValueError, match=r"early_stop_metric='eval/acc' is not among the eval "
                                       r"metrics at step 2: \['eval/loss'\]"):
    _train(setup, 4, _evals(EVALS), early_stop_metric="eval/acc")


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(early_stop_metric="loss", eval_every=2), r"early_stop_metric='loss': expected an eval "
                                                   r"metric .* 'eval/loss'"),
    (dict(early_stop_metric="eval/loss"), r"early_stop_metric='eval/loss' needs eval_every > 0"),
    (dict(early_stop_mode="lowest"), r"LoopConfig.early_stop_mode must be one of \('min', "
                                     r"'max'\), got 'lowest'"),
    (dict(early_stop_patience=0), r"LoopConfig.early_stop_patience"),
    (dict(early_stop_min_delta=-0.1), r"LoopConfig.early_stop_min_delta"),
    (dict(early_stop_target=float("nan")), r"LoopConfig.early_stop_target"),
    (dict(early_stop_metric="eval/loss", eval_every=2, early_stop_patience=None),
     r"early_stop_metric='eval/loss' has no rule to stop on: early_stop_patience=None and "
     r"early_stop_target=None"),
])
def test_loop_config_refuses_bad_early_stop_fields(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    LoopConfig(10, **kwargs)
