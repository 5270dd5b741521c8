"""Tests for opd/checkpoints.py (and train_loop's resume).

Process-level behaviour (resume after exit, SIGKILL during a save) runs in
subprocesses of tests/opd/checkpoint_worker.py; the rest in-process with
states built by ``device_put`` onto the train-state shardings (no compiles).
"""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.parallel import sharding
from opd.training.checkpoints import CheckpointCorruptError, CheckpointManager, abstract_like
from opd.models import ModelConfig
from opd.training.train_step import OptimConfig, abstract_train_state, make_optimizer
from subprocess_env import device_env  # tests/ (on sys.path via conftest.py)

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "checkpoint_worker.py")
CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)


def _env():
  # The caller's XLA flags (conftest's, perturbed-tests' --xla_cpu_max_isa) reach
  # the workers too.
  return device_env(8, JAX_PLATFORMS="cpu")


def _worker(*args):
  return subprocess.Popen([sys.executable, WORKER, *args], env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=240):
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
  assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{out[-4000:]}"
  return out


def _listing(root):
  """Every file and directory under root with size and mtime."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      path = os.path.join(dirpath, name)
      st = os.stat(path)
      out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
  return out


def _random_state(cfg, mesh, seed=0):
  """A TrainState with random values, placed on the train-state shardings."""
  abstract, _ = abstract_train_state(cfg, make_optimizer(OptimConfig(weight_decay=0.1)), mesh)
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype) if
                               jnp.issubdtype(a.dtype, jnp.floating) else
                               rng.integers(0, 100, a.shape).astype(a.dtype), a.sharding), abstract)


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def test_resume_after_process_exit_equals_straight_run(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  # Process 1: 10 straight steps in a/, then (fresh state) 5 steps in b/; exits.
  _finish(_worker("train", "--runs", f"{a}:10,{b}:5", "--save-every", "5",
                  "--out", str(tmp_path / "p1_")))
  assert CheckpointManager(b).all_steps() == [5]
  # Process 2: resumes b/ from step 5 (state and data position) up to 10.
  _finish(_worker("train", "--runs", f"{b}:10", "--save-every", "5",
                  "--out", str(tmp_path / "p2_")))
  s, first = np.load(tmp_path / "p1_0.npz"), np.load(tmp_path / "p1_1.npz")
  second = np.load(tmp_path / "p2_0.npz")
  assert s["steps"].tolist() == list(range(1, 11))
  assert first["steps"].tolist() == list(range(1, 6))
  assert second["steps"].tolist() == list(range(6, 11))
  # Same batches after the resume (the grain iterator position was restored) ...
  np.testing.assert_array_equal(np.concatenate([first["checksums"], second["checksums"]]),
                                s["checksums"])
  assert len(set(s["checksums"][:3].tolist())) == 3  # shuffled batches really differ
  # ... hence the same losses and final parameters, bit for bit: both
  # processes compile the same step with the same flags on the same machine
  # and feed it the restored state and the same batches (docs/DEVELOPING.md,
  # "Choosing tolerances": things that are exact stay exact).
  np.testing.assert_array_equal(np.concatenate([first["losses"], second["losses"]]),
                                s["losses"])
  names = [k for k in s.files if k.startswith("[")]
  assert names and int(second["final_step"]) == int(s["final_step"]) == 10
  for name in names:
    np.testing.assert_array_equal(second[name], s[name], err_msg=name)
  # The resumed run did not start over: its params differ from the 5-step ones.
  assert max(np.max(np.abs(second[n] - first[n])) for n in names) > 1e-4
  assert CheckpointManager(b).all_steps() == [5, 10]


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
  ckpt, marker = tmp_path / "ckpt", tmp_path / "in_flight"
  proc = _worker("kill", "--ckpt", str(ckpt), "--marker", str(marker))
  deadline = time.time() + 180
  while not marker.exists():
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      pytest.fail(f"worker never reached the commit of step 2:\n{proc.communicate()[0][-4000:]}")
    time.sleep(0.05)
  time.sleep(0.1)  # let the marker's writer return into its sleep
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL

  # It really died mid-save: step 2's data sits in an uncommitted tmp directory.
  names = sorted(os.listdir(ckpt))
  assert "2" not in names and "2.orbax-checkpoint-tmp" in names, names
  tmp_files = _listing(ckpt / "2.orbax-checkpoint-tmp")
  assert sum(size for size, _ in tmp_files.values()) > 1_000_000  # the 32 MiB array was written

  mngr = CheckpointManager(ckpt)
  assert mngr.all_steps() == [1]
  device = jax.devices()[0]
  small = np.arange(1024, dtype=np.float32) * 2  # what the worker saved as step 1
  target = {"w": jax.ShapeDtypeStruct(small.shape, jnp.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(device))}
  restored = mngr.restore(target)
  assert restored.step == 1
  np.testing.assert_array_equal(np.asarray(restored.state["w"]), small)

  # A new save of step 2 replaces the stale tmp directory and commits.
  mngr.save(2, {"w": jnp.asarray(small * 5)})
  assert sorted(os.listdir(ckpt)) == ["1", "2"]
  np.testing.assert_array_equal(np.asarray(mngr.restore(target, 1).state["w"]), small)


def test_restore_onto_a_different_mesh(tmp_path):
  state = _random_state(CFG, sharding.make_mesh((2, 2, 2)))
  mngr = CheckpointManager(tmp_path)
  mngr.save(3, state, data_state={"next_index": 7}, config={"model": CFG.to_dict()})
  target, shardings = abstract_train_state(CFG, make_optimizer(OptimConfig(weight_decay=0.1)),
                                           sharding.make_mesh((1, 4, 2)))
  restored = mngr.restore(target, expected_config={"model": CFG.to_dict()})
  assert restored.step == 3 and restored.data_state == {"next_index": 7}
  assert restored.config["model"] == CFG.to_dict()
  for got, want, shard in zip(jax.tree.leaves(restored.state), jax.tree.leaves(_host(state)),
                              jax.tree.leaves(shardings)):
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.sharding == shard
  emb = restored.state.params["embedding"]
  assert emb.sharding.shard_shape(emb.shape) == (128, 16)  # vocab/tensor=2, embed/fsdp=4


def test_other_architecture_is_refused_by_name(tmp_path):
  mesh = sharding.make_mesh((2, 2, 2))
  mngr = CheckpointManager(tmp_path)
  mngr.save(1, _random_state(CFG, mesh), config={"model": CFG.to_dict()})
  other = CFG.replace(d_ff=256)
  target, _ = abstract_train_state(other, make_optimizer(OptimConfig(weight_decay=0.1)), mesh)
  with pytest.raises(ValueError, match=r"model\.d_ff: checkpoint has 128, expected 256"):
    mngr.restore(target, expected_config={"model": other.to_dict()})
  # Without a config to compare, the shape check still names the parameter.
  with pytest.raises(ValueError, match=r"params\.layers_0\.mlp\.down has shape \(128, 64\) in the "
                     r"checkpoint but \(256, 64\)"):
    mngr.restore(target)


def test_corrupted_checkpoint_raises_naming_path_and_deletes_nothing(tmp_path):
  mngr = CheckpointManager(tmp_path)
  device = jax.devices()[0]
  values = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
  mngr.save(1, {"w": jax.device_put(values, device)})
  mngr.save(2, {"w": jax.device_put(values * 2, device)})
  # Garble every data file of step 2 (keep the sizes: flip the bytes).
  garbled = 0
  for dirpath, _, files in os.walk(tmp_path / "2" / "state"):
    for name in files:
      path = os.path.join(dirpath, name)
      if os.path.basename(dirpath) == "d":
        data = bytearray(open(path, "rb").read())
        open(path, "wb").write(bytes(b ^ 0xFF for b in data))
        garbled += 1
  assert garbled
  before = _listing(tmp_path)
  target = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(device))}
  with pytest.raises(CheckpointCorruptError, match=str(tmp_path / "2")):
    CheckpointManager(tmp_path).restore(target)
  assert _listing(tmp_path) == before
  # The older checkpoint is still fine.
  older = CheckpointManager(tmp_path).restore(target, 1).state["w"]
  np.testing.assert_array_equal(np.asarray(older), values)


def test_keep_last_n_and_best(tmp_path):
  losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0, 6: 2.0}
  mngr = CheckpointManager(tmp_path, max_to_keep=2, keep_best=2, best_metric="loss",
                           best_mode="min")
  x = {"w": jnp.zeros(4)}
  for step, loss in losses.items():
    mngr.save(step, x, metrics={"loss": loss})
  latest = sorted(losses)[-2:]
  best = sorted(losses, key=losses.get)[:2]
  assert mngr.all_steps() == sorted(set(latest) | set(best)) == [2, 5, 6]
  assert sorted(os.listdir(tmp_path)) == ["2", "5", "6"]


def test_save_refuses_to_overwrite_and_validates(tmp_path):
  mngr = CheckpointManager(tmp_path)
  mngr.save(1, {"w": jnp.ones(3)}, data_state={"i": 1})
  before = _listing(tmp_path)
  with pytest.raises(ValueError, match="step 1 already exists"):
    mngr.save(1, {"w": jnp.zeros(3)})
  assert _listing(tmp_path) == before
  with pytest.raises(ValueError, match="data_state is not JSON"):
    mngr.save(2, {"w": jnp.ones(3)}, data_state={"x": object()})
  with pytest.raises(ValueError, match="best_mode"):
    CheckpointManager(tmp_path, best_mode="lowest")
  with pytest.raises(FileNotFoundError, match="step 7"):
    mngr.restore(abstract_like({"w": jnp.ones(3)}), 7)


def test_async_save_commits_after_wait(tmp_path):
  mngr = CheckpointManager(tmp_path, async_save=True)
  values = np.arange(4096, dtype=np.float32)
  mngr.save(1, {"w": jnp.asarray(values)}, data_state={"pos": 3})
  mngr.wait()
  assert sorted(os.listdir(tmp_path)) == ["1"]
  restored = CheckpointManager(tmp_path).restore(abstract_like({"w": jnp.asarray(values)}))
  np.testing.assert_array_equal(np.asarray(restored.state["w"]), values)
  assert restored.data_state == {"pos": 3}


def _random_bits(rng, shape):
  """float32 arrays of uniformly random bit patterns: incompressible, so the
  checkpoint stores their bytes as they are and a test can find them."""
  return rng.integers(0, 2 ** 32, shape, dtype=np.uint32).view(np.float32)


def _flip_bit_of(root, array, byte=700, bit=4):
  """Flips one bit of ``array``'s bytes where the checkpoint under ``root`` stores them."""
  needle = np.asarray(array).tobytes()[byte:byte + 64]
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      data = bytearray(open(path, "rb").read())
      at = data.find(needle)
      if at >= 0:
        data[at] ^= 1 << bit
        open(path, "wb").write(bytes(data))
        return path
  raise AssertionError(f"the bytes of the array are nowhere under {root}")


