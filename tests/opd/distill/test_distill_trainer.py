"""The OPD trainer (opd/distill/trainer.py + source.py) on the shared loop.

Tiny models throughout: byte vocabulary V=270, a student of D=32 x 2 layers
and teachers of another width and depth (D=48 x 1 layer). Each
``train_opd`` call compiles its own train step (no module-level caches), so
runs are kept few and short.

The teachers of the learning test are built so that what they want is
known: every token embedding is the same vector, so the hidden state is the
same at every position (attention averages identical values), and the head
is the minimum-norm ``W`` with ``h0 @ W = a`` for logits ``a`` that favour a
set of tokens (lowercase letters; lowercase letters and digits).
"""
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd.config.fields import from_group
from opd.distill import trainer as trainer_lib
from opd.distill.loss import make_opd_loss
from opd.distill.faults import FaultTolerantTeachers, TeacherFaultError
from opd.distill.source import OPDConfig, OPDSource
from opd.distill.teachers import Teacher, TeacherPool
from opd.distill.trainer import make_heldout_eval, train_opd
from opd import rollout as rollout_lib
from opd.models import ModelConfig, forward, init_params, param_logical_axes
from opd.parallel import sharding
from opd.rollout.batches import PromptStream, RolloutConfig
from opd.tasks import Example
from opd.text.tokenizers import ByteTokenizer
from opd.training.checkpoints import CheckpointManager
from opd.training.metrics_writer import read_metrics
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.train_step import OptimConfig

EPS32 = float(np.finfo(np.float32).eps)
TOK = ByteTokenizer()
V = TOK.vocab_size
STUDENT = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
WIDE = ModelConfig(vocab_size=V, d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=96)
OPD = OPDConfig(RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=8, seq_len=64,
                              length_bucket=0), diag_every=0)
OPTIM = OptimConfig(lr=1e-2)
LOWER, DIGITS = list(range(ord("a"), ord("z") + 1)), list(range(ord("0"), ord("9") + 1))


def prompts(n, split="train", domains=("alpha", "beta")):
  return [Example(d, f"{d}-{split}-{i}", split, 1, f"Say something {d} ({split} {i}).",
                  (("assistant", "x"),), {}) for i in range(n) for d in domains]


def favouring_teacher(name, seed, domain, favoured, bonus=4.0):
  """A teacher whose distribution is softmax(a) at every position, a = bonus on ``favoured``."""
  p = init_params(WIDE, jax.random.key(seed))
  p = {**p, "embedding": jnp.broadcast_to(p["embedding"][:1], p["embedding"].shape)}
  h0 = forward(WIDE, p, jnp.zeros((1, 1), jnp.int32), None, jnp.ones((1, 1), bool),
               return_logits=False, return_hidden=True).hidden[0, 0]
  a = np.zeros(V, np.float32)
  a[favoured] = bonus
  return Teacher(name, WIDE, {**p, "lm_head": jnp.outer(h0 / jnp.sum(h0 * h0), a)}, domain)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


@pytest.fixture(scope="module")
def student():
  return init_params(STUDENT, jax.random.key(0))


@pytest.fixture(scope="module")
def teachers():
  return [favouring_teacher("ta", 1, "alpha", LOWER),
          favouring_teacher("tb", 2, "beta", LOWER + DIGITS)]


def _run(student, teachers, mesh, steps, cfg=OPD, *, seed=0, save_every=0, eval_every=0,
         teacher_fns=None, **io):
  """``train_opd`` on ``prompts(8)``; ``io``: ``RunIO`` fields (workdir, checkpoint_dir, eval_fn)."""
  return train_opd(STUDENT, student, teachers, prompts(8), cfg, OPTIM,
                   LoopConfig(steps, save_every=save_every, eval_every=eval_every, progress=False),
                   RunIO(**io),
                   runtime=Runtime(mesh, seed=seed, tokenizer=TOK), teacher_fns=teacher_fns)


def _one_batch(params, teachers, mesh, cfg):
  """Step 0's batch of an ``OPDSource`` and the loss over it."""
  pool = TeacherPool(teachers, V, mesh)
  source = OPDSource(STUDENT, cfg, PromptStream(prompts(8), seed=0),
                     teachers=FaultTolerantTeachers.from_pool(pool, deadline_s=60.0),
                     heads=pool.heads, domains=[t.domain for t in teachers], total_steps=1,
                     tokenizer=TOK, mesh=mesh)
  batch, metrics = source.next_batch(types.SimpleNamespace(params=params), 0)  # reads .params
  loss_fn = make_opd_loss(STUDENT, pool.heads, cfg.loss, teacher_names=pool.names)
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, None)
  return batch, metrics, float(loss), aux, grads


