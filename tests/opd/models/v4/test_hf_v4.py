"""DeepSeek-V4 checkpoints (opd.models.hf_v4): a tiny random transformers
DeepseekV4ForCausalLM saved with ``save_pretrained`` loads through ``load_hf`` into the
family's ``ModelConfig.v4`` with logits parity, single-file and sharded; ``save_hf``
writes what transformers loads back to the same logits; unsupported fields fail naming
them."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from opd.models import forward
from opd.models.hf import load_hf, save_hf
from test_model_v4 import family_config, family_params
from v4_torch import mixed_model, np_, rel_err

B, T = 2, 20  # > sliding_window = 8, 5 CSA windows, 2 HCA windows
# Tolerance: the same computation as test_model_v4's parity (measured ~1e-6 there).
TOL = 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  c, model = mixed_model(seed=31)
  path = str(tmp_path_factory.mktemp("v4_hf"))
  model.save_pretrained(path)
  ids = np.random.default_rng(7).integers(0, c.vocab_size, size=(B, T))
  with torch.no_grad():
    logits = np_(model(input_ids=torch.from_numpy(ids)).logits)
  return c, model, path, ids, logits


def test_load_matches_transformers(saved):
  c, model, path, ids, logits_t = saved
  cfg, params = load_hf(path)
  assert cfg == family_config(c)
  # The loaded tree is the one the direct module-by-module mapping builds.
  direct = family_params(model, cfg)
  assert jax.tree.structure(params) == jax.tree.structure(direct)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(direct)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  err = rel_err(forward(cfg, params, jnp.asarray(ids)).logits, logits_t)
  print("V4 HF import logits parity (max rel err):", err)
  assert err <= TOL


def test_save_round_trip_and_shards(saved, tmp_path):
  c, _, path, ids, logits_t = saved
  cfg, params = load_hf(path)
  out = str(tmp_path / "ours")
  files = save_hf(out, cfg, params, max_shard_size="20KB")
  assert len(files) > 1 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  cfg2, params2 = load_hf(out)  # sharded load
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  np.testing.assert_array_equal(back.model.layers[0].mlp.gate.tid2eid.numpy(),
                                np.asarray(params["layers_0"]["mlp"]["tid2eid"]).reshape(
                                    c.vocab_size, -1))
  with torch.no_grad():
    logits = np_(back(input_ids=torch.from_numpy(ids)).logits)
  assert rel_err(logits, logits_t) <= TOL


def test_unsupported_checkpoints_fail_naming_the_field(saved, tmp_path):
  c, _, path, _, _ = saved
  hf = json.load(open(os.path.join(path, "config.json")))
  # YaRN is built for the compressed branches only (test_yarn_v4); the main one refuses it.
  bad = {"rope_parameters": {**hf["rope_parameters"],
                             "main": {**hf["rope_parameters"]["main"],
                                      "rope_type": "yarn", "factor": 4.0}}}
  for change, match in ((bad, r"rope_parameters\['main'\].rope_type='yarn'"),
                        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
                        ({"n_shared_experts": 2}, "n_shared_experts=2"),
                        ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
                         r"quantization_config \(quant_method='fp8'\) is not supported"),
                        ({"layer_types": [hf["layer_types"][0], "linear_attention",
                                          hf["layer_types"][2]]},
                         r"layer_types\[1\]='linear_attention' is not supported"),
                        ({"mlp_layer_types": ["hash_moe", "moe", "dense"]},
                         r"mlp_layer_types\[2\]='dense' is not supported"),
                        ({"scoring_func": "relu"}, "scoring_func='relu' is not supported")):
    d = tmp_path / str(len(os.listdir(tmp_path)))
    d.mkdir()
    json.dump({**hf, **change}, open(d / "config.json", "w"))
    os.symlink(os.path.join(path, "model.safetensors"), d / "model.safetensors")
    with pytest.raises(ValueError, match=match):
      load_hf(str(d))
  # A checkpoint whose schedule disagrees with its tensors names the tensors.
  d = tmp_path / "schedule"
  d.mkdir()
  json.dump({**hf, "mlp_layer_types": ["moe"] * 3}, open(d / "config.json", "w"))
  os.symlink(os.path.join(path, "model.safetensors"), d / "model.safetensors")
  with pytest.raises(ValueError, match=r"missing \['model.layers.0.ffn.gate.bias'\].*"
                                       r"unexpected \['model.layers.0.ffn.gate.tid2eid'\]"):
    load_hf(str(d))


def test_mtp_tensors_are_dropped_with_a_warning(saved, tmp_path, caplog):
  # A checkpoint with one multi-token-prediction layer, in both namings: transformers'
  # model.layers.{n_layers} (num_nextn_predict_layers = 1) and DeepSeek's own mtp.0.*.
  from safetensors.numpy import load_file, save_file
  c, _, path, ids, logits_t = saved
  tensors = load_file(os.path.join(path, "model.safetensors"))
  extra = {"model.layers.3.attn.wq_a.weight": np.ones((4, 4), np.float32),
           "mtp.0.enorm.weight": np.ones(4, np.float32),
           "mtp.0.ffn.experts.0.w1.weight": np.ones((4, 4), np.float32)}
  save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
  hf = json.load(open(os.path.join(path, "config.json")))
  json.dump({**hf, "num_nextn_predict_layers": 1}, open(tmp_path / "config.json", "w"))
  with caplog.at_level("WARNING"):
    cfg, params = load_hf(str(tmp_path))
  assert "dropping 1 multi-token-prediction" in caplog.text  # model.layers.3
  assert "dropping 2 multi-token-prediction tensors (mtp.0." in caplog.text
  assert rel_err(forward(cfg, params, jnp.asarray(ids)).logits, logits_t) <= TOL
  # Any other stray tensor is still refused, named.
  save_file({**tensors, "model.extra.weight": np.ones(4, np.float32)},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"unexpected \['model.extra.weight'\]"):
    load_hf(str(tmp_path))