def test_a_flipped_bit_is_detected_naming_step_and_array(tmp_path):
  """Orbax reads a flipped bit in a stored array back without complaint (the
  issue's Adam second moment at 6.4e29); the checksums saved with the step catch it."""
  rng = np.random.default_rng(0)
  device = jax.devices()[0]
  state = {"params": {"w": jax.device_put(_random_bits(rng, (64, 64)), device)},
           "opt": {"nu": jax.device_put(_random_bits(rng, (64, 64)), device)}}
  mngr = CheckpointManager(tmp_path)
  mngr.save(1, state)
  mngr.save(2, state)
  _flip_bit_of(tmp_path / "2", state["opt"]["nu"])
  before = _listing(tmp_path)
  with pytest.raises(CheckpointCorruptError) as err:
    CheckpointManager(tmp_path).restore(abstract_like(state))
  message = str(err.value)
  assert f"checkpoint {tmp_path / '2'} (step 2) is corrupt: array opt.nu" in message
  assert f"the previous checkpoint is step 1 ({tmp_path / '1'})" in message
  assert (err.value.step, err.value.leaf, err.value.previous) == (2, "opt.nu", 1)
  assert _listing(tmp_path) == before  # nothing deleted or moved by restoring
  # The previous step is intact, and quarantine makes it the latest.
  older = CheckpointManager(tmp_path).restore(abstract_like(state), 1).state
  np.testing.assert_array_equal(np.asarray(older["opt"]["nu"]), np.asarray(state["opt"]["nu"]))
  mngr = CheckpointManager(tmp_path)
  assert mngr.quarantine(2) == str(tmp_path / "2.corrupt")
  assert mngr.all_steps() == [1] and CheckpointManager(tmp_path).latest_step() == 1