def test_student_equal_to_teacher_gives_zero_loss_and_gradient(mesh, student, teachers):
  """Through sampling, the teacher forward, the cache, the schedule and the
  loss: a teacher that *is* the student contributes nothing.

  Bound: the student's logits in the loss and the teacher's (another jitted
  program over the same params, cached in float32) may differ by a few ulps
  of |z|; KL is second order in that difference and its gradient w.r.t. the
  logits, p ⊙ (δ − E_p δ), first order, so both stay within
  ``64 · eps · max|z|`` times the size of the cross-entropy gradient.
  """
  cfg = OPD.replace(weighting=dict(schedule="uniform"), cache_dtype="float32")
  twin = Teacher("twin", STUDENT, student, None)
  batch, metrics, loss, aux, grads = _one_batch(student, [twin], mesh, cfg)
  assert aux["opd_tokens"] > 0 and metrics["opd/skipped_step"] == 0
  b, t = batch["tokens"].shape
  z = forward(STUDENT, student, batch["tokens"], None, batch["mask"]).logits
  ce = lambda p: jnp.mean(jax.nn.logsumexp(forward(STUDENT, p, batch["tokens"], None,
                                                   batch["mask"]).logits, -1))
  ce_scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(jax.grad(ce)(student)))
  bound = 64 * EPS32 * float(jnp.max(jnp.abs(z)))
  assert abs(loss) <= bound, (loss, bound)
  worst = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
  assert worst <= bound * ce_scale, (worst, bound * ce_scale)

  # The same path with a teacher that differs gives a clearly positive loss
  # and gradient (so the zero above is not a loss that is always zero).
  _, _, loss2, aux2, grads2 = _one_batch(student, [twin, teachers[0]], mesh, cfg)
  assert loss2 > 0.1 and aux2["kl/twin"] <= bound < aux2["kl/ta"]
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads2)) > 1e3 * worst


@pytest.mark.parametrize("schedule_name,updates,estimator", [("uniform", 3, "full"),
                                                             ("routing", 2, "top_k"),
                                                             ("confidence", 1, "token")])
def test_the_cache_serves_every_update_of_a_batch(mesh, student, teachers, schedule_name,
                                                  updates, estimator):
  """One forward per teacher per rollout batch, whatever updates_per_batch;
  with routing each teacher runs over its own rows only. Every schedule and
  estimator runs through the trainer."""
  pool = TeacherPool(teachers, V, mesh)
  cfg = OPD.replace(weighting=dict(schedule=schedule_name), updates_per_batch=updates,
                    loss=dict(estimator=estimator))
  run = _run(student, pool, mesh, 2, cfg=cfg)
  assert pool.forward_count == {"ta": 2, "tb": 2}
  assert int(run.state.step) == 2 * updates
  last = run.history[-1]
  assert last["cache/computes"] == 2
  assert last["cache/bytes_per_token/ta"] == 48 * 2  # bf16
  assert last["cache/bytes_per_token/logits"] == V * 4
  assert last["weight/ta"] + last["weight/tb"] == pytest.approx(1.0, abs=1e-6)
  assert all(np.isfinite(m["train/loss"]) and m["train/opd_tokens"] > 0 for m in run.history)


def test_a_flaky_teacher_is_skipped_and_counted_in_metrics_jsonl(mesh, student, teachers,
                                                                 tmp_path):
  """20 steps, ``tb`` failing 30% of its calls: the run finishes, the JSONL's
  skip counts equal the failures, and on failed steps all weight is on ``ta``."""
  pool = TeacherPool(teachers, V, mesh)
  rng, failed = np.random.default_rng(0), []

  def flaky(tokens, mask):
    failed.append(bool(rng.random() < 0.3))
    if failed[-1]:
      raise ConnectionError("teacher tb dropped the connection")
    return pool.hidden("tb", tokens, mask)

  cfg = OPD.replace(weighting=dict(schedule="uniform"))
  run = _run(student, pool, mesh, 20, cfg=cfg, teacher_fns={"tb": flaky}, workdir=tmp_path)
  rows = read_metrics(tmp_path)
  assert len(rows) == 20 == len(failed) and 0 < sum(failed) < 20
  assert [r["skips/tb/error"] for r in rows] == list(np.cumsum(failed))
  assert all(r["skips/ta/error"] == 0 and r["opd/skipped_step"] == 0 for r in rows)
  for r, f in zip(rows, failed):
    assert r["weight/ta"] == pytest.approx(1.0 if f else 0.5)
    assert np.isfinite(r["train/loss"])
  assert int(run.state.step) == 20


