"""Tests for opd/training/loop.py: metrics, eval, checkpoints, resume, NaN guard,
for both kinds of batch source (a plain iterator and a ``RolloutSource``).

One tiny model on one device; the compiled step is shared by every test.
(Resume across a process exit is tested in test_checkpoints.py.)
"""
import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.parallel import sharding
from opd.training.checkpoints import CheckpointManager
from opd.training.objectives import next_token_loss
from opd.models import ModelConfig
from opd.training.loop import LoopConfig, NonFiniteError, RunIO, train
from opd.training.train_step import (OptimConfig, init_train_state, make_optimizer, make_train_step)

CFG = ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64)
FAST = {"xla_backend_optimization_level": 0}
ROWS = np.random.default_rng(0).integers(0, CFG.vocab_size, (32, 17)).astype(np.int32)


class ListIterator:
  """Batches from a list, with a grain-style position; ``on_next(i)`` runs
  before batch i is handed out."""

  def __init__(self, batches, on_next=None):
    self.batches, self.i, self.on_next = batches, 0, on_next

  def __next__(self):
    if self.i >= len(self.batches):
      raise StopIteration
    if self.on_next is not None:
      self.on_next(self.i)
    self.i += 1
    return self.batches[self.i - 1]

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


def _batches(n, poison_at=None):
  out = []
  for i in range(n):
    scale = np.nan if i == poison_at else 1.0
    out.append({"tokens": ROWS[(4 * i) % 32:(4 * i) % 32 + 4],
                "scale": np.full((4,), scale, np.float32)})
  return out


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  optimizer = make_optimizer(OptimConfig(lr=1e-2))
  state, shardings = init_train_state(CFG, optimizer, mesh, rng=0, compiler_options=FAST)
  base = next_token_loss(CFG)

  def loss_fn(params, batch, rng):
    loss, metrics = base(params, batch, rng)
    return loss * batch["scale"][0], metrics

  step = make_train_step(loss_fn, optimizer, mesh, shardings, compiler_options=FAST)
  initial = jax.device_get(state)
  fresh = lambda: jax.tree.map(jax.device_put, initial, shardings)
  return dict(step=step, fresh=fresh)


def run(state, step_fn, source, num_steps, *, checkpoint_manager=None, writer=None, config=None,
        first_metrics=None, on_metrics=None, eval_fn=None, prepare_batch=None, **loop):
  """``train`` with its ``RunIO`` fields and ``LoopConfig``'s (``loop``) as
  keywords, so each test reads as one call; returns the final state."""
  io = RunIO(checkpoint_manager=checkpoint_manager, writer=writer, config=config,
             first_metrics=first_metrics, on_metrics=on_metrics, eval_fn=eval_fn)
  return train(state, step_fn, source, LoopConfig(num_steps, **loop), io,
               prepare_batch=prepare_batch).state


def _listing(root):
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      st = os.stat(os.path.join(dirpath, name))
      out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
  return out


def test_run_reports_evaluates_and_saves(setup, tmp_path):
  seen = []
  it = ListIterator(_batches(5))
  mngr = CheckpointManager(tmp_path, max_to_keep=2)
  state = run(setup["fresh"](), setup["step"], it, 5, checkpoint_manager=mngr, save_every=2,
              config={"model": CFG.to_dict()}, on_metrics=lambda s, m: seen.append((s, m)),
              eval_fn=lambda s: {"loss": jnp.float32(7.0), "norm": jnp.ones(3)}, eval_every=2,
              progress=True)
  assert int(state.step) == 5
  assert [s for s, _ in seen] == [1, 2, 3, 4, 5]
  assert all(m["finite"] == 1.0 and np.isfinite(m["loss"]) and "lr" in m for _, m in seen)
  # Eval every 2 steps and after the last one, in that step's metrics.
  evals = [(s, {k: v for k, v in m.items() if k.startswith("eval/")}) for s, m in seen]
  assert [(s, e) for s, e in evals if e] == [(2, {"eval/loss": 7.0, "eval/norm": 1.0}),
                                            (4, {"eval/loss": 7.0, "eval/norm": 1.0}),
                                            (5, {"eval/loss": 7.0, "eval/norm": 1.0})]
  # Saved at 2, 4 and after the last step; max_to_keep=2 dropped 2.
  assert mngr.all_steps() == [4, 5]
  restored = mngr.restore(state, 5)
  assert restored.data_state == {"i": 5} and restored.config["model"] == CFG.to_dict()
  # Running again to the same step count is a no-op resume.
  again = run(setup["fresh"](), setup["step"], ListIterator(_batches(5)), 5,
              checkpoint_manager=mngr, save_every=2, progress=False)
  assert int(again.step) == 5 and mngr.all_steps() == [4, 5]


