"""LoRA students inside the trainers (opd/training/lora_state.py: LoRAStudent, init_student).

``train_sft`` / ``train_lm``, ``train_grpo`` and ``train_opd`` take a
``LoRAStudent(base, LoRAConfig)`` as their ``params``: the state (and its
checkpoints) hold the adapters and their optimizer moments only, the step
computes gradients for the adapters only, rollouts and evaluation see the
merged params, a resumed run equals a straight one, a checkpoint restores its
base from the reference it records and refuses a changed one, and the merged
export equals the adapted forward. Tiny models (D = 32, 2 layers).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lora_checks import matrix, opd_loss_and_batch, projected_gradients  # tests/ (on sys.path via conftest.py)
from opd.distill.source import OPDConfig
from opd.distill.teachers import Teacher
from opd.distill.trainer import train_opd
from opd.models import ModelConfig, forward, init_params
from opd.models.hf import load_hf, save_hf
from opd.models.lora import TARGETS, LoRAConfig, lora_apply, lora_init, lora_param_count
from opd.parallel import sharding
from opd.rl import GRPOConfig, train_grpo
from opd.rl import grpo as grpo_module
from opd.rl.grpo import GRPOExtras
from opd.rollout.batches import RolloutConfig
from opd.tasks import Example
from opd.text.tokenizers import ByteTokenizer
from opd.training import data
from opd.training import lora_state
from opd.training.checkpoints import CheckpointManager, load_params
from opd.training.lm_trainer import LMTrainConfig, train_lm
from opd.training.lora_state import LoRABaseError, LoRAStudent, export_params, init_student
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.sft import SFTData, train_sft
from opd.training.train_step import OptimConfig, make_optimizer, make_train_step

TOK = ByteTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64, qk_norm=True)
LORA = LoRAConfig(rank=3, alpha=6.0)
OPTIM = OptimConfig(lr=1e-2)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1), jax.devices()[:1])


@pytest.fixture(scope="module")
def base():
  return init_params(CFG, jax.random.key(0))


def _assert_adapters_only(state):
  """The state's params are the adapters (no base weight), in fp32."""
  want = jax.eval_shape(lambda: lora_init(CFG, LORA, jax.random.key(0)))
  assert jax.tree.structure(state.params) == jax.tree.structure(want)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


def _opt_bytes(opt_state):
  """Bytes of the optimizer state's arrays (moments; scalar counts included)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))


def test_lora_sft_trains_only_the_adapters(mesh, base, tmp_path):
  data_cfg = SFTData(domains=("math",), num_train=8, num_eval=2, difficulties=(1,), seq_len=64,
                     batch_size=2)
  state, history = train_sft(CFG, LoRAStudent(base, LORA), data_cfg, tmp_path, optim=OPTIM,
                             loop=LMTrainConfig(steps=3, eval_every=3, progress=False),
                             runtime=Runtime(mesh, seed=0))
  assert int(state.step) == 3
  _assert_adapters_only(state)
  q_b = np.asarray(state.params["layers_0"]["attn"]["q"]["b"])
  assert np.abs(q_b).max() > 0  # b starts at 0: the adapters were trained
  # Adam's mu and nu for the adapters only (fp32), plus scalar counts; the
  # same optimizer on the full model holds 2 x 4 bytes per parameter.
  n_lora, n_full = lora_param_count(CFG, LORA), sum(x.size for x in jax.tree.leaves(base))
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  assert moments == 2 * n_lora
  full = jax.eval_shape(make_optimizer(OPTIM).init, base)
  assert sum(x.size for x in jax.tree.leaves(full) if x.ndim > 0) == 2 * n_full
  assert _opt_bytes(state.opt_state) < 0.2 * _opt_bytes(full)
  evals = [m for _, m in history if "eval/loss" in m]
  assert len(evals) == 1 and np.isfinite(evals[0]["eval/loss"])
  saved = CheckpointManager(tmp_path / "checkpoints").read_config()
  # The base it trained on, by checksum (no checkpoint path: the base came as arrays).
  checksum = lora_state.base_checksum(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base))
  assert saved["lora"] == {"rank": 3, "alpha": 6.0, "targets": list(LORA.targets),
                           "base_dtype": "bfloat16",
                           "base": {"path": None, "step": None, "checksum": checksum}}


def _lm_batches():
  """An endless packed-SFT stream of fixed examples (its position is checkpointed)."""
  rng = np.random.default_rng(0)
  examples = [(rng.integers(0, 200, size=12).astype(np.int32),
               np.array([0] * 6 + [1] * 6, np.float32)) for _ in range(8)]
  return data.sft_dataset(examples, data.DataConfig(
      seq_len=16, batch_size=4, mode="pack", pad_id=TOK.pad_id, num_epochs=None, seed=0,
      process_index=0, process_count=1))


def _base_checkpoint(base, directory, step=0):
  """``base`` saved as a training run's params checkpoint (what ``load_params`` reads)."""
  with CheckpointManager(directory) as mngr:
    mngr.save(step, {"params": base}, config={"model": CFG.to_dict()})
  return directory