def test_a_batch_no_teacher_answers_is_skipped_and_logged(mesh, student, teachers, tmp_path):
  def dead(tokens, mask):
    raise TimeoutError("gone")

  run = _run(student, teachers, mesh, 2, cfg=OPD.replace(weighting=dict(schedule="uniform")),
             teacher_fns={"ta": dead, "tb": dead}, workdir=tmp_path)
  for m in run.history:
    assert m["opd/skipped_step"] == 1 and m["train/opd_tokens"] == 0 and m["train/loss"] == 0
  assert run.history[-1]["skips/steps"] == 2 and run.history[-1]["skips/ta/error"] == 2
  assert read_metrics(tmp_path)[-1]["opd/skipped_step"] == 1


def test_resume_continues_exactly(mesh, student, teachers, tmp_path):
  """Interrupted after step 2's checkpoint, a resumed run continues with the
  prompt position and state of the uninterrupted one."""
  ckpt = tmp_path / "ckpt"
  straight = _run(student, teachers, mesh, 4, seed=3)

  class Interrupted(Exception):
    pass

  calls = []

  def interrupt_at_3(params):
    calls.append(1)
    if len(calls) == 3:
      raise Interrupted
    return {"probe": 0.0}

  with pytest.raises(Interrupted):
    _run(student, teachers, mesh, 4, seed=3, checkpoint_dir=ckpt, save_every=1,
         eval_fn=interrupt_at_3, eval_every=1)
  assert CheckpointManager(ckpt).all_steps() == [1, 2]
  resumed = _run(student, teachers, mesh, 4, seed=3, checkpoint_dir=ckpt, save_every=1)
  assert len(resumed.history) == 2
  for got, want in zip(resumed.history, straight.history[2:]):
    assert got["response/length_mean"] == want["response/length_mean"]
    # Same compiled programs on the same inputs (state, prompt position, keys):
    # a resumed run must reproduce the straight one bit for bit.
    assert got["train/loss"] == want["train/loss"]
  assert int(resumed.state.step) == int(straight.state.step) == 4
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_student_moves_towards_each_teacher_on_held_out_prompts(mesh, student, teachers):
  """30 steps with prompt routing: the reverse KL of each teacher on the
  student's responses to held-out prompts of its domain falls by >= 30%.

  Measured (seeds 0 and 1 of student and teachers): final / initial reverse
  KL 0.04-0.05 for ``ta`` and 0.09-0.10 for ``tb`` (from about 1.44), far
  below the 0.7 asked.
  """
  pool = TeacherPool(teachers, V, mesh)
  held_out = prompts(4, "test")
  evaluate = make_heldout_eval(STUDENT, pool, held_out, OPD, tokenizer=TOK, mesh=mesh)
  before = evaluate(student)
  run = _run(student, pool, mesh, 30, eval_fn=evaluate)
  after = {k.removeprefix("eval/"): v for k, v in run.history[-1].items()
           if k.startswith("eval/")}
  print(f"held-out reverse KL before {before}, after {after}")
  assert set(before) == set(after) == {"rkl/ta", "rkl/tb"}
  for k in before:
    assert before[k] > 0.5 and after[k] <= 0.7 * before[k], (k, before, after)


def test_heldout_kl_matches_a_numpy_reference(mesh, student, teachers):
  """``make_heldout_eval`` against KL(p_s ‖ q_k) from materialised logits in numpy."""
  pool = TeacherPool(teachers, V, mesh)
  held_out = prompts(2, "test")
  got = make_heldout_eval(STUDENT, pool, held_out, OPD, tokenizer=TOK, mesh=mesh)(student)
  sampling = rollout_lib.sampling_for_chat(TOK, max_new_tokens=OPD.rollout.max_new_tokens)
  eps = rollout_lib.rollout(rollout_lib.Policy(STUDENT, student, TOK, mesh), held_out, 1,
                            sampling, verify=False)
  host = rollout_lib.batch_episodes(eps, seq_len=OPD.rollout.seq_len, pad_id=TOK.pad_id)
  lp = np.asarray(jax.nn.log_softmax(forward(STUDENT, student, host["tokens"], None,
                                             host["mask"]).logits), np.float64)
  lm = host["loss_mask"] > 0
  for t in teachers:
    lq = np.asarray(jax.nn.log_softmax(forward(t.cfg, t.params, host["tokens"], None,
                                               host["mask"]).logits), np.float64)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    rows = np.asarray([ex.domain == t.domain for ex in held_out])
    want = kl[rows][lm[rows]].mean()
    # float32 logits and a V-term sum: |error| <= V * eps * max|log p - log q| per token.
    tol = V * EPS32 * float(np.abs(lp - lq)[lm].max())
    assert got[f"rkl/{t.name}"] == pytest.approx(want, abs=tol)