@pytest.mark.parametrize("save_every,num_steps,saved", [
    (0, 5, [5]), (None, 5, [5]), (2, 5, [2, 4, 5]), (5, 5, [5]), (3, 6, [3, 6])])
def test_save_every_zero_or_none_means_only_after_the_last_step(setup, tmp_path, save_every,
                                                                num_steps, saved):
  """And eval_every reads the same way."""
  mngr = CheckpointManager(tmp_path, max_to_keep=10)
  evaluated = []
  run(setup["fresh"](), setup["step"], ListIterator(_batches(num_steps)), num_steps,
      checkpoint_manager=mngr, save_every=save_every, eval_fn=lambda s: {"x": 1.0},
      eval_every=save_every, progress=False,
      on_metrics=lambda step, m: evaluated.append(step) if "eval/x" in m else None)
  assert mngr.all_steps() == saved and evaluated == saved


def test_resume_with_grain_iterator_continues_the_data(setup, tmp_path):
  dataset = grain.MapDataset.source([{"tokens": r, "scale": np.float32(1.0)} for r in ROWS])
  dataset = dataset.shuffle(seed=5).repeat(None).batch(4)
  first, both = [], []
  mngr = CheckpointManager(tmp_path)
  it = iter(dataset)
  run(setup["fresh"](), setup["step"], it, 3, checkpoint_manager=mngr, save_every=3,
      on_metrics=lambda s, m: first.append(m["loss"]), progress=False)
  # A new iterator starts at the beginning; the checkpoint moves it to batch 3.
  run(setup["fresh"](), setup["step"], iter(dataset), 5, checkpoint_manager=mngr, save_every=5,
      on_metrics=lambda s, m: first.append(m["loss"]), progress=False)
  straight = run(setup["fresh"](), setup["step"], iter(dataset), 5, progress=False,
                 on_metrics=lambda s, m: both.append(m["loss"]))
  np.testing.assert_allclose(first, both, rtol=0, atol=1e-6)
  assert mngr.all_steps() == [3, 5] and int(straight.step) == 5


def test_nan_raises_naming_step_and_keeps_checkpoints(setup, tmp_path):
  mngr = CheckpointManager(tmp_path, max_to_keep=2)
  snapshot = {}

  def on_next(i):
    if i == 4:  # about to hand out the poisoned batch: every save so far is done
      snapshot.update(_listing(tmp_path))

  it = ListIterator(_batches(8, poison_at=4), on_next)
  # The fifth step fails: it is named as its metrics would have been (step 5).
  with pytest.raises(NonFiniteError, match=r"non-finite loss and gradients at step 5") as err:
    run(setup["fresh"](), setup["step"], it, 8, checkpoint_manager=mngr, save_every=2,
        progress=False)
  assert snapshot and mngr.all_steps() == [2, 4]
  assert _listing(tmp_path) == snapshot  # nothing written, renamed or deleted
  # The state handed back is the last good one, equal to checkpoint 4.
  bad_state = err.value.state
  assert int(bad_state.step) == 4
  restored = mngr.restore(bad_state, 4)
  for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(bad_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_exhausted_iterator_stops_and_saves(setup, tmp_path):
  mngr = CheckpointManager(tmp_path)
  state = run(setup["fresh"](), setup["step"], ListIterator(_batches(3)), 10,
              checkpoint_manager=mngr, save_every=5, progress=False)
  assert int(state.step) == 3 and mngr.all_steps() == [3]


def test_resume_needs_set_state_when_position_was_saved(setup, tmp_path):
  mngr = CheckpointManager(tmp_path)
  run(setup["fresh"](), setup["step"], ListIterator(_batches(1)), 1, checkpoint_manager=mngr,
      save_every=1, progress=False)
  with pytest.raises(ValueError, match="no set_state"):
    run(setup["fresh"](), setup["step"], iter(_batches(3)), 3, checkpoint_manager=mngr,
        save_every=1, progress=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_steps=-1), r"LoopConfig.steps must be .*, got -1"),
    (dict(num_steps=2, save_every=1), "checkpoint_manager is None"),
    (dict(num_steps=2, save_every=-1), r"LoopConfig.save_every must be .* or None, got -1"),
    (dict(num_steps=2, save_every=True), r"LoopConfig.save_every must be .* or None, got True"),
    (dict(num_steps=2, eval_every=1), "eval_fn is None"),
])
def test_run_validates_arguments(setup, kwargs, match):
  with pytest.raises(ValueError, match=match):
    run(None, setup["step"], iter([]), **kwargs)


