"""HF interop: logits parity with ``transformers`` in both directions, and clear errors.

The reference is the ``transformers`` implementation of the same random tiny
config, run in fp32 on CPU with eager attention.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from opd.models import ModelConfig, forward, init_params
from opd.models import hf as hfio
from hf_batches import hf_logits, padded_batch

B, T = 3, 11

# Tiny HF configs chosen to exercise GQA (K < H), head_dim != D / H (Qwen3),
# q/k norm, biases, a non-default RoPE base and tied embeddings.
HF_CASES = {
    "qwen3": dict(cls="Qwen3", shard=None, kw=dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True,
        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama": dict(cls="Llama", shard="40KB", kw=dict(
        vocab_size=260, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
        rope_theta=20000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen2": dict(cls="Qwen2", shard="30KB", kw=dict(
        vocab_size=270, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
}


# Both sides compute in float32 (torch eager, XLA with highest matmul
# precision), each off by ~sqrt(n)·eps relative per rounded step (n <= the
# widest contraction), ~14 steps per layer + norm and head adding in
# quadrature, max over the logits within ~4 standard deviations; the two
# errors add. Relative to the logits' RMS, about 5e-5.
_WIDEST = max(max(c["kw"]["hidden_size"], c["kw"]["intermediate_size"]) for c in HF_CASES.values())
_STEPS = 14 * max(c["kw"]["num_hidden_layers"] for c in HF_CASES.values()) + 2
REL_TOL = 2 * 4 * np.sqrt(_STEPS) * np.sqrt(_WIDEST) * np.finfo(np.float32).eps


def _padded_batch(vocab, seed=0):
  return padded_batch(vocab, B, T, seed)




_jit_forward = jax.jit(lambda cfg, p, t, pos, m: forward(cfg, p, t, pos, m).logits,
                       static_argnums=0)


def _our_logits(cfg, params, tokens, mask, positions):
  return np.asarray(_jit_forward(cfg, params, jnp.asarray(tokens), jnp.asarray(positions),
                                 jnp.asarray(mask)))


def _assert_close_at_real_tokens(ours, ref, mask):
  assert ours.shape == ref.shape
  # The comparison only has power if the logits are not all ~0.
  assert ref[mask].std() > 0.3, ref[mask].std()
  diff = np.abs(ours[mask] - ref[mask]).max()
  tol = REL_TOL * np.sqrt(np.mean(np.square(ref[mask], dtype=np.float64)))
  assert diff <= tol, f"max |ours - transformers| = {diff} > {tol}"


def _random_hf_model(arch, seed=0):
  case = HF_CASES[arch]
  config = getattr(transformers, case["cls"] + "Config")(**case["kw"])
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = getattr(transformers, case["cls"] + "ForCausalLM")(config).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    # The default init (zero biases, unit norms, std 0.02) would hide
    # transposed or swapped bias / norm tensors.
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
  return model


@pytest.mark.parametrize("arch", list(HF_CASES))
def test_load_hf_matches_transformers(arch, tmp_path):
  model = _random_hf_model(arch)
  shard = HF_CASES[arch]["shard"]
  kwargs = {"max_shard_size": shard} if shard else {}
  model.save_pretrained(tmp_path, **kwargs)
  sharded = os.path.exists(tmp_path / "model.safetensors.index.json")
  assert sharded == (shard is not None)

  cfg, params = hfio.load_hf(str(tmp_path))
  assert cfg == OUR_CASES[arch]  # the same configs are built natively below
  kw = HF_CASES[arch]["kw"]
  assert cfg.n_kv_heads < cfg.n_heads
  assert cfg.vocab_size == kw["vocab_size"] and cfg.rope_theta == kw["rope_theta"]
  assert cfg.tie_embeddings == kw["tie_word_embeddings"]
  assert cfg.qk_norm == (arch == "qwen3") and cfg.qkv_bias
  if arch == "qwen3":
    assert cfg.resolved_head_dim == 24 != cfg.d_model // cfg.n_heads
  if cfg.tie_embeddings:
    assert "lm_head" not in params

  tokens, mask, positions = _padded_batch(cfg.vocab_size)
  _assert_close_at_real_tokens(_our_logits(cfg, params, tokens, mask, positions),
                               hf_logits(model, tokens, mask, positions), mask)


def _random_ours(cfg, seed):
  """Random params in our layout; numpy draws, so no per-shape compilation."""
  abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  rng = np.random.default_rng(seed)
  out = []
  for path, x in leaves:
    noise = rng.standard_normal(x.shape).astype(np.float32)
    is_norm = any("norm" in str(getattr(p, "key", "")) for p in path)
    out.append(jnp.asarray(1.0 + 0.2 * noise if is_norm else 0.15 * noise, x.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


OUR_CASES = {
    "qwen3": ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=24, d_ff=96, rope_theta=5000.0, norm_eps=1e-5,
                         qk_norm=True, qkv_bias=True, o_bias=True),
    "llama": ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2,
                         d_ff=80, rope_theta=20000.0, qkv_bias=True, o_bias=True),
    "qwen2": ModelConfig(vocab_size=270, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1,
                         d_ff=96, rope_theta=1e6, qkv_bias=True, tie_embeddings=True),
}


@pytest.mark.parametrize("arch,shard", [("qwen3", "40KB"), ("llama", "5GB"), ("qwen2", "30KB")])
def test_save_hf_loads_in_transformers(arch, shard, tmp_path):
  cfg = OUR_CASES[arch]
  params = _random_ours(cfg, seed=2)
  files = hfio.save_hf(str(tmp_path), cfg, params, arch=arch, max_shard_size=shard)
  assert (len(files) > 1) == (shard != "5GB")

  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
  assert type(model).__name__ == HF_CASES[arch]["cls"] + "ForCausalLM"
  for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
    assert not info.get(key), (key, info[key])
  tokens, mask, positions = _padded_batch(cfg.vocab_size, seed=3)
  _assert_close_at_real_tokens(_our_logits(cfg, params, tokens, mask, positions),
                               hf_logits(model.eval(), tokens, mask, positions), mask)

  # Our own round trip is exact.
  cfg2, params2 = hfio.load_hf(str(tmp_path), config=cfg)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_tied_checkpoint_with_explicit_lm_head(tmp_path):
  cfg = OUR_CASES["qwen2"]
  params = _random_ours(cfg, seed=1)
  hfio.save_hf(str(tmp_path), cfg, params)
  tensors = load_file(tmp_path / "model.safetensors")
  # Some tied checkpoints also store the (identical) head: accepted.
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  _, loaded = hfio.load_hf(str(tmp_path))
  np.testing.assert_array_equal(loaded["embedding"], params["embedding"])
  # A different head cannot be tied.
  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match="lm_head.weight differs"):
    hfio.load_hf(str(tmp_path))


def test_scalar_head_and_bfloat16_roundtrip(tmp_path):
  cfg = OUR_CASES["llama"].replace(scalar_head=True, param_dtype="bfloat16")
  params = _random_ours(cfg, seed=4)
  hfio.save_hf(str(tmp_path), cfg, params)
  cfg2, params2 = hfio.load_hf(str(tmp_path), dtype="bfloat16", compute_dtype="float32")
  assert cfg2 == cfg
  assert params2["value_head"].dtype == jnp.bfloat16
  jax.tree.map(np.testing.assert_array_equal, params2, params)


# ---------------------------------------------------------------------------
# Config mapping and errors.


def test_config_round_trip_and_transformers_agree():
  for arch, cfg in OUR_CASES.items():
    hf = hfio.config_to_hf(cfg, arch)
    assert hfio.config_from_hf(hf) == cfg
    # transformers parses our dict into the same architecture.
    parsed = transformers.AutoConfig.for_model(**hf).to_dict()
    assert hfio.config_from_hf(parsed) == cfg
  # Old-style config with top-level rope_theta and a null rope_scaling.
  old = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
         "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
         "rope_scaling": None}
  cfg = hfio.config_from_hf(old)
  assert cfg.rope_theta == 500000.0 and cfg.n_kv_heads == 2 and cfg.head_dim is None


BASE_HF = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
           "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.parametrize("change,field", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, "sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"model_type": "mistral"}, "model_type"),
])
def test_unsupported_hf_config_raises(change, field):
  with pytest.raises(ValueError, match=field):
    hfio.config_from_hf({**BASE_HF, **change})


def test_sliding_window_that_covers_no_layer_is_fine():
  cfg = hfio.config_from_hf({**BASE_HF, "use_sliding_window": True, "sliding_window": 8,
                             "max_window_layers": 4})
  assert cfg.n_layers == 4


@pytest.mark.parametrize("cfg,arch,field", [
    (OUR_CASES["qwen3"], "llama", "qk_norm"),
    (OUR_CASES["llama"], "qwen3", "qk_norm"),
    (OUR_CASES["llama"], "qwen2", "o_bias"),
    (OUR_CASES["qwen2"], "llama", "o_bias"),
    (OUR_CASES["llama"], "gpt2", "arch"),
])
def test_config_to_hf_rejects_arch_that_cannot_express_cfg(cfg, arch, field):
  with pytest.raises(ValueError, match=field):
    hfio.config_to_hf(cfg, arch)


@pytest.fixture
def saved_llama(tmp_path):
  cfg = OUR_CASES["llama"]
  hfio.save_hf(str(tmp_path), cfg, _random_ours(cfg, seed=0))
  return tmp_path, cfg


def _edit(path, fn):
  tensors = load_file(path / "model.safetensors")
  fn(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(saved_llama):
  path, _ = saved_llama
  _edit(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
  with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.bias'\]"):
    hfio.load_hf(str(path))


def test_unexpected_tensor_is_named(saved_llama):
  path, _ = saved_llama
  _edit(path, lambda t: t.update({"model.layers.0.mlp.gate_proj.bias": np.zeros(80, np.float32)}))
  with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.mlp.gate_proj.bias'\]"):
    hfio.load_hf(str(path))


def test_wrong_shape_is_named(saved_llama):
  path, _ = saved_llama
  _edit(path, lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}))
  with pytest.raises(ValueError, match=r"model.norm.weight has shape \(65,\), expected \(64,\)"):
    hfio.load_hf(str(path))


def test_other_architecture_names_the_field(saved_llama):
  path, cfg = saved_llama
  with pytest.raises(ValueError, match="vocab_size=260 in the checkpoint, 512 in the config"):
    hfio.load_hf(str(path), config=cfg.replace(vocab_size=512))
  with pytest.raises(ValueError, match="n_layers=2 in the checkpoint, 3 in the config"):
    hfio.load_hf(str(path), config=cfg.replace(n_layers=3))
  # A config.json that lies about the layer count: the tensors give it away.
  hf = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 1}))
  with pytest.raises(ValueError, match="checkpoint has 2 layers, but n_layers=1"):
    hfio.load_hf(str(path))
  # ... or about the vocabulary: the shape error names the field.
  (path / "config.json").write_text(json.dumps({**hf, "vocab_size": 300}))
  with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \(260, 64\).*vocab_size=300"):
    hfio.load_hf(str(path))


def test_params_that_do_not_fit_the_config_raise(tmp_path):
  cfg = OUR_CASES["qwen2"]  # tied
  untied = _random_ours(cfg.replace(tie_embeddings=False), seed=0)
  with pytest.raises(ValueError, match=r"params hold \['lm_head'\].*tie_embeddings=True"):
    hfio.save_hf(str(tmp_path), cfg, untied)
  params = _random_ours(cfg, seed=0)
  params["layers_1"]["attn"]["q"] = params["layers_1"]["attn"]["q"][:, :, :8]
  with pytest.raises(ValueError, match=r"layers_1/attn/q has shape \(64, 4, 8\), expected "
                                       r"\(64, 4, 16\) from n_heads=4, head_dim=16"):
    hfio.save_hf(str(tmp_path), cfg, params)
  assert not os.listdir(tmp_path)  # nothing half-written


def test_bad_paths_and_sizes(tmp_path):
  with pytest.raises(ValueError, match="no config.json"):
    hfio.load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(BASE_HF))
  with pytest.raises(ValueError, match="no model.safetensors"):
    hfio.load_hf(str(tmp_path))
  assert hfio.parse_size("2KiB") == 2048 and hfio.parse_size("3MB") == 3_000_000
  for bad in ("5 parsecs", -1, 0, 1.5):
    with pytest.raises(ValueError, match="max_shard_size"):
      hfio.parse_size(bad)


# ---------------------------------------------------------------------------
# Damaged files and the export's target directory (bad input at the boundary).


def _tree_bytes(root):
  """{relative path: bytes} of every file under ``root``."""
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("content,needle", [
    ("[1, 2, 3]", "must hold a JSON object, got a list"),
    ('"llama"', "must hold a JSON object, got a str"),
    ('{"model_type": "llama", "vocab_size": 32', "cannot read HF config"),
    ("\udcff\udcfe", "cannot read HF config")])
def test_config_json_not_an_object_names_the_file(saved_llama, content, needle):
  # Before: AttributeError ('list' object has no attribute 'get') or a bare
  # JSONDecodeError / UnicodeDecodeError, naming no file.
  path, _ = saved_llama
  (path / "config.json").write_bytes(content.encode("utf-8", "surrogateescape"))
  with pytest.raises(ValueError, match=needle) as e:
    hfio.load_hf(str(path))
  assert f"'{path / 'config.json'}'" in str(e.value)
  with pytest.raises(ValueError, match="HF config must be a JSON object"):
    hfio.config_from_hf([1, 2, 3])


def test_config_field_errors_name_the_file(saved_llama):
  path, _ = saved_llama
  hf = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**hf, "hidden_act": "gelu"}))
  with pytest.raises(ValueError, match=f"^{path / 'config.json'}: HF config hidden_act='gelu'"):
    hfio.load_hf(str(path))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header_only"])
def test_damaged_safetensors_names_the_file(saved_llama, damage):
  # Before: safetensors' SafetensorError ("Error while deserializing header:
  # ..."), not a ValueError and naming no file.
  path, _ = saved_llama
  file = path / "model.safetensors"
  data = file.read_bytes()
  file.write_bytes({"truncated": data[:len(data) // 2], "garbage": b"not a safetensors file",
                    "header_only": data[:20]}[damage])
  with pytest.raises(ValueError, match=f"cannot read safetensors file '{file}'"):
    hfio.load_hf(str(path))


def test_damaged_shard_and_index_name_the_file(tmp_path):
  cfg = OUR_CASES["llama"]
  hfio.save_hf(str(tmp_path), cfg, _random_ours(cfg, seed=0), max_shard_size="40KB")
  index = tmp_path / "model.safetensors.index.json"
  shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
  data = shard.read_bytes()
  shard.write_bytes(data[:-100])  # the last shard lost its tail
  with pytest.raises(ValueError, match=f"cannot read safetensors file '{shard}'"):
    hfio.load_hf(str(tmp_path))
  shard.write_bytes(data)
  text = index.read_text()
  index.write_text(text[:len(text) // 2])
  with pytest.raises(ValueError, match=f"cannot read safetensors index '{index}'"):
    hfio.load_hf(str(tmp_path))
  index.write_text("[]")
  with pytest.raises(ValueError, match=f"safetensors index '{index}' must hold a JSON object"):
    hfio.load_hf(str(tmp_path))
  index.write_text(text)
  assert hfio.load_hf(str(tmp_path))[0] == cfg  # repaired: loads again


def test_save_hf_refuses_a_non_empty_directory_unless_overwrite(saved_llama):
  # Before: the earlier export's weights were deleted and replaced without a word.
  path, cfg = saved_llama
  (path / "README.md").write_text("my notes")
  before = _tree_bytes(path)
  new = _random_ours(cfg, seed=9)
  with pytest.raises(ValueError, match=(f"save_hf path '{path}' is not empty \\(it holds README.md, "
                                        "config.json, model.safetensors\\); pass overwrite=True")):
    hfio.save_hf(str(path), cfg, new)
  assert _tree_bytes(path) == before
  hfio.save_hf(str(path), cfg, new, overwrite=True)
  _, loaded = hfio.load_hf(str(path), config=cfg)
  jax.tree.map(np.testing.assert_array_equal, loaded, new)
  assert (path / "README.md").read_text() == "my notes"  # files that are not the export stay


def test_save_hf_never_writes_into_an_orbax_checkpoint(tmp_path):
  # Before: the export landed in (and mixed with) the checkpoint directory.
  import orbax.checkpoint as ocp
  cfg = OUR_CASES["qwen2"]
  params = _random_ours(cfg, seed=0)
  workdir = tmp_path / "run"
  with ocp.CheckpointManager(workdir / "checkpoints") as mngr:
    mngr.save(3, args=ocp.args.StandardSave({"w": np.arange(4.0)}))
    mngr.wait_until_finished()
  before = _tree_bytes(workdir)
  for target in (workdir, workdir / "checkpoints", workdir / "checkpoints" / "3"):
    for overwrite in (False, True):
      with pytest.raises(ValueError, match=f"save_hf path '{target}' holds an Orbax checkpoint"):
        hfio.save_hf(str(target), cfg, params, overwrite=overwrite)
  assert _tree_bytes(workdir) == before
