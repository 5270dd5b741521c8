"""experiments.rehearsal at its reduced shape: every stage runs and the table adds up."""
import jax
import numpy as np
import pytest

from experiments import rehearsal
from opd.models import ModelConfig, decoder, init_params
from opd.parallel import memory


def test_reduced_rehearsal_table():
  table = rehearsal.run(batch=2, prompt_len=8, new_tokens=4, steps=1, devices=jax.devices()[:1])
  cfgs = rehearsal._configs(False, "bfloat16")
  dims = [cfgs[n].d_model for n in ("teacher_wide", "teacher_same")]
  tokens = 2 * (8 + 4 - 1)
  assert table["tokens"] == tokens
  # bf16 hidden states: Σ_k D_k · 2 bytes a token; fp32 logits: V · 4 per teacher.
  assert table["hidden_cache_bytes"] == tokens * sum(dims) * 2
  assert table["logit_cache_bytes"] == tokens * 2 * 1024 * 4
  assert table["steps_applied"] == 1 and np.isfinite(table["losses"]).all()
  teacher_stages = {"teacher/teacher_wide", "teacher/teacher_same"}
  stages = {"init_student", "rollout", "teachers", "opd_steps"}
  assert set(table["seconds"]) == stages | teacher_stages
  assert set(table["rss_gib_after"]) == stages | teacher_stages
  assert len(table["step_seconds"]) == 1
  # Peak so far never falls and ends at the job's peak; the resident set is at most the peak.
  order = ["init_student", "rollout", "teacher/teacher_wide", "teacher/teacher_same", "teachers",
           "opd_steps"]
  peaks = [table["rss_gib_after"][k]["peak"] for k in order]
  assert peaks == sorted(peaks) and peaks[-1] <= table["peak_rss_gib"]
  assert all(0 < v["now"] <= v["peak"] * 1.01 for v in table["rss_gib_after"].values())


def test_full_shape_refused_before_compiling():
  """The Qwen3-0.6B shape on a 1 GiB device: the memory model refuses it at once."""
  # The largest term: the update (new params + both moments, 3·P·4 = 7.15 GB), then the moments.
  with pytest.raises(memory.DoesNotFitError, match="largest terms: update .*, optimizer"):
    rehearsal.run(full=True, device_gib=1.0, devices=jax.devices()[:1])


def test_random_weights_equal_init_params_drawn_a_parameter_at_a_time(monkeypatch):
  """The teachers' leaf-by-leaf weights are init_params' own draws when it draws
  per parameter (above its flat-draw size; forced here by a zero threshold):
  same keys (fold_in by leaf index), N(0, 0.02²) cast to the storage dtype, ones."""
  monkeypatch.setattr(decoder, "_FLAT_INIT_MAX_ELEMENTS", 0)
  cfg = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=80,
                    qk_norm=True, param_dtype="bfloat16")  # a shape no other test jits
  key = jax.random.key(3)
  want, got = init_params(cfg, key), rehearsal.random_weights(cfg, key)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_bad_arguments():
  with pytest.raises(ValueError, match="steps=0"):
    rehearsal.run(steps=0)
  with pytest.raises(ValueError, match="master_dtype='float16'"):
    rehearsal.run(master_dtype="float16")
  with pytest.raises(ValueError, match="batch=3 is not divisible by the 2 devices"):
    rehearsal.run(batch=3, devices=jax.devices()[:2])


def test_compiled_memory_of_the_lora_step_reads_the_base_as_an_argument():
  """``--compile_only --lora_rank``: the LoRA student's compiled step takes the
  bf16 base as an argument beside the adapters' state and the batch (bytes
  counted here from the shapes) and returns only that state, no base."""
  from opd.models.lora import LoRAConfig, lora_param_count  # noqa: PLC0415
  out = rehearsal.compiled_memory(batch=2, prompt_len=4, new_tokens=4, lora_rank=2)
  cfgs = rehearsal._configs(False, "bfloat16")
  student = cfgs.pop("student")
  n_lora = lora_param_count(student, LoRAConfig(rank=2))
  N, dims = 2 * 7, [c.d_model for c in cfgs.values()]
  # tokens, targets (int32), mask (bool), loss_mask (f32), bf16 hidden states, f32 weights.
  batch = N * (4 + 4 + 1 + 4 + 2 * sum(dims) + 4 * len(dims))
  xla = out["opd_step_lora"]["xla"]
  # The donated state, returned in place: the adapters, mu and nu (fp32) and a few scalars
  # (step, rng, counts, learning rate).
  assert 3 * n_lora * 4 < xla["alias"] < 3 * n_lora * 4 + 64
  # Besides it, the arguments are the bf16 base and the batch (jit drops an unused batch
  # array: at most the batch's bytes).
  assert 0 <= xla["argument"] - student.num_params() * 2 - xla["alias"] <= batch
  assert xla["output"] - xla["alias"] < 1024  # the metrics: the base is not returned
  assert out["opd_step_lora"]["terms"]["grads"] == n_lora * 4