def test_bad_input_is_rejected_naming_the_field(mesh, student, teachers):
  with pytest.raises(ValueError, match="schedule"):
    from_group(OPDConfig, {"weighting": {"schedule": "loudest"}}, "config.opd")
  with pytest.raises(ValueError, match="prompts_per_step"):
    from_group(OPDConfig, {"rollout": {"prompts_per_step": 0}}, "config.opd")
  with pytest.raises(ValueError, match="teachers=\\[\\]"):
    _run(student, [], mesh, 1)
  other = ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64)
  with pytest.raises(ValueError, match="vocab_size=128"):
    _run(student, [Teacher.random("small", other, 0)], mesh, 1)
  with pytest.raises(ValueError, match="teacher_fns names \\['tc'\\]"):
    _run(student, teachers, mesh, 1, teacher_fns={"tc": lambda t, m: None})
  with pytest.raises(ValueError, match="domains\\[0\\]='gamma' has no teacher"):
    train_opd(STUDENT, student, teachers, prompts(2, domains=("gamma",)), OPD, OPTIM,
              LoopConfig(1, progress=False), runtime=Runtime(mesh, tokenizer=TOK))
  with pytest.raises(ValueError, match="anneal_steps=5 exceeds"):
    _run(student, teachers, mesh, 2, cfg=OPD.replace(weighting=dict(anneal_steps=5)))
  with pytest.raises(ValueError, match="cfg must be a OPDConfig"):
    train_opd(STUDENT, student, teachers, prompts(2), {}, OPTIM, LoopConfig(1),
              runtime=Runtime(mesh, tokenizer=TOK))
  assert trainer_lib.OPDConfig is OPDConfig


def test_a_sharded_opd_step_equals_the_single_device_step(student, teachers, monkeypatch):
  """The same rollout batch through the teacher pool, the cache, the
  schedule and the loss on a (2, 2, 2) mesh of 8 fake devices and on one
  device: equal loss, per-teacher KL and gradients.

  Tolerance: sharding only reorders float32 sums (the mean over the B·T
  tokens, the D / F contractions split over ``tensor``); reordering a sum of
  n terms moves it by at most (n − 1)·eps·Σ|terms|, here bounded by
  n·eps·scale with n = B·T + F and scale |loss| (or max|grad|).
  """
  cfg = OPD.replace(weighting=dict(schedule="uniform"), cache_dtype="float32")
  real_rollout, recorded = rollout_lib.rollout, []

  def same_rollout(*args, **kwargs):  # the sharded run trains on the single run's samples
    if not recorded:
      recorded.append(real_rollout(*args, **kwargs))
    return recorded[0]

  monkeypatch.setattr(rollout_lib.episodes, "rollout", same_rollout)  # what the sources call
  out = {}
  for name, mesh in (("single", sharding.make_mesh((1, 1, 1), jax.devices()[:1])),
                     ("sharded", sharding.make_mesh((2, 2, 2)))):
    pool = TeacherPool(teachers, V, mesh)
    source = OPDSource(STUDENT, cfg, PromptStream(prompts(8), seed=0),
                       teachers=FaultTolerantTeachers.from_pool(pool, deadline_s=60.0),
                       heads=pool.heads, domains=[t.domain for t in teachers], total_steps=1,
                       tokenizer=TOK, mesh=mesh)
    batch, _ = source.next_batch(types.SimpleNamespace(params=student), 0)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), student)
    params = jax.device_put(student, sharding.tree_shardings(
        param_logical_axes(STUDENT), shapes, mesh, sharding.DEFAULT_RULES))
    loss_fn = make_opd_loss(STUDENT, pool.heads, cfg.loss, teacher_names=pool.names)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
      (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch,
                                                                              None)
    out[name] = (float(loss), {k: float(v) for k, v in aux.items()},
                 jax.tree.map(np.asarray, grads), np.asarray(batch["tokens"]))
  (l1, a1, g1, t1), (l8, a8, g8, t8) = out["single"], out["sharded"]
  np.testing.assert_array_equal(t1, t8)
  n = t1.size + WIDE.d_ff
  assert l1 > 0.1 and abs(l8 - l1) <= n * EPS32 * abs(l1)
  for k in ("kl/ta", "kl/tb"):
    assert abs(a8[k] - a1[k]) <= n * EPS32 * abs(a1[k])
  assert a8["opd_tokens"] == a1["opd_tokens"] > 0
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(g1))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
    np.testing.assert_allclose(b, a, atol=n * EPS32 * scale, rtol=0)


