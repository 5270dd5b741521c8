"""YaRN on DeepSeek-V4's compressed branches (``V4Config.compress_yarn``,
``rope_parameters["compress"]`` with ``rope_type="yarn"``): the mixed stack's logits
against transformers' DeepseekV4ForCausalLM, the HF import / export round trip, and
the config forms transformers accepts (nested, flat, legacy ``rope_scaling``)."""
import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from opd.models import forward
from opd.models.hf import load_hf, save_hf
from opd.models.hf_v4 import config_from_hf
from opd.models.v4.config import V4YaRN
from opd.models.v4.rope import inv_frequencies
from test_model_v4 import family_config, family_params
from v4_torch import mixed_model, np_, rel_err

B, T = 2, 20  # > sliding_window = 8, 5 CSA windows (m = 4), 2 HCA windows (m = 8)
# factor 4 over an original context of 64 positions: with Dr = 8 and θ = 160000, pair 0
# keeps its frequency and pairs 1..3 are divided by 4 (their wavelengths, >= 126 tokens,
# exceed the original context); no attention_factor, so transformers derives
# m(4, 1) = 0.1 ln 4 + 1 for cos and sin.
YARN = {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.5,
        "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0}
ROPE = {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": YARN}
WANT = V4YaRN(factor=4.0, original_max_position=64, beta_fast=32.0, beta_slow=1.0,
              attention_factor=0.1 * math.log(4.0) + 1.0)
# Tolerance: the computation of test_model_v4's parity (same stack, fp32, measured ~1e-6
# there); YaRN only changes the angles (fp32 products of positions <= 20 and frequencies).
TOL = 1e-4


@pytest.fixture(scope="module")
def case():
  c, model = mixed_model(seed=41, rope_parameters=ROPE, max_position_embeddings=256)
  ids = np.random.default_rng(9).integers(0, c.vocab_size, size=(B, T))
  with torch.no_grad():
    logits = np_(model(input_ids=torch.from_numpy(ids)).logits)
  return c, model, ids, logits


def test_frequencies_match_transformers(case):
  # transformers' compress rotary (its _compute_yarn_parameters) against ours, and the
  # blend by hand: pair 0 kept, pairs 1..3 divided by the factor (see YARN above).
  c, model, _, _ = case
  rot = model.model.rotary_emb
  ours = np.asarray(inv_frequencies(8, 160000.0, WANT))
  np.testing.assert_allclose(ours, rot.compress_inv_freq.numpy(), rtol=1e-6)
  plain = 160000.0 ** -(np.arange(0, 8, 2) / 8)
  np.testing.assert_allclose(ours, plain / np.array([1, 4, 4, 4]), rtol=1e-6)
  assert rot.compress_attention_scaling == pytest.approx(WANT.attention_factor)


def test_yarn_stack_matches_transformers(case):
  c, model, ids, logits_t = case
  cfg = family_config(c)
  cfg = cfg.replace(v4=dataclasses.replace(cfg.v4, compress_yarn=WANT))
  params = family_params(model, cfg)
  err = rel_err(forward(cfg, params, jnp.asarray(ids)).logits, logits_t)
  print("V4 mixed stack with compress YaRN, logits parity (max rel err):", err)
  assert err <= TOL
  # The scaling matters at this length: plain RoPE on the same weights misses by far more.
  plain = cfg.replace(v4=dataclasses.replace(cfg.v4, compress_yarn=None))
  assert rel_err(forward(plain, params, jnp.asarray(ids)).logits, logits_t) > 100 * TOL


def test_yarn_checkpoint_round_trip(case, tmp_path):
  c, model, ids, logits_t = case
  model.save_pretrained(str(tmp_path / "hf"))
  cfg, params = load_hf(str(tmp_path / "hf"))
  assert cfg.v4.compress_yarn == WANT
  assert rel_err(forward(cfg, params, jnp.asarray(ids)).logits, logits_t) <= TOL
  out = str(tmp_path / "ours")
  save_hf(out, cfg, params)
  written = json.load(open(os.path.join(out, "config.json")))["rope_parameters"]["compress"]
  assert written["rope_type"] == "yarn" and written["factor"] == 4.0
  cfg2, _ = load_hf(out)
  assert cfg2 == cfg
  back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  assert back.model.rotary_emb.compress_attention_scaling == pytest.approx(
      WANT.attention_factor)
  with torch.no_grad():
    logits = np_(back(input_ids=torch.from_numpy(ids)).logits)
  assert rel_err(logits, logits_t) <= TOL


def test_yarn_config_forms(case, tmp_path):
  c, model, _, _ = case
  model.save_pretrained(str(tmp_path))
  hf = json.load(open(tmp_path / "config.json"))
  flat = {k: v for k, v in YARN.items() if k not in ("rope_theta", "partial_rotary_factor")}
  # transformers' flat form and the legacy rope_scaling (with "type") put YaRN on the
  # compress branch only, with attention_factor 1 (DeepSeek-V4's reference).
  for form in ({"rope_parameters": flat}, {"rope_parameters": None, "rope_scaling": {
      **{k: v for k, v in flat.items() if k != "rope_type"}, "type": "yarn"}}):
    cfg = config_from_hf({**hf, **form}, dtype="float32", param_dtype="float32")
    assert cfg.v4.compress_yarn == dataclasses.replace(WANT, attention_factor=1.0)
    assert cfg.rope_theta == hf["rope_theta"]
  nested = lambda **kw: {"rope_parameters": {**hf["rope_parameters"], "compress": {
      **hf["rope_parameters"]["compress"], **kw}}}
  mscale = config_from_hf({**hf, **nested(attention_factor=None, mscale=2.0,
                                          mscale_all_dim=1.0)},
                          dtype="float32", param_dtype="float32")
  m = lambda a: 0.1 * a * math.log(4.0) + 1.0  # transformers' get_mscale
  assert mscale.v4.compress_yarn.attention_factor == pytest.approx(m(2.0) / m(1.0))
  for change, match in (
      (nested(truncate=False), r"rope_parameters\['compress'\] \(YaRN\) sets \{'truncate'"),
      (nested(factor=None), r"rope_parameters\['compress'\] \(YaRN\) lacks 'factor'"),
      (nested(rope_type="longrope"), r"rope_parameters\['compress'\].rope_type='longrope'"),
      ({"rope_parameters": {**hf["rope_parameters"], "main": {
          **hf["rope_parameters"]["main"], "rope_type": "yarn", "factor": 2.0}}},
       r"rope_parameters\['main'\].rope_type='yarn'")):
    with pytest.raises(ValueError, match=match):
      config_from_hf({**hf, **change}, dtype="float32", param_dtype="float32")
