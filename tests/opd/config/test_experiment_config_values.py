"""The experiment configs set only what differs from the dataclass defaults
(``opd.config.fields.to_group``), yet build exactly the dataclasses they built
when every field was spelled out in the file.

``SPELLED_OUT`` is those full field lists, copied from the config files as they
were at commit f16cbda (before the defaults moved into the dataclasses). It
pins every effective value of every experiment, so the test also fails when a
dataclass default changes under an experiment that relied on it.
"""
import pytest

from experiments import grpo as grpo_job
from experiments.common import optim_config
from opd.config import overrides as config_utils
from opd.config.fields import from_group
from opd.eval.evaluation import EvalConfig
from opd.models import ModelConfig, to_model_config
from opd.rl.config import GRPOConfig
from opd.tasks import ALL_DOMAINS, AgentRewardConfig
from opd.training.optim import OptimConfig

MODEL = dict(vocab_size=270, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=None,
             d_ff=384, rope_theta=10_000.0, norm_eps=1e-6, qk_norm=True, qkv_bias=False,
             o_bias=False, tie_embeddings=True, scalar_head=False, dtype="float32",
             param_dtype="float32", remat=False,
             # Added since f16cbda with defaults that keep the dense GQA model: the
             # mixture-of-experts and multi-head latent attention sub-configs (DESIGN §2).
             moe=None, mla=None,
             # Added with DeepSeek-V4 in the family (#29): None keeps the other decoders.
             v4=None,
             # Added with the task tokenizer in the model config (#26): the byte world.
             tokenizer="byte")
MODEL_TINY = dict(MODEL, d_model=32, n_layers=2, d_ff=64)
PRETRAIN_OPTIM = dict(lr=3e-3, warmup_steps=10, decay_steps=90, schedule="cosine",
                      end_lr_ratio=0.1, weight_decay=0.01, b1=0.9, b2=0.95, eps=1e-8,
                      clip_norm=1.0, grad_accum_steps=1)
SFT_OPTIM = dict(lr=1e-3, warmup_steps=10, decay_steps=70, schedule="cosine", end_lr_ratio=0.1,
                 weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8, clip_norm=1.0, grad_accum_steps=1)
GRPO_OPTIM = dict(lr=2e-4, warmup_steps=2, decay_steps=0, schedule="constant", end_lr_ratio=1.0,
                  weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0, grad_accum_steps=1)
GRPO = dict(group_size=8, prompts_per_step=8, clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1,
            scale_advantages_by_std=True, advantage_eps=1e-6, loss_aggregation="token_mean",
            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=80, updates_per_batch=1,
            seq_len=256, length_bucket=32, max_error_fraction=0.1, num_text_samples=4,
            domain_balance=False)  # added since f16cbda; False keeps the old prompt stream
GRPO_TINY = dict(GRPO, group_size=4, prompts_per_step=2, max_new_tokens=16, seq_len=128)
AGENT_REWARD = dict(format=0.30, execution=0.25, step=0.20, final_answer=0.25, grm=0.0, user=0.0)
EVAL = dict(n_per_domain=60, difficulty=1, seed=0, greedy=True, num_samples=4, temperature=1.0,
            top_p=1.0, max_new_tokens=80, bootstrap_samples=1000, batch_size=64,
            prompt_bucket=64, solved_threshold=1.0, num_transcripts=2,
            all_if_fewer=False)  # added with the strong world (#26): refuse short splits
EVAL_TINY = dict(EVAL, n_per_domain=4, num_samples=2, max_new_tokens=16, batch_size=8,
                 bootstrap_samples=50)


def _spelled_out(name: str, tiny: bool) -> dict[str, tuple[type, dict]]:
  """``{group path: (dataclass, fields)}`` as the f16cbda config files set them."""
  model = MODEL_TINY if tiny else MODEL
  pre = dict(PRETRAIN_OPTIM, warmup_steps=2, decay_steps=8) if tiny else PRETRAIN_OPTIM
  sft = dict(SFT_OPTIM, warmup_steps=1, decay_steps=4) if tiny else SFT_OPTIM
  grpo = GRPO_TINY if tiny else GRPO
  return {
      "pretrain": {"model": model, "optim": pre},
      "sft": {"model": model, "optim": sft},
      "grpo": {"model": model, "optim": GRPO_OPTIM, "grpo": grpo, "agent_reward": AGENT_REWARD},
      "specialists": {"model": model, "base.optim": pre, "sft.optim": sft, "grpo": grpo,
                      "grpo_optim": GRPO_OPTIM, "agent_reward": AGENT_REWARD,
                      "eval": EVAL_TINY if tiny else EVAL},
  }[name]


# Each group's dataclass and how a job builds it (the eval job adds the domains).
BUILD = {"model": (ModelConfig, to_model_config),
         "optim": (OptimConfig, optim_config),
         "grpo": (GRPOConfig, grpo_job.grpo_config),
         "agent_reward": (AgentRewardConfig, grpo_job.agent_reward_config),
         "eval": (EvalConfig, lambda g, where: from_group(EvalConfig, g, where,
                                                          domains=ALL_DOMAINS))}


def _group(config, path):
  for part in path.split("."):
    config = config[part]
  return config


@pytest.mark.parametrize("name", ["pretrain", "sft", "grpo", "specialists"])
@pytest.mark.parametrize("tiny", [False, True], ids=["default", "tiny"])
def test_configs_build_the_spelled_out_dataclasses(name, tiny):
  config = config_utils.load_config(f"experiments/configs/{name}.py" + (":tiny" if tiny else ""))
  for path, fields in _spelled_out(name, tiny).items():
    leaf = path.rsplit(".", 1)[-1]
    cls, build = BUILD["optim" if leaf == "grpo_optim" else leaf]
    extra = {"domains": ALL_DOMAINS} if cls is EvalConfig else {}
    assert build(_group(config, path), f"config.{path}") == cls(**fields, **extra), path
    # Every field is in the group (so any can be overridden on the command
    # line), except the eval group's domains, which the job sets.
    assert sorted(_group(config, path).keys()) == sorted(fields), path


def test_unwritten_field_can_be_overridden_with_its_type_checked():
  config = config_utils.load_config("experiments/configs/pretrain.py:tiny")
  # b1, clip_norm and head_dim are not written in the file: the dataclass's defaults.
  config_utils.apply_overrides(config, ["optim.b1=0.8", "optim.grad_accum_steps=2",
                                        "model.head_dim=16"])
  optim = optim_config(config.optim)
  assert (optim.b1, optim.grad_accum_steps, optim.lr) == (0.8, 2, 3e-3)
  assert to_model_config(config.model) == ModelConfig(**dict(MODEL_TINY,
                                                                           head_dim=16))
  for override, expects in [("optim.grad_accum_steps=two", "int"),
                            ("model.head_dim=2.5", "int"), ("optim.clip_norm=big", "float")]:
    with pytest.raises(ValueError, match=rf"config field '{override.split('=')[0]}' expects "
                                         rf"{expects}"):
      config_utils.apply_overrides(config, [override])