def test_loop_config_and_run_io_refuse_bad_fields(setup, tmp_path):
  # A bare string would otherwise read as one allowance per character.
  with pytest.raises(ValueError, match=r"LoopConfig.allow_config_change .* 'train.steps'"):
    LoopConfig(3, allow_config_change="train.steps")
  with pytest.raises(ValueError, match=r"LoopConfig.keep_checkpoints must be .*, got 0"):
    LoopConfig(3, keep_checkpoints=0)
  with pytest.raises(ValueError, match="give checkpoint_dir .* or checkpoint_manager, not both"):
    RunIO(checkpoint_dir=tmp_path, checkpoint_manager=CheckpointManager(tmp_path))
  with pytest.raises(ValueError, match=r"RunIO.first_metrics must be a dict .*, got list"):
    RunIO(first_metrics=[])
  with pytest.raises(ValueError, match="loop must be a LoopConfig, got int"):
    train(setup["fresh"](), setup["step"], iter([]), 3)
  assert LoopConfig(3, save_every=None, allow_config_change=["a"]) == \
      LoopConfig(3, save_every=0, allow_config_change=("a",))


class CountingSource:
  """A ``RolloutSource``: batch k is ``_batches(n)[k]``, trained on twice.

  It records the (step, state.step) it is asked at, so the test sees that
  the loop hands it the current state and the 0-based step.
  """
  updates_per_batch = 2

  def __init__(self, n):
    self.batches, self.pos, self.asked = _batches(n), 0, []

  def next_batch(self, state, step):
    if self.pos >= len(self.batches):
      return None
    self.asked.append((step, int(state.step)))
    self.pos += 1
    return self.batches[self.pos - 1], {"source/pos": float(self.pos)}

  def step_metrics(self, host_metrics, train_metrics, *, batch_time_s, train_time_s):
    assert batch_time_s >= 0 and train_time_s > 0
    return {**host_metrics, **{f"train/{k}": v for k, v in train_metrics.items()}}

  def texts(self, step):
    return {"note": f"step {step}"}

  def get_state(self):
    return {"pos": self.pos}

  def set_state(self, state):
    self.pos = state["pos"]


class RecordingWriter:
  def __init__(self):
    self.scalars, self.texts, self.flushed = [], [], 0

  def write_scalars(self, step, scalars):
    self.scalars.append((step, dict(scalars)))

  def write_texts(self, step, texts):
    self.texts.append((step, dict(texts)))

  def flush(self):
    self.flushed += 1