def _with_nan_head(t):
  head = np.array(t.params["lm_head"])
  head[5, 17] = np.nan
  return Teacher(t.name, t.cfg, {**t.params, "lm_head": head}, t.domain)


def test_a_teacher_with_a_nan_head_is_skipped_and_logged_and_the_run_goes_on(
    mesh, student, teachers, caplog):
  """``tb``'s head holds one NaN: the loss used to be NaN and the run stopped
  at step 1 (NonFiniteError). Now ``tb`` is a ``nonfinite`` fault on every
  batch (logged with its message), ``ta`` carries all the weight and the
  held-out eval reports ``tb`` as NaN and ``ta`` as without the fault."""
  broken = [teachers[0], _with_nan_head(teachers[1])]
  pool = TeacherPool(broken, V, mesh)
  held_out = prompts(2, "test")
  evaluate = make_heldout_eval(STUDENT, pool, held_out, OPD, tokenizer=TOK, mesh=mesh)
  clean = make_heldout_eval(STUDENT, TeacherPool(teachers, V, mesh), held_out, OPD,
                            tokenizer=TOK, mesh=mesh)(student)
  with caplog.at_level("WARNING", logger="opd.distill.faults"):
    got = evaluate(student)
    run = _run(student, pool, mesh, 2, cfg=OPD.replace(weighting=dict(schedule="uniform")))
  assert np.isnan(got["rkl/tb"]) and got["rkl/ta"] == clean["rkl/ta"]  # same program, same data
  assert int(run.state.step) == 2 and pool.forward_count["tb"] == 0
  for s, m in enumerate(run.history, start=1):
    assert np.isfinite(m["train/loss"]) and m["train/opd_tokens"] > 0
    assert m["weight/ta"] == pytest.approx(1.0) and m["weight/tb"] == 0.0
    assert m["skips/tb/nonfinite"] == s and m["opd/skipped_step"] == 0
  assert "opd: teacher 'tb' skipped (nonfinite): output head W_k(48, 270) has 1 non-finite" \
      in caplog.text
  assert "held-out eval: teacher 'tb' skipped (nonfinite)" in caplog.text


def test_a_teacher_raising_in_the_heldout_eval_is_survived(mesh, student, teachers, caplog,
                                                          monkeypatch):
  """The held-out eval called the pool outside the fault layer: any teacher
  fault there killed the job. Now ``tb``'s crash is logged and its KL is NaN;
  ``ta``'s is what a fault-free eval gives."""
  pool = TeacherPool(teachers, V, mesh)
  held_out = prompts(2, "test")
  evaluate = make_heldout_eval(STUDENT, pool, held_out, OPD, tokenizer=TOK, mesh=mesh)
  clean = evaluate(student)
  inner = pool._forward

  def tb_crashes(name, tokens, mask):
    if name == "tb":
      raise RuntimeError("tb: device lost")
    return inner(name, tokens, mask)

  monkeypatch.setattr(pool, "_forward", tb_crashes)
  with caplog.at_level("WARNING", logger="opd.distill.faults"):
    got = evaluate(student)
  assert np.isnan(got["rkl/tb"]) and got["rkl/ta"] == clean["rkl/ta"] and clean["rkl/tb"] > 0
  assert "held-out eval: teacher 'tb' skipped (error): RuntimeError: tb: device lost" \
      in caplog.text


def test_a_teacher_unanswered_for_a_whole_window_stops_the_run(mesh, student, teachers):
  """``tb`` fails every call; with ``fault_window=2`` the run stops in step 2's
  batch with a message naming it, instead of distilling without it."""
  def dead(tokens, mask):
    raise ConnectionRefusedError("tb's server is gone")

  done = []
  with pytest.raises(TeacherFaultError, match=r"teacher 'tb' answered none of its rows on the "
                     r"last 2 batches .*tb's server is gone.*OPDConfig.fault_window"):
    _run(student, teachers, mesh, 5,
         cfg=OPD.replace(weighting=dict(schedule="uniform"), fault_window=2),
         teacher_fns={"tb": dead}, on_metrics=lambda s, m: done.append(s))
  assert done == [1]
  with pytest.raises(ValueError, match="fault_window"):
    OPDConfig(fault_window=-1)
