"""SFT objective and trainer: response-masked loss, packing, eval during training.

The reference loss is computed in numpy from logits of each example run
through the model *on its own* (no packing, no segment ids), with the
response positions taken from how the examples were built here — so the
packed batch, the shift, the mask and the mean are all checked against an
independent path.
"""
import numpy as np
import pytest
import jax

from opd.parallel import sharding
from opd.training import data
from opd.training.lm_trainer import LMTrainConfig, evaluate_loss, train_lm
from opd.training.loop_config import RunIO, Runtime
from opd.models import ModelConfig, forward, init_params
from opd.training.objectives import lm_loss
from opd.training.train_step import OptimConfig

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                  dtype="float32", param_dtype="float32")
BOS, EOS, PAD = 61, 62, 63
T = 32


def _examples(n, seed=0):
  """(ids, loss_mask) pairs: BOS + prompt + response + EOS, mask on response+EOS."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    prompt = rng.integers(0, 60, size=rng.integers(2, 8))
    response = rng.integers(0, 60, size=rng.integers(1, 8))
    ids = np.concatenate([[BOS], prompt, response, [EOS]]).astype(np.int32)
    mask = np.concatenate([np.zeros(1 + len(prompt)), np.ones(len(response) + 1)])
    out.append((ids, mask.astype(np.float32)))
  return out


def _reference_loss(params, examples):
  """Mean NLL over response tokens, each example forwarded alone (numpy)."""
  total, count = 0.0, 0
  for ids, mask in examples:
    x = np.asarray(ids)[None, :-1]
    logits = np.asarray(forward(CFG, params, x, None, np.ones_like(x, bool),
                                return_logits=True).logits, np.float64)[0]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    targets = ids[1:]
    nll = -logp[np.arange(len(targets)), targets]
    total += float((nll * mask[1:]).sum())
    count += int(mask[1:].sum())
  return total / count


@pytest.mark.parametrize("mode", ["pad", "pack"])
@pytest.mark.parametrize("fused", [False, True])
def test_sft_loss_equals_per_example_reference(mode, fused):
  params = init_params(CFG, jax.random.key(0))
  examples = _examples(12)
  ds = data.sft_dataset(examples, data.DataConfig(
      seq_len=T, batch_size=12, mode=mode, pad_id=PAD, shuffle=False, drop_remainder=False,
      process_index=0, process_count=1))
  batches = list(ds)
  if mode == "pack":  # several examples really share a row
    assert batches[0]["segment_ids"].max() > 1
  loss_fn = jax.jit(lm_loss(CFG, fused=fused))
  got_num = got_den = 0.0
  for b in batches:
    loss, m = loss_fn(params, b, jax.random.key(0))
    got_num += float(loss) * float(m["tokens"])
    got_den += float(m["tokens"])
  assert got_den == sum(float(mk[1:].sum()) for _, mk in examples)
  np.testing.assert_allclose(got_num / got_den, _reference_loss(params, examples), rtol=2e-5)


def test_prompt_tokens_get_no_gradient_signal():
  """Changing a prompt *target* (a token nobody should learn to predict)
  leaves the loss unchanged; changing a response target changes it."""
  params = init_params(CFG, jax.random.key(1))
  (ids, mask), = _examples(1, seed=3)
  batch = next(iter(data.sft_dataset([(ids, mask)], data.DataConfig(
      seq_len=T, batch_size=1, mode="pad", pad_id=PAD, shuffle=False, drop_remainder=False,
      process_index=0, process_count=1))))
  loss_fn = jax.jit(lm_loss(CFG))
  base = float(loss_fn(params, batch, None)[0])
  first_response = int(np.argmax(batch["loss_mask"][0] > 0))
  assert first_response >= 1
  for pos, should_change in ((first_response - 1, False), (first_response, True)):
    b = dict(batch)
    b["targets"] = batch["targets"].copy()
    b["targets"][0, pos] = (b["targets"][0, pos] + 1) % 60
    changed = abs(float(loss_fn(params, b, None)[0]) - base) > 1e-6
    assert changed == should_change, pos


def test_train_lm_learns_and_evaluates_during_training(tmp_path):
  """A fixed response per prompt is memorised; held-out loss and the extra
  eval run at ``eval_every``; the best checkpoint is kept."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 60, size=4) for _ in range(8)]
  answers = [rng.integers(0, 60, size=3) for _ in range(8)]
  examples = [(np.concatenate([[BOS], p, a, [EOS]]).astype(np.int32),
               np.array([0] * 5 + [1] * 4, np.float32)) for p, a in zip(prompts, answers)]
  train = data.sft_dataset(examples, data.DataConfig(
      seq_len=16, batch_size=8, mode="pack", pad_id=PAD, num_epochs=None, seed=0,
      process_index=0, process_count=1))
  held = list(data.sft_dataset(examples, data.DataConfig(
      seq_len=16, batch_size=8, mode="pad", pad_id=PAD, shuffle=False, drop_remainder=False,
      process_index=0, process_count=1)))
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  rules = sharding.DEFAULT_RULES
  logged, extra_calls = {}, []

  def extra_eval(params):
    extra_calls.append(1)
    return {"eval/extra": 1.0}

  params0 = init_params(CFG, jax.random.key(0))
  before = evaluate_loss(lm_loss(CFG), params0, held, mesh, rules)["loss"]
  state = train_lm(CFG, iter(train), OptimConfig(lr=1e-2, warmup_steps=5, decay_steps=55, schedule="cosine"),
                   LMTrainConfig(steps=60, eval_every=20, save_every=20, progress=False),
                   RunIO(checkpoint_dir=tmp_path / "ckpt", eval_fn=extra_eval,
                         on_metrics=lambda step, m: logged.setdefault(step, m)),
                   runtime=Runtime(mesh, rules), params=params0, eval_batches=held)
  after = evaluate_loss(lm_loss(CFG), state.params, held, mesh, rules)["loss"]
  assert int(state.step) == 60
  assert after < 0.3 * before, (before, after)
  eval_steps = sorted(s for s, m in logged.items() if "eval/loss" in m)
  assert eval_steps == [20, 40, 60] and len(extra_calls) == 3
  np.testing.assert_allclose(logged[60]["eval/loss"], after, rtol=1e-5)
  assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())[-1] == 60