def test_run_drives_a_rollout_source_and_resumes_its_position(setup, tmp_path):
  """Each step gets a batch built from the current state, takes
  ``updates_per_batch`` updates on it and reports their mean; checkpoints
  are numbered by step and restore the source's position."""
  mngr = CheckpointManager(tmp_path, max_to_keep=5)
  source, writer = CountingSource(5), RecordingWriter()
  state = run(setup["fresh"](), setup["step"], source, 3, checkpoint_manager=mngr, save_every=2,
              writer=writer, progress=False)
  assert source.asked == [(0, 0), (1, 2), (2, 4)] and int(state.step) == 6
  assert mngr.all_steps() == [2, 3]
  assert mngr.restore(state, 3).data_state == {"pos": 3}
  assert [s for s, _ in writer.scalars] == [1, 2, 3] and writer.flushed == 1
  assert writer.texts == [(s, {"note": f"step {s}"}) for s in (1, 2, 3)]
  # The reported loss is the mean of the two updates' losses, recomputed here.
  reference, losses = setup["fresh"](), []
  for _ in range(2):
    reference, m = setup["step"](reference, _batches(5)[0])
    losses.append(float(m["loss"]))
  first = writer.scalars[0][1]
  assert first["source/pos"] == 1.0
  np.testing.assert_allclose(first["train/loss"], np.mean(losses), rtol=1e-6)

  # Resume: a new source starting at 0 is moved to position 3 by the checkpoint,
  # and the run ends where an uninterrupted one does.
  resumed_source = CountingSource(5)
  resumed = run(setup["fresh"](), setup["step"], resumed_source, 5, checkpoint_manager=mngr,
                save_every=2, progress=False)
  assert resumed_source.asked == [(3, 6), (4, 8)] and mngr.all_steps() == [2, 3, 4, 5]
  straight = run(setup["fresh"](), setup["step"], CountingSource(5), 5, progress=False)
  # Same compiled step, same inputs, exact restore: bitwise equal.
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  class FourUpdates(CountingSource):
    updates_per_batch = 4

  with pytest.raises(ValueError, match="state.step=10 is not a multiple of updates_per_batch=4"):
    run(setup["fresh"](), setup["step"], FourUpdates(5), 5, checkpoint_manager=mngr,
        progress=False)


def test_a_source_missing_part_of_the_protocol_is_named(setup):
  class Half:
    updates_per_batch = 1

    def next_batch(self, state, step):
      return None

  with pytest.raises(ValueError, match=r"Half has next_batch but lacks \['step_metrics', "
                                       r"'texts', 'get_state', 'set_state'\]"):
    run(setup["fresh"](), setup["step"], Half(), 1, progress=False)


def _experiment(lr=1e-2, steps=4):
  return {"model": CFG.to_dict(), "experiment": {"optim": {"lr": lr}, "train": {"steps": steps}}}


def test_resume_compares_the_whole_config_and_names_what_differs(setup, tmp_path):
  from opd.training.loop import allowed_config_changes
  mngr = CheckpointManager(tmp_path)
  run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 2, checkpoint_manager=mngr,
      save_every=2, config=_experiment(), progress=False)
  before = _listing(tmp_path)
  # Another learning rate (outside "model") is refused, naming the field and both values.
  with pytest.raises(ValueError, match=r"experiment\.optim\.lr: checkpoint has 0\.01, now 0\.02"):
    run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 4, checkpoint_manager=mngr,
        save_every=2, config=_experiment(lr=2e-2), progress=False)
  # So is another step count, unless allowed (by its name in the experiment config).
  with pytest.raises(ValueError, match=r"experiment\.train\.steps: checkpoint has 4, now 3\. .*"
                                       r"--allow_config_change=experiment\.train\.steps"):
    run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 3, checkpoint_manager=mngr,
        save_every=2, config=_experiment(steps=3), progress=False)
  assert _listing(tmp_path) == before
  run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 3, checkpoint_manager=mngr,
      save_every=2, config=_experiment(steps=3), allow_config_change=("train.steps",),
      progress=False)
  assert mngr.all_steps() == [2, 3] and mngr.read_config(3) == _experiment(steps=3)
  with allowed_config_changes(["train"]):  # a group, as the launcher passes it
    state = run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 4,
                checkpoint_manager=mngr, save_every=2, config=_experiment(steps=4),
                progress=False)
  assert int(state.step) == 4


