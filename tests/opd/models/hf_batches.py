"""Shared inputs for the HF parity tests (test_hf, test_hf_moe, test_hf_deepseek)."""
import numpy as np
import torch


def padded_batch(vocab: int, batch: int, length: int, seed: int = 0):
  """``[batch, length]`` random ids: row 0 full, row 1 left-padded, row 2 right-padded."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  mask = np.ones((batch, length), bool)
  mask[1, :3] = False
  mask[2, -4:] = False
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def hf_forward(model, tokens, mask, positions, **kwargs):
  """``transformers``' own forward on the same (ids, mask, positions), without gradients."""
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens).long(),
                 attention_mask=torch.from_numpy(mask.astype(np.int64)),
                 position_ids=torch.from_numpy(positions).long(), **kwargs)


def hf_logits(model, tokens, mask, positions):
  """float32 numpy logits of ``hf_forward``."""
  return hf_forward(model, tokens, mask, positions).logits.float().numpy()