def _train_lm(mesh, base, steps, ckpt, base_dir=None):
  student = LoRAStudent(base, LORA, base_dtype="float32", base_checkpoint=base_dir)
  return train_lm(CFG, iter(_lm_batches()), OPTIM,
                  LMTrainConfig(steps=steps, save_every=2, progress=False),
                  RunIO(checkpoint_dir=ckpt), runtime=Runtime(mesh, seed=3), params=student)


def _dir_bytes(path) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_lora_resume_equals_a_straight_run_and_exports_equal_the_adapted_forward(
    mesh, base, tmp_path):
  base_dir = _base_checkpoint(base, tmp_path / "base")
  base = load_params(base_dir, CFG)  # as a job gets it (config.init)
  straight = _train_lm(mesh, base, 4, tmp_path / "straight", base_dir)
  _train_lm(mesh, base, 2, tmp_path / "resumed", base_dir)
  resumed = _train_lm(mesh, base, 4, tmp_path / "resumed", base_dir)  # step 2, then 3 and 4
  assert int(resumed.step) == int(straight.step) == 4
  # Same program, same inputs, same device: a resume is exact.
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               resumed, straight)
  _assert_adapters_only(straight)
  student = LoRAStudent(base, LORA, base_dtype="float32")
  # A later stage loading the run's params gets the merged model: the base
  # restored from the checkpoint the run's config references.
  loaded_ckpt = load_params(tmp_path / "straight", CFG)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               loaded_ckpt, export_params(student, straight.params))
  save_hf(str(tmp_path / "hf"), CFG, export_params(student, straight.params), arch="qwen3")
  cfg2, loaded = load_hf(str(tmp_path / "hf"))
  tokens = jax.random.randint(jax.random.key(6), (2, 7), 0, CFG.vocab_size)
  adapted = forward(CFG, lora_apply(base, straight.params, LORA), tokens).logits
  base_logits = forward(CFG, base, tokens).logits
  assert float(jnp.abs(adapted - base_logits).max()) > 1e-3  # the adapters matter
  np.testing.assert_array_equal(np.asarray(forward(cfg2, loaded, tokens).logits),
                                np.asarray(adapted))


def _capture_grads() -> optax.GradientTransformation:
  """An optax stage passing the gradients on and keeping them in its state:
  the gradients the compiled step really computed, readable after it."""
  return optax.GradientTransformation(init=lambda p: jax.tree.map(jnp.zeros_like, p),
                                      update=lambda g, state, params=None: (g, g))