@pytest.mark.parametrize("field,value,match", [
    ("steps", -1, r"LMTrainConfig.steps must be .*, got -1$"),
    ("save_every", True, r"LMTrainConfig.save_every must be .*, got True$"),
    ("keep_checkpoints", 0, r"LMTrainConfig.keep_checkpoints must be .*, got 0$"),
    ("fused_loss", 1, r"LMTrainConfig.fused_loss must be True or False, got 1$"),
])
def test_lm_train_config_names_the_bad_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    LMTrainConfig(**{"steps": 5, field: value})


def test_lm_train_config_accepts_numpy_ints():
  loop = LMTrainConfig(steps=np.int64(5), save_every=np.int32(2))
  assert (loop.steps, loop.save_every) == (5, 2) and type(loop.steps) is int
  assert loop == LMTrainConfig(steps=5, save_every=2)


def test_warmup_longer_than_the_run_is_refused_naming_both_fields(tmp_path):
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  with pytest.raises(ValueError,
                     match=r"OptimConfig\.warmup_steps=10 exceeds LMTrainConfig\.steps=5"):
    train_lm(CFG, iter([]), OptimConfig(lr=1e-3, warmup_steps=10), LMTrainConfig(steps=5),
             RunIO(checkpoint_dir=tmp_path), runtime=Runtime(mesh, sharding.DEFAULT_RULES))
  assert list(tmp_path.iterdir()) == []  # refused before any work


def test_a_v4_model_gets_one_document_rows():
  """DeepSeek-V4's compressed attention needs consecutive positions per row: a
  packed batch (segment ids > 1) is refused on the host naming the fix, a
  padded batch reaches the step without its segment ids (the mask says the same)."""
  import numpy as np  # noqa: PLC0415
  from opd.training import lm_trainer as lm  # noqa: PLC0415
  padded = {"tokens": np.ones((2, 4), np.int32), "segment_ids": np.array([[1, 1, 1, 0]] * 2)}
  got = lm._one_document_rows(lambda b: b, padded)
  assert "segment_ids" not in got and got["tokens"] is padded["tokens"]
  packed = dict(padded, segment_ids=np.array([[1, 1, 2, 2]] * 2))
  with pytest.raises(ValueError, match="packed batch .* mode='pad'"):
    lm._one_document_rows(lambda b: b, packed)


def test_sft_mode_pads_v4_models_only():
  from experiments import common  # noqa: PLC0415
  from opd.models import ModelConfig  # noqa: PLC0415
  from experiments.configs.distill import v4_model  # noqa: PLC0415
  assert common.sft_mode(ModelConfig()) == "pack"
  assert common.sft_mode(ModelConfig.from_dict(v4_model(32))) == "pad"
