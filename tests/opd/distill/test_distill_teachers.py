"""Teacher and TeacherPool: hidden states, placement on 8 fake devices, routing, errors."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from opd.distill import Teacher, TeacherPool, check_teachers
from opd.models import ModelConfig, forward, head_matrix, hf
from opd.parallel import sharding
from opd.training.checkpoints import CheckpointManager

EPS32 = np.finfo(np.float32).eps
V, B, T = 96, 4, 10
NARROW = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
WIDE = ModelConfig(vocab_size=V, d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=96)


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[2, 7:] = False
  teachers = [Teacher.random("math_t", NARROW, 1, domain="math"),
              Teacher.random("code_t", WIDE, 2, domain="code")]
  return tokens, mask, teachers


def _check_against_logits(t, hidden, tokens, mask):
  """Last hidden states are what the LM head turns into the model's logits."""
  logits = forward(t.cfg, t.params, jnp.asarray(tokens), None, jnp.asarray(mask)).logits
  rebuilt = np.asarray(hidden, np.float64) @ np.asarray(t.head, np.float64)
  # A D_k-term dot product in float32: eps x D_k x |h| |W| per logit.
  tol = 4 * EPS32 * t.cfg.d_model * np.abs(hidden).max() * float(jnp.abs(t.head).max())
  np.testing.assert_allclose(rebuilt[mask], np.asarray(logits)[mask], rtol=0, atol=tol)


def test_colocated_pool_on_222_mesh_returns_sharded_hidden_states(data):
  tokens, mask, teachers = data
  mesh = sharding.make_mesh((2, 2, 2))
  pool = TeacherPool(teachers, V, mesh)
  out = pool.hidden_states(tokens, mask)
  assert list(out) == ["math_t", "code_t"]
  for t in teachers:
    h = out[t.name]
    assert h.shape == (B, T, t.cfg.d_model)  # each teacher its own width and depth
    assert h.sharding.is_equivalent_to(sharding.batch_sharding(mesh, ndim=3), 3)
    _check_against_logits(t, np.asarray(h), tokens, mask)
  # Params are sharded with the model's rules (the MLP over `tensor`), not replicated.
  up = pool._params["code_t"]["layers_0"]["mlp"]["up"]
  assert not up.sharding.is_fully_replicated
  assert pool.forward_count == {"math_t": 1, "code_t": 1}
  assert [w.shape for w in pool.heads] == [(32, V), (48, V)]


def test_disaggregated_pool_moves_hidden_states_to_the_student_devices(data):
  tokens, mask, teachers = data
  devices = jax.devices()
  student = sharding.make_mesh((2, 2, 1), devices[:4])
  teacher = sharding.make_mesh((1, 2, 2), devices[4:])
  pool = TeacherPool(teachers, V, student, placement="disaggregated", teacher_mesh=teacher)
  assert set(pool._params["math_t"]["embedding"].devices()) <= set(devices[4:])
  out = pool.hidden_states(tokens, mask)
  reference = TeacherPool(teachers, V, sharding.make_mesh((1, 1, 1), devices[:1]))
  for t in teachers:
    h = out[t.name]
    assert set(h.devices()) == set(devices[:4])
    assert h.sharding.is_equivalent_to(sharding.batch_sharding(student, ndim=3), 3)
    ref = np.asarray(reference.hidden_one(t.name, tokens, mask))
    # Different meshes reorder the D-contractions: a few eps of |h| per layer.
    np.testing.assert_allclose(np.asarray(h), ref, rtol=0,
                               atol=16 * t.cfg.n_layers * t.cfg.d_model * EPS32 * np.abs(ref).max())


def test_disaggregated_needs_disjoint_devices(data):
  _, _, teachers = data
  devices = jax.devices()
  with pytest.raises(ValueError, match="shares 2 devices"):
    TeacherPool(teachers, V, sharding.make_mesh((4, 1, 1), devices[:4]),
                placement="disaggregated", teacher_mesh=sharding.make_mesh((2, 1, 1), devices[2:4]))
  with pytest.raises(ValueError, match="placement='remote'"):
    TeacherPool(teachers, V, sharding.make_mesh((1, 1, 1), devices[:1]), placement="remote")


def test_routed_batching_runs_each_teacher_on_its_rows_only(data, monkeypatch):
  tokens, mask, teachers = data
  mesh = sharding.make_mesh((2, 1, 1), jax.devices()[:2])
  pool = TeacherPool(teachers, V, mesh)
  full = {n: np.asarray(h) for n, h in pool.hidden_states(tokens, mask).items()}
  seen = {}
  inner = pool._forward

  def spy(name, tok, m):
    seen[name] = np.asarray(tok)
    return inner(name, tok, m)

  monkeypatch.setattr(pool, "_forward", spy)
  rows = np.array([1, 0, 1, 1])  # teacher index per row
  out = pool.hidden_routed(tokens, mask, rows)
  for k, t in enumerate(teachers):
    mine = np.flatnonzero(rows == k)
    # Its group, padded to the 2 batch shards by repeating the group's first row.
    padded = np.concatenate([mine, np.full(-mine.size % 2, mine[0])])
    np.testing.assert_array_equal(seen[t.name], tokens[padded])
    h = np.asarray(out[t.name])
    np.testing.assert_array_equal(h[rows != k], 0.0)
    tol = 16 * t.cfg.n_layers * t.cfg.d_model * EPS32 * np.abs(full[t.name]).max()
    real = mask[mine]
    np.testing.assert_allclose(h[mine][real], full[t.name][mine][real], rtol=0, atol=tol)