def test_lora_opd_step_gradient_is_the_full_gradient_projected(mesh, base, monkeypatch):
  """The step the trainers build (``init_student`` + ``student.loss``) on the
  fused OPD loss: the adapter gradients it computes are ``s g bᵀ`` and
  ``s aᵀ g`` of the full model's gradient ``g`` at the merged params."""
  real = lora_state.make_optimizer
  monkeypatch.setattr(lora_state, "make_optimizer",
                      lambda cfg: optax.chain(_capture_grads(), real(cfg)))
  student = init_student(CFG, OPTIM, Runtime(mesh),
                         LoRAStudent(base, LORA, base_dtype="float32"))
  # Adapters with b != 0, so both chain-rule products are non-trivial.
  lora = jax.tree.map(lambda x, k: x + 0.1 * jax.random.normal(k, x.shape),
                      student.state.params,
                      jax.tree.unflatten(jax.tree.structure(student.state.params),
                                         list(jax.random.split(jax.random.key(2), len(
                                             jax.tree.leaves(student.state.params))))))
  state = student.state.replace(params=lora)
  loss, batch = opd_loss_and_batch(CFG)
  step = make_train_step(student.loss(loss), student.optimizer, mesh, student.shardings,
                         donate=False)
  new, metrics = step(state, batch)
  assert bool(metrics["finite"])
  captured = new.opt_state[0]
  # The step differentiated the adapters alone: its gradient has their leaves
  # and bytes (fp32), none of the base's.
  assert jax.tree.structure(captured) == jax.tree.structure(lora)
  assert sum(x.nbytes for x in jax.tree.leaves(captured)) == lora_param_count(CFG, LORA) * 4
  # The independent path: jax.grad of the plain loss at the merged params,
  # projected in float64 (tests/lora_checks.py).
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  g_full = jax.grad(lambda p: loss(p, batch, key)[0])(lora_apply(base, lora, LORA))
  expected = projected_gradients(lora, g_full, LORA.scale, ("layers_0", "layers_1"))
  for (layer, name), (da, db, g) in expected.items():
    module, n_in, _ = TARGETS[name]
    assert np.abs(g).max() > 1e-5  # a gradient that could disagree
    for got, want in ((matrix(captured[layer][module][name]["a"], n_in), da),
                      (matrix(captured[layer][module][name]["b"], 1), db)):
      # Two compiled programs reorder float32 sums: each entry of g sums
      # ~B*T*max(F, V) = 16 * 270 products per stage over ~10 chained stages
      # (2 layers of norm/attention/MLP, head, loss), a random walk of
      # sqrt(4e3 * 10) * eps ~ 2.4e-5 relative to the summed magnitudes,
      # which cancellation may make ~4x |g|: 1e-4 on the relative norm. A
      # missing scale s (2x), a transposed product or a base gradient is O(1).
      assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want), (layer, name)


LOWER = range(ord("a"), ord("z") + 1)


def test_grpo_with_lora_runs_two_steps_and_rollouts_see_the_merged_params(mesh, base,
                                                                           monkeypatch):
  seen = []
  real_source = grpo_module.GRPOSource

  class Recording(real_source):
    def next_batch(self, state, step):
      seen.append(np.asarray(state.params["layers_0"]["attn"]["q"]))  # model tree, not {base, lora}
      return super().next_batch(state, step)

  monkeypatch.setattr(grpo_module, "GRPOSource", Recording)
  prompts = [Example("bandit", f"bandit-{i}", "train", 1, f"Name a thing ({i}).",
                     (("assistant", "a"),), {}) for i in range(4)]
  cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_new_tokens=4, seq_len=64, kl_coef=0.01,
                   updates_per_batch=2, num_text_samples=0)
  evals = []
  reward = lambda eps: [float(len(e.response_ids) > 0 and int(e.response_ids[0]) in LOWER)
                        for e in eps]
  run = train_grpo(CFG, LoRAStudent(base, LORA), base, prompts, cfg, OPTIM,
                   LoopConfig(2, eval_every=2, progress=False),
                   RunIO(eval_fn=lambda p: evals.append(p) or {"n": 1.0}),
                   runtime=Runtime(mesh, seed=0, tokenizer=TOK),
                   extras=GRPOExtras(reward_fn=reward))
  assert int(run.state.step) == 4  # 2 batches x 2 updates
  assert all(np.isfinite(m["train/loss"]) for m in run.history)
  _assert_adapters_only(run.state)
  q_bf16 = np.asarray(base["layers_0"]["attn"]["q"].astype(jnp.bfloat16), np.float32)
  # Batch 1 samples from the fresh adapters (b = 0: the merge is the base);
  # batch 2 from the params after 2 updates, the adapters applied.
  assert len(seen) == 2
  np.testing.assert_array_equal(seen[0], q_bf16)
  assert np.abs(seen[1] - q_bf16).max() > 0
  merged = lora_apply(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base), run.state.params,
                      LORA, dtype=jnp.float32)
  assert len(evals) == 1 and jax.tree.structure(evals[0]) == jax.tree.structure(base)
  np.testing.assert_array_equal(np.asarray(evals[0]["layers_1"]["mlp"]["down"]),
                                np.asarray(merged["layers_1"]["mlp"]["down"]))


def test_opd_with_lora_trains_only_the_adapters(mesh, base):
  wide = ModelConfig(vocab_size=TOK.vocab_size, d_model=48, n_layers=1, n_heads=4, n_kv_heads=2,
                     d_ff=96)
  teachers = [Teacher("ta", wide, init_params(wide, jax.random.key(1)), "alpha")]
  prompts = [Example("alpha", f"alpha-{i}", "train", 1, f"Say something ({i}).",
                     (("assistant", "x"),), {}) for i in range(4)]
  cfg = OPDConfig(RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=4, seq_len=64,
                                length_bucket=0), diag_every=0)
  run = train_opd(CFG, LoRAStudent(base, LORA), teachers, prompts, cfg, OPTIM,
                  LoopConfig(2, progress=False), runtime=Runtime(mesh, seed=0, tokenizer=TOK))
  assert int(run.state.step) == 2
  assert all(np.isfinite(m["train/loss"]) and m["train/opd_tokens"] > 0 for m in run.history)
  _assert_adapters_only(run.state)
  assert np.abs(np.asarray(run.state.params["layers_1"]["mlp"]["down"]["b"])).max() > 0