def test_first_metrics_come_from_the_first_step_after_a_resume(setup, tmp_path):
  mngr = CheckpointManager(tmp_path)
  first, seen = {0: {"eval/before": 5.0}}, []
  run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 2, checkpoint_manager=mngr,
      save_every=2, first_metrics=first, on_metrics=lambda s, m: seen.append(m), progress=False)
  assert first == {0: {"eval/before": 5.0}, 1: seen[0]}
  resumed = {}  # a relaunch measures nothing before training: the checkpoint has it
  run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 4, checkpoint_manager=mngr,
      save_every=2, first_metrics=resumed, progress=False)
  assert resumed == first


def test_a_corrupt_latest_checkpoint_names_the_previous_one_or_falls_back(setup, tmp_path):
  from opd.training.checkpoints import CheckpointCorruptError
  mngr = CheckpointManager(tmp_path, max_to_keep=3)
  straight = run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 4,
                 checkpoint_manager=mngr, save_every=2, progress=False)
  # Damage what step 4's checksums say about one array (tests/opd/training/
  # test_checkpoints.py flips a stored bit instead; the check is the same).
  meta_file = tmp_path / "4" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["checksums"]["params.final_norm.scale"] = "0" * 16
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(CheckpointCorruptError, match=r"\(step 4\) is corrupt: array "
                     r"params\.final_norm\.scale .* the previous checkpoint is step 2"):
    run(setup["fresh"](), setup["step"], ListIterator(_batches(6)), 6, checkpoint_manager=mngr,
        save_every=2, progress=False)
  again = run(setup["fresh"](), setup["step"], ListIterator(_batches(4)), 4,
              checkpoint_manager=mngr, save_every=2, fall_back_on_corrupt=True, progress=False)
  assert sorted(os.listdir(tmp_path)) == ["2", "4", "4.corrupt"]
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(straight.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # step 4 redone, bit for bit


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 -> inf
def test_an_overflowing_update_is_discarded_and_never_saved(tmp_path):
  """lr = 1e39 is inf in float32: the loss and gradients of the step are
  finite, the updated parameters are not. The step must discard the update
  and the loop must stop before saving it."""
  import optax
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  optimizer = optax.sgd(1e39)
  state, shardings = init_train_state(CFG, optimizer, mesh, rng=0, compiler_options=FAST)
  initial = jax.device_get(state)
  step = make_train_step(next_token_loss(CFG), optimizer, mesh, shardings, compiler_options=FAST)
  mngr = CheckpointManager(tmp_path)
  batches = [{"tokens": ROWS[:4]} for _ in range(3)]
  with pytest.raises(NonFiniteError, match="non-finite updated parameters or optimizer state at "
                                           "step 1") as err:
    run(state, step, iter(batches), 3, checkpoint_manager=mngr, save_every=1, progress=False)
  assert mngr.all_steps() == [] and os.listdir(tmp_path) == []
  assert err.value.loss_finite and err.value.grads_finite and not err.value.update_finite
  for a, b in zip(jax.tree.leaves(err.value.state), jax.tree.leaves(initial)):
    np.testing.assert_array_equal(np.asarray(a), b)  # the state from before the step


def test_keep_best_relaunch_with_save_and_eval_off_cadence(setup, tmp_path):
  """save_every=2, eval_every=5 with keep-best by eval/loss (as train_lm sets
  it up): the first run and every relaunch save cleanly."""
  kw = dict(max_to_keep=2, keep_best=1, best_metric="eval/loss")
  evals = iter([3.0, 1.0, 2.0])
  eval_fn = lambda s: {"loss": next(evals)}
  run(setup["fresh"](), setup["step"], ListIterator(_batches(12)), 6,
      checkpoint_manager=CheckpointManager(tmp_path, **kw), save_every=2, eval_fn=eval_fn,
      eval_every=5, progress=False)
  mngr = CheckpointManager(tmp_path, **kw)  # the relaunch
  run(setup["fresh"](), setup["step"], ListIterator(_batches(12)), 10, checkpoint_manager=mngr,
      save_every=2, eval_fn=eval_fn, eval_every=5, progress=False)
  # Evals: step 5 (3.0, no save there), 6 (last of run 1: 1.0), 10 (2.0).
  # Newest two: 8, 10; best evaluated save: 6.
  assert mngr.all_steps() == [6, 8, 10]
