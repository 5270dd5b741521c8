"""Cold start (opd/distill/cold_start.py): only verified-correct teacher answers become SFT data.

The teacher is built to answer every prompt with the same text: a one-layer
model with D >= V whose attention and MLP outputs are zero and whose token
embeddings are orthogonal, so its logits depend on the current token only
(a bigram table); its head sends the prompt's last token to "A", "A" to
"n", ..., and "4" to ``<|end|>``: it writes "Answer: 4" (all distinct
bytes) and stops. The math verifier then accepts it exactly on the prompts
whose answer is 4, which the test knows from the examples' references.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd import rollout as rollout_lib
from opd.distill.cold_start import AnswerSampling, teacher_sft_pairs
from opd.distill.teachers import Teacher
from opd.models import ModelConfig, init_params
from opd.tasks import get_task
from opd.text.tokenizers import END, ByteTokenizer
from opd.training.data import DataConfig, sft_dataset

TOK = ByteTokenizer()
V = TOK.vocab_size
BIGRAM = ModelConfig(vocab_size=V, d_model=272, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=32)
ANSWER = "Answer: 4"


def answering_teacher(first_token: int, domain="math", bonus=30.0) -> Teacher:
  p = init_params(BIGRAM, jax.random.key(0))
  layer = dict(p["layers_0"])
  layer["attn"] = {**layer["attn"], "o": jnp.zeros_like(layer["attn"]["o"])}
  layer["mlp"] = {**layer["mlp"], "down": jnp.zeros_like(layer["mlp"]["down"])}
  emb = np.eye(V, BIGRAM.d_model, dtype=np.float32)  # token v -> unit vector e_v
  chain = [first_token] + TOK.encode(ANSWER) + [TOK.token_to_id(END)]
  head = np.zeros((BIGRAM.d_model, V), np.float32)
  for a, b in zip(chain[:-1], chain[1:]):
    head[a, b] = bonus / np.sqrt(BIGRAM.d_model)  # RMSNorm scales e_v by sqrt(D)
  return Teacher("math_teacher", BIGRAM, {**p, "layers_0": layer, "embedding": jnp.asarray(emb),
                                          "lm_head": jnp.asarray(head)}, domain)


def test_only_verified_answers_are_kept_and_rejections_are_counted():
  examples = get_task("math").examples("train", 120, seed=0, difficulty=1)
  fours = [ex for ex in examples if ex.reference_text == ANSWER][:3]
  others = [ex for ex in examples if ex.reference_text != ANSWER][:5]
  assert len(fours) == 3 and len(others) == 5
  last = int(rollout_lib.prompt_ids(TOK, fours[0])[-1])
  assert all(int(rollout_lib.prompt_ids(TOK, ex)[-1]) == last for ex in others)
  teacher = answering_teacher(last)
  data = teacher_sft_pairs([teacher], fours + others,
                           AnswerSampling(max_new_tokens=16, temperature=1.0,
                                          samples_per_prompt=2, batch_size=8), tokenizer=TOK)
  assert data.metrics["cold_start/math_teacher/answered"] == 16
  assert data.metrics["cold_start/kept"] == data.metrics["cold_start/math_teacher/kept"] == 6
  assert data.metrics["cold_start/rejected"] == 10
  assert data.metrics["cold_start/rejected/wrong_answer"] == 10
  assert sorted({ep.example.id for ep in data.episodes}) == sorted(ex.id for ex in fours)
  for (ids, mask), ep in zip(data.pairs, data.episodes):
    n = len(ep.prompt_ids)
    np.testing.assert_array_equal(ids[:n], rollout_lib.prompt_ids(TOK, ep.example))
    assert not mask[:n].any() and mask[n:].all()
    assert TOK.decode(ids[n:-1]) == ANSWER and ids[-1] == TOK.token_to_id(END)
  # The pairs are what the SFT objective's batches take.
  batch = next(iter(sft_dataset(data.pairs, DataConfig(seq_len=64, batch_size=2,
                                                       pad_id=TOK.pad_id))))
  assert batch["loss_mask"].sum() == 2 * (len(TOK.encode(ANSWER)) + 1)


def test_prompts_without_a_teacher_or_verifier_are_rejected():
  teacher = answering_teacher(0)
  math = get_task("math").examples("train", 1, seed=0, difficulty=1)
  code = get_task("code").examples("train", 1, seed=0, difficulty=1)
  with pytest.raises(ValueError, match="domain='code' has no teacher"):
    teacher_sft_pairs([teacher], math + code, AnswerSampling(max_new_tokens=4), tokenizer=TOK)
  with pytest.raises(ValueError, match="teachers=\\[\\]"):
    teacher_sft_pairs([], math, AnswerSampling(max_new_tokens=4), tokenizer=TOK)
  bad = [math[0].__class__("nowhere", "x", "train", 1, "hi", (("assistant", "x"),), {})]
  with pytest.raises(ValueError, match="domain='nowhere', which has no verifier"):
    teacher_sft_pairs([teacher], bad, AnswerSampling(max_new_tokens=4), tokenizer=TOK)


def test_a_correct_answer_cut_at_the_token_limit_is_rejected_and_counted():
  """The teacher writes "Answer: 4" (right on these prompts) and would then
  stop; with max_new_tokens = len("Answer: 4") it is cut before its stop
  token: the answer is truncated, so it is never an SFT pair."""
  examples = get_task("math").examples("train", 120, seed=0, difficulty=1)
  fours = [ex for ex in examples if ex.reference_text == ANSWER][:3]
  assert len(fours) == 3
  # The premise: the verifier accepts the text the teacher writes on these prompts.
  assert all(get_task("math").verify(ex, ANSWER).reward == 1.0 for ex in fours)
  teacher = answering_teacher(int(rollout_lib.prompt_ids(TOK, fours[0])[-1]))
  data = teacher_sft_pairs([teacher], fours,
                           AnswerSampling(max_new_tokens=len(TOK.encode(ANSWER)),
                                          samples_per_prompt=2, batch_size=8), tokenizer=TOK)
  assert data.pairs == [] and data.episodes == []
  assert data.metrics["cold_start/math_teacher/answered"] == 6
  assert data.metrics["cold_start/math_teacher/kept"] == data.metrics["cold_start/kept"] == 0
  assert data.metrics["cold_start/rejected"] == data.metrics["cold_start/rejected/truncated"] == 6


def test_a_generalist_answers_only_the_domains_without_a_specialist():
  """A math specialist and a generalist (domain None): the math prompts go to
  the specialist alone, the instruct prompts (no specialist) to the generalist."""
  math = get_task("math").examples("train", 3, seed=0, difficulty=1)
  instruct = get_task("instruct").examples("train", 2, seed=0, difficulty=1)
  specialist = answering_teacher(int(rollout_lib.prompt_ids(TOK, math[0])[-1]))
  generalist = Teacher("generalist", specialist.cfg, specialist.params, None)
  data = teacher_sft_pairs([specialist, generalist], math + instruct,
                           AnswerSampling(max_new_tokens=16, samples_per_prompt=2, batch_size=8),
                           tokenizer=TOK)
  assert data.metrics["cold_start/math_teacher/answered"] == 2 * len(math)
  assert data.metrics["cold_start/generalist/answered"] == 2 * len(instruct)