@pytest.mark.parametrize("make, needle", [
    (lambda b: LoRAStudent(b, config=4), "LoRAStudent.config must be a LoRAConfig"),
    (lambda b: LoRAStudent(None, LORA), "LoRAStudent.base is None"),
    (lambda b: LoRAStudent(b, LORA, base_dtype="int8"), r"LoRAStudent.base_dtype='int8'"),
])
def test_bad_lora_student_fields_are_named(base, make, needle):
  with pytest.raises(ValueError, match=needle):
    make(base)


def test_trainer_refuses_a_base_of_another_shape_and_an_moe_bias_update(mesh, base):
  other = init_params(CFG.replace(d_ff=40), jax.random.key(0))
  with pytest.raises(ValueError, match=r"params\['base'\]\['layers_0'\]\['mlp'\]"):
    train_lm(CFG, iter([]), OPTIM, LMTrainConfig(steps=1, progress=False),
             runtime=Runtime(mesh), params=LoRAStudent(other, LORA))
  moe_cfg = CFG.replace(moe={"n_routed_experts": 4, "experts_per_token": 2,
                             "moe_d_ff": 16, "router": "sigmoid", "bias_update_rate": 0.01})
  moe_base = init_params(moe_cfg, jax.random.key(0))
  with pytest.raises(ValueError, match=r"ModelConfig.moe.bias_update_rate=0.01"):
    train_lm(moe_cfg, iter([]), OPTIM, LMTrainConfig(steps=1, progress=False),
             runtime=Runtime(mesh), params=LoRAStudent(moe_base, LORA))


def test_lora_checkpoint_holds_the_adapters_and_refuses_a_changed_or_missing_base(
    mesh, base, tmp_path):
  """The checkpoint of a LoRA run is its adapters, their moments and a
  reference to the base checkpoint (path, step, checksum): ``load_params``
  restores the base from there, and refuses one that changed or is gone; a
  resume given another base is refused by the config check."""
  import shutil  # noqa: PLC0415
  base_dir = _base_checkpoint(base, tmp_path / "base")
  base = load_params(base_dir, CFG)
  run = _train_lm(mesh, base, 2, tmp_path / "lora", base_dir)
  with CheckpointManager(tmp_path / "lora") as mngr:
    # Restoring onto the adapter-only state checks the structure both ways
    # (a base leaf in the checkpoint is "unexpected"), so this is all it holds.
    restored = mngr.restore(run).state
    ref = mngr.read_config()["lora"]["base"]
  n_lora, n_base = lora_param_count(CFG, LORA), CFG.num_params()
  float_bytes = sum(x.nbytes for x in jax.tree.leaves(restored)
                    if x.ndim and jnp.issubdtype(x.dtype, jnp.floating))
  assert float_bytes == 3 * n_lora * 4  # adapters + Adam's mu and nu, fp32
  assert float_bytes < 0.3 * n_base * 4  # the fp32 base alone is 143,616 bytes here
  assert ref["path"] == os.path.abspath(base_dir) and ref["step"] == 0
  # The base changed under the same path and step: refused, naming both checksums.
  other = jax.tree.map(lambda x: x * 1.5, base)
  shutil.rmtree(base_dir / "0")
  _base_checkpoint(other, base_dir)
  with pytest.raises(LoRABaseError, match=rf"{ref['checksum']}.* now has checksum "
                                           rf"{lora_state.base_checksum(other)}"):
    load_params(tmp_path / "lora", CFG)
  shutil.rmtree(base_dir)  # the base is gone
  with pytest.raises(LoRABaseError, match=rf"its base {base_dir} \(step 0, checksum "
                                           rf"{ref['checksum']}\) cannot be restored"):
    load_params(tmp_path / "lora", CFG)
  # A resume given another base: the checkpoint's config names the checksum it trained on.
  with pytest.raises(ValueError, match=rf"lora.base.checksum: checkpoint has "
                                       rf"'{ref['checksum']}'"):
    _train_lm(mesh, other, 4, tmp_path / "lora")