def test_pool_errors_name_the_field(data):
  _, _, teachers = data
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  with pytest.raises(ValueError, match="teachers=\\[\\]"):
    TeacherPool([], V, mesh)
  with pytest.raises(ValueError, match="'math_t' has vocab_size=96 but the student has "
                                       "vocab_size=100"):
    check_teachers(teachers, 100)
  with pytest.raises(ValueError, match="unique"):
    check_teachers([teachers[0], teachers[0]], V)
  with pytest.raises(ValueError, match="teacher='nope' is not in the pool"):
    TeacherPool(teachers, V, mesh).teacher("nope")
  with pytest.raises(ValueError, match="teacher_of_row must lie in \\[0, K=2\\)"):
    TeacherPool(teachers, V, mesh).hidden_routed(np.zeros((2, 3)), np.ones((2, 3)), [0, 2])
  with pytest.raises(ValueError, match="'x': params .* is not a model parameter tree"):
    Teacher("x", NARROW, {"not": "a model"})


def test_teacher_from_checkpoint_round_trip_and_not_a_model(data, tmp_path):
  _, _, teachers = data
  t = teachers[1]
  good = tmp_path / "good"
  with CheckpointManager(good) as mngr:
    mngr.save(3, {"params": t.params}, config={"model": t.cfg.to_dict()})
  loaded = Teacher.from_checkpoint("code_t", good, WIDE, domain="code")
  for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(t.params)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(loaded.head, head_matrix(WIDE, t.params))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match=f"directory='{empty}' is not a model checkpoint"):
    Teacher.from_checkpoint("x", empty, WIDE)
  no_model = tmp_path / "no_model"
  with CheckpointManager(no_model) as mngr:
    mngr.save(1, {"params": t.params}, config={"optim": {"lr": 1.0}})
  with pytest.raises(ValueError, match="no 'model' entry"):
    Teacher.from_checkpoint("x", no_model, WIDE)
  with pytest.raises(ValueError, match="does not exist"):
    Teacher.from_checkpoint("x", tmp_path / "missing", WIDE)


def test_teacher_from_hf_safetensors(data, tmp_path):
  _, _, teachers = data
  t = teachers[0]
  hf.save_hf(str(tmp_path / "hf"), t.cfg, t.params)
  loaded = Teacher.from_hf("math_t", str(tmp_path / "hf"), domain="math", config=NARROW)
  assert loaded.cfg == NARROW and loaded.domain == "math"
  for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(t.params)):
    np.testing.assert_array_equal(a, b)  # float32 on disk: bit-exact
  with pytest.raises(ValueError, match="d_model"):
    Teacher.from_hf("x", str(tmp_path / "hf"), config=WIDE)


def test_a_teacher_whose_params_do_not_match_its_config_is_refused_at_load(data, tmp_path):
  """A WIDE teacher's params under the NARROW config used to be accepted and
  then skipped as a fault on every batch: now refused, naming the teacher,
  the parameter path and both shapes. Loaded from files, a non-finite value
  is refused too (naming the path)."""
  _, _, teachers = data
  wide = teachers[1]
  one_narrow_layer = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                 d_ff=96)
  with pytest.raises(ValueError, match=r"teacher 'x': parameter embedding has shape \(96, 48\), "
                                       r"but its config .* expects \(96, 32\)"):
    Teacher("x", one_narrow_layer, wide.params)
  with pytest.raises(ValueError, match=r"teacher 'x': .*missing \['layers_1/attn/k', "):
    Teacher("x", NARROW, wide.params)  # two layers in the config, one in the params
  no_mlp = {**wide.params, "layers_0": {k: v for k, v in wide.params["layers_0"].items()
                                        if k != "mlp"}}
  with pytest.raises(ValueError, match=r"teacher 'x': .*missing \['layers_0/mlp/down', "
                                       r"'layers_0/mlp/gate', 'layers_0/mlp/up'\]"):
    Teacher("x", WIDE, no_mlp)
  up = np.array(wide.params["layers_0"]["mlp"]["up"])
  up[3, 7] = np.inf
  bad = {**wide.params, "layers_0": {**wide.params["layers_0"],
                                     "mlp": {**wide.params["layers_0"]["mlp"], "up": up}}}
  Teacher("in_memory", WIDE, bad)  # built in code: a run-time fault (opd.distill.faults)
  with CheckpointManager(tmp_path / "bad") as mngr:
    mngr.save(1, {"params": bad}, config={"model": WIDE.to_dict()})
  with pytest.raises(ValueError, match=r"teacher 'code_t' \(loaded from .*bad'\): parameter "
                                       r"layers_0/mlp/up holds 1 non-finite values"):
    Teacher.from_checkpoint("code_t", tmp_path / "bad", WIDE)
  hf.save_hf(str(tmp_path / "hf"), WIDE, bad)
  with pytest.raises(ValueError, match="layers_0/mlp/up holds 1 non-finite"):
    Teacher.from_hf("code_t", str(tmp_path / "hf"), config=WIDE)


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_teacher(data):
  """An id >= V read past the embedding table and gave NaN hidden states."""
  tokens, mask, teachers = data
  pool = TeacherPool(teachers, V, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
  bad = tokens.copy()
  bad[1, 3] = V + 4
  for call in (pool.hidden_one, pool.hidden_rows, pool.hidden):
    with pytest.raises(ValueError, match=r"teacher 'math_t': tokens hold id 100 outside "
                                         r"\[0, V=96\) \(max id 100, V=96\)"):
      call("math_t", bad, mask)
  bad[1, 3] = -1
  with pytest.raises(ValueError, match=r"teachers \['math_t', 'code_t'\]: tokens hold id -1"):
    pool.hidden_routed(bad, mask, [0, 1, 0, 1])
  assert pool.forward_count == {"math_t": 0, "code_t": 0}
