"""DeepSeek-V3 HF interop: logits parity with ``transformers`` both ways, MTP tensors, errors.

The reference is ``transformers``' ``DeepseekV3ForCausalLM`` on random tiny
configs built here, fp32 on CPU with eager attention, on a batch with a
full, a left-padded and a right-padded row.
"""
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from opd.models import ModelConfig, forward, init_params
from opd.models import hf as hfio
from opd.models.config import MLAConfig, YaRNConfig
from opd.models.moe import MoEConfig
from hf_batches import hf_logits, padded_batch

B, T = 3, 11
EPS32 = float(np.finfo(np.float32).eps)

# Two tiny configs: a compressed query with DeepSeek's interleaved RoPE
# layout (as its checkpoints), and a direct query projection with the
# rotate-half layout; rms_norm_eps != 1e-6 so the latent norms' fixed eps is
# checked. first_k_dense_replace = num_hidden_layers: every MLP is dense,
# except in "moe": layer 0 dense, layer 1 DeepSeekMoE (sigmoid router with a
# selection bias, 4 groups of 2 experts of which 2 are kept, 3 of 8 experts
# per token, renormalised and scaled by 2.5, one shared expert) with YaRN
# RoPE scaling (an 8-token original context, so the ramp splits the 4
# frequencies; mscale != mscale_all_dim, so cos/sin and the softmax scale
# both change).
HF_CASES = {
    "q_lora_interleave": dict(shard="30KB", kw=dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True,
        rope_theta=5000.0, rms_norm_eps=1e-5, first_k_dense_replace=2,
        tie_word_embeddings=False)),
    "direct_q_halves": dict(shard=None, kw=dict(
        vocab_size=260, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=12, v_head_dim=16, rope_interleave=False,
        rope_theta=20000.0, rms_norm_eps=1e-6, first_k_dense_replace=2,
        tie_word_embeddings=True)),
    "moe": dict(shard="40KB", kw=dict(
        vocab_size=280, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                             original_max_position_embeddings=8, beta_fast=32.0,
                             beta_slow=1.0, mscale=0.8, mscale_all_dim=1.0),
        max_position_embeddings=320,
        rms_norm_eps=1e-6, first_k_dense_replace=1,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, tie_word_embeddings=False)),
}
OUR_CASES = {
    "q_lora_interleave": ModelConfig(
        vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=96,
        rope_theta=5000.0, norm_eps=1e-5,
        mla=MLAConfig(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True)),
    "direct_q_halves": ModelConfig(
        vocab_size=260, d_model=48, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=80,
        rope_theta=20000.0, tie_embeddings=True,
        mla=MLAConfig(kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=12,
                      v_head_dim=16)),
    "moe": ModelConfig(
        vocab_size=280, d_model=48, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=80,
        mla=MLAConfig(kv_lora_rank=24, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, rope_interleave=True,
                      yarn=YaRNConfig(factor=40.0, original_max_position=8, mscale=0.8,
                                      mscale_all_dim=1.0)),
        moe=MoEConfig(n_routed_experts=8, experts_per_token=3, moe_d_ff=24, n_shared_experts=1,
                      router="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                      n_group=4, topk_group=2, first_k_dense=1)),
}


def _rel_tol(cfg):
  """Both sides compute in float32, each off by ~sqrt(n)·eps relative per
  rounded step (n <= the widest contraction); per layer ~18 steps (two
  latent norms, five projections, RoPE, scores, softmax, mixing, MLP,
  residuals), + final norm and head, adding in quadrature; the max over the
  logits within ~4 standard deviations; the two sides' errors add. Relative
  to the logits' RMS."""
  widest = max(cfg.d_model, cfg.d_ff, cfg.mla.kv_lora_rank, T, 1 if cfg.moe is None else (
      cfg.moe.experts_per_token + cfg.moe.n_shared_experts) * cfg.moe.moe_d_ff)
  steps = 18 * cfg.n_layers + 2
  return 2 * 4 * np.sqrt(steps) * np.sqrt(widest) * EPS32


def _padded_batch(vocab, seed=0):
  return padded_batch(vocab, B, T, seed)




def _our_logits(cfg, params, tokens, mask, positions):
  return np.asarray(forward(cfg, params, jnp.asarray(tokens), jnp.asarray(positions),
                            jnp.asarray(mask)).logits)


def _assert_close_at_real_tokens(cfg, ours, ref, mask):
  assert ours.shape == ref.shape
  assert ref[mask].std() > 0.3, ref[mask].std()  # the comparison has power
  rms = np.sqrt(np.mean(np.square(ref[mask], dtype=np.float64)))
  diff = np.abs(ours[mask] - ref[mask]).max()
  tol = _rel_tol(cfg) * rms
  assert diff <= tol, f"max |ours - transformers| = {diff} > {tol} (rms {rms})"
  return diff / rms


def _random_hf_model(case, seed=0):
  config = transformers.DeepseekV3Config(**HF_CASES[case]["kw"])
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = transformers.DeepseekV3ForCausalLM(config).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    # Unit norms and std-0.02 weights would hide swapped norm tensors and
    # make attention near-uniform (a wrong RoPE layout would barely show).
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):  # shifts which experts are chosen
        b.copy_(0.3 * torch.randn(b.shape, generator=g))
  return model


def _random_ours(cfg, seed):
  """Random params in our layout (numpy draws), scaled as ``_random_hf_model``."""
  abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  rng = np.random.default_rng(seed)
  out = []
  for path, x in leaves:
    noise = rng.standard_normal(x.shape).astype(np.float32)
    is_norm = any("norm" in str(getattr(p, "key", "")) for p in path)
    out.append(jnp.asarray(1.0 + 0.2 * noise if is_norm else 0.15 * noise, x.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_load_hf_matches_transformers(case, tmp_path):
  model = _random_hf_model(case)
  shard = HF_CASES[case]["shard"]
  model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
  assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)

  cfg, params = hfio.load_hf(str(tmp_path))
  assert cfg == OUR_CASES[case]
  if cfg.moe is not None:  # the selection bias is a buffer in transformers, loaded all the same
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias.numpy()
    np.testing.assert_array_equal(np.asarray(params["layers_1"]["mlp"]["selection_bias"]), bias)
  tokens, mask, positions = _padded_batch(cfg.vocab_size)
  rel = _assert_close_at_real_tokens(cfg, _our_logits(cfg, params, tokens, mask, positions),
                                     hf_logits(model, tokens, mask, positions), mask)
  print(f"{case}: max |ours - transformers| / rms = {rel:.2e}")


@pytest.mark.parametrize("case,shard", [("q_lora_interleave", "5GB"),
                                        ("direct_q_halves", "20KB"), ("moe", "40KB")])
def test_save_hf_loads_in_transformers_and_round_trips(case, shard, tmp_path):
  cfg = OUR_CASES[case]
  params = _random_ours(cfg, seed=2)
  files = hfio.save_hf(str(tmp_path), cfg, params, max_shard_size=shard)
  assert (len(files) > 1) == (shard != "5GB")
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
  assert type(model).__name__ == "DeepseekV3ForCausalLM"
  for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
    assert not info.get(key), (key, info[key])
  kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
  assert kinds == ["DeepseekV3MLP", "DeepseekV3MLP" if cfg.moe is None else "DeepseekV3MoE"]
  tokens, mask, positions = _padded_batch(cfg.vocab_size, seed=3)
  _assert_close_at_real_tokens(cfg, _our_logits(cfg, params, tokens, mask, positions),
                               hf_logits(model.eval(), tokens, mask, positions), mask)
  cfg2, params2 = hfio.load_hf(str(tmp_path), config=cfg)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def _add_tensors(path, extra):
  file = path / "model.safetensors"
  tensors = load_file(file)
  tensors.update(extra)
  save_file(tensors, file, metadata={"format": "pt"})


def _set_config(path, **fields):
  data = json.loads((path / "config.json").read_text())
  data.update(fields)
  (path / "config.json").write_text(json.dumps(data))


def test_mtp_tensors_are_dropped_with_a_warning(tmp_path, caplog):
  cfg = OUR_CASES["direct_q_halves"]
  params = _random_ours(cfg, seed=4)
  hfio.save_hf(str(tmp_path), cfg, params)
  D = cfg.d_model
  mtp = {f"model.layers.{cfg.n_layers}.{name}": np.ones(shape, np.float32)
         for name, shape in (("eh_proj.weight", (D, 2 * D)), ("enorm.weight", (D,)),
                             ("self_attn.kv_a_layernorm.weight", (24,)))}
  _add_tensors(tmp_path, mtp)
  # Without a declared MTP layer the extra layer is an unexpected tensor.
  with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.2\.eh_proj"):
    hfio.load_hf(str(tmp_path))
  _set_config(tmp_path, num_nextn_predict_layers=1)
  with caplog.at_level(logging.WARNING, logger="opd.models.hf_deepseek"):
    cfg2, params2 = hfio.load_hf(str(tmp_path))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  assert "dropping 3 multi-token-prediction tensors of layer(s) [2]" in caplog.text
  # A layer past the declared MTP layers is still refused.
  _add_tensors(tmp_path, {"model.layers.3.enorm.weight": np.ones((D,), np.float32)})
  with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.3\.enorm"):
    hfio.load_hf(str(tmp_path))


@pytest.mark.parametrize("change,field", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(kv_lora_rank=None), "kv_lora_rank"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "attention_factor": 1.2}), "attention_factor"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "lacks 'factor'"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
])
def test_unsupported_deepseek_config_names_the_field(change, field):
  hf = hfio.config_to_hf(OUR_CASES["moe"])
  hf.update(change)
  with pytest.raises(ValueError, match=field):
    hfio.config_from_hf(hf)


def test_config_round_trip_and_transformers_reads_it():
  for cfg in OUR_CASES.values():
    hf = hfio.config_to_hf(cfg)
    assert hf["first_k_dense_replace"] == (2 if cfg.moe is None else 1)
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"]
    assert hfio.config_from_hf(hf) == cfg
    tc = transformers.DeepseekV3Config(**{k: v for k, v in hf.items() if k != "architectures"})
    assert (tc.kv_lora_rank, tc.q_lora_rank, tc.qk_head_dim, tc.head_dim) == (
        cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank, cfg.resolved_head_dim,
        cfg.mla.qk_rope_head_dim)
  with pytest.raises(ValueError, match="arch='llama' does not fit cfg.mla"):
    hfio.config_to_hf(OUR_CASES["direct_q_halves"], arch="llama")
  with pytest.raises(ValueError, match="arch='deepseek_v3' does not fit cfg.mla=None"):
    hfio.config_to_hf(ModelConfig(vocab_size=64, d_model=16, n_heads=2, d_ff=32),
                      arch="deepseek_v3")