def test_checksums_do_not_depend_on_the_mesh_and_see_every_single_bit():
  from opd.training.integrity import leaf_checksum, tree_checksums
  rng = np.random.default_rng(1)
  values = rng.standard_normal((8, 6)).astype(np.float32)
  one = jax.device_put(values, jax.devices()[0])
  mesh = sharding.make_mesh((2, 2, 2))
  spread = jax.device_put(values, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      ("data", "fsdp"), "tensor")))
  assert tree_checksums({"x": one}) == tree_checksums({"x": spread})
  # Every one of the 8 * 6 * 32 single-bit flips changes the checksum.
  base = tree_checksums({"x": one})["x"]
  bits = values.view(np.uint32)
  flipped = np.repeat(bits[None], bits.size * 32, axis=0).reshape(bits.size * 32, -1)
  idx = np.arange(bits.size * 32)
  flipped[idx, idx // 32] ^= (np.uint32(1) << (idx % 32).astype(np.uint32))
  words = np.asarray(jax.jit(jax.vmap(leaf_checksum))(
      flipped.view(np.float32).reshape((-1,) + values.shape)))
  sums = {f"{int(a):08x}{int(b):08x}" for a, b in words}
  assert base not in sums


def test_save_refuses_a_step_another_manager_committed(tmp_path):
  """The existence check reads the disk, not the manager's list: a second
  manager opened before the first one's save must not overwrite it."""
  first, second = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
  first.save(1, {"w": jnp.ones(3)})
  before = _listing(tmp_path)
  with pytest.raises(ValueError, match=f"checkpoint step 1 already exists at {tmp_path / '1'}"):
    second.save(1, {"w": jnp.zeros(3)})
  assert _listing(tmp_path) == before
  np.testing.assert_array_equal(
      np.asarray(CheckpointManager(tmp_path).restore(abstract_like({"w": jnp.ones(3)})).state["w"]),
      np.ones(3))


def test_keep_best_with_saves_that_have_no_eval_metric(tmp_path):
  """save_every=2, eval_every=5: most saves carry no eval/loss. They are kept
  by max_to_keep only, the best evaluated one by keep_best, and a relaunch
  (a new manager reading the directory) keeps working."""
  evals = {10: 3.0, 20: 1.0}
  kw = dict(max_to_keep=2, keep_best=1, best_metric="eval/loss", best_mode="min")
  mngr = CheckpointManager(tmp_path, **kw)
  x = {"w": jnp.zeros(2)}
  metrics = lambda step: {"loss": 1.0, **({"eval/loss": evals[step]} if step in evals else {})}
  for step in range(2, 16, 2):
    mngr.save(step, x, metrics=metrics(step))
  assert mngr.all_steps() == [10, 12, 14]
  mngr = CheckpointManager(tmp_path, **kw)  # the relaunch
  for step in range(16, 24, 2):
    mngr.save(step, x, metrics=metrics(step))
  assert mngr.all_steps() == [20, 22]  # step 20 is both the best and among the newest


def test_checksum_first_word_is_the_documented_sum():
  """Word 0 is sum_i bits_i * (2i + 1) mod 2**32 over the row-major elements,
  recomputed here in numpy (uint64, exact before the final reduction)."""
  from opd.training.integrity import leaf_checksum
  rng = np.random.default_rng(2)
  for x in (rng.standard_normal((3, 5, 7)).astype(np.float32), np.float32(2.5),
            rng.integers(0, 2 ** 31, (4, 9), dtype=np.int32)):
    bits = np.asarray(x).view(np.uint32).reshape(-1).astype(np.uint64)
    idx = np.arange(bits.size, dtype=np.uint64)
    want = int(np.sum((bits * (2 * idx + 1)) % 2 ** 32) % 2 ** 32)
    assert int(leaf_checksum(jnp.asarray(x))[0]) == want


def test_load_params_verifies_the_checksums_of_the_params(tmp_path):
  from opd.training.checkpoints import load_params
  mesh = sharding.make_mesh((2, 2, 2))
  CheckpointManager(tmp_path).save(1, _random_state(CFG, mesh), config={"model": CFG.to_dict()})
  assert jax.tree.structure(load_params(tmp_path, CFG)) is not None  # intact: loads
  # What the checksum record says about one parameter no longer matches it
  # (test_a_flipped_bit_... damages the stored bytes instead; the check is the same).
  meta_file = tmp_path / "1" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["checksums"]["params.embedding"] = "0" * 16
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(CheckpointCorruptError, match=r"\(step 1\) is corrupt: array params\.embedding"):
    load_params(tmp_path, CFG)


def test_load_params_of_a_checkpoint_older_than_a_model_field(tmp_path):
  """A checkpoint written before ModelConfig gained ``v4`` / ``tokenizer`` loads
  into a config holding them at their defaults ("off": what it was), and is
  refused, naming the field, when the config sets them otherwise."""
  from opd.training.checkpoints import load_params
  mesh = sharding.make_mesh((2, 2, 2))
  old = {k: v for k, v in CFG.to_dict().items() if k not in ("v4", "tokenizer")}
  state = _random_state(CFG, mesh)
  CheckpointManager(tmp_path).save(1, state, config={"model": old})
  got = load_params(tmp_path, CFG)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(_host(state.params))):
    np.testing.assert_array_equal(np.asarray(a), b)
  with pytest.raises(ValueError, match=r"model\.tokenizer: checkpoint has 'byte', expected "
                                       r"'bpe:300'"):
    load_params(tmp_path, CFG.replace(tokenizer="bpe:300", vocab_size=max(300, CFG.vocab_size)))
