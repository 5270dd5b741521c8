"""Generative reward models (docs/DESIGN.md §6).

A pointwise GRM reads a query and n >= 1 responses (shown in a seeded random
order) and writes principles, a critique and one integer score in 1..10 per
response (``grm.format``; ``grm.parse`` reads it and never raises). A
judgement is correct when the ground-truth best response scores strictly
highest (``grm.correctness``), which is also the rule-RL reward.
Inference-time scaling samples k judgements in one sampler call
(``grm.judge``) and votes (``grm.voting``, pure numpy), optionally guided by
a scalar-head meta-RM (``grm.meta_rm``). Baselines: a Bradley–Terry scalar
RM (``grm.scalar_rm``), a pairwise "A or B" judge (``grm.pairwise``) and a
random pick (``grm.voting.random_winners``). ``grm.data`` builds preference
groups from the task suite and writes rule-based judgements for cold-start
SFT; ``grm.training`` runs cold-start SFT, rejective fine-tuning and
rule-based RL; ``grm.benchmark_set`` is the RewardBench-style test set and
its accuracy, ``grm.evaluation`` the benchmark's per-group correctness
(voting@k, meta-RM voting, the pairwise round-robin). ``grm.reward`` makes
the GRM and the BT RM GRPO rewards,
``grm.user_sim`` the agent's GRM and user-simulator reward layers, and
``grm.shared`` the shared-backbone GRM + meta-RM joint loss. The package sits above ``opd``
and below ``experiments`` (docs/DESIGN.md §1).
"""
from grm import (benchmark_set, correctness, data, evaluation, format, judge, meta_rm, pairwise,
                 parse, reward, scalar_rm, shared, training, user_sim, voting)
from grm.correctness import best_index, check_ratings, is_correct, rule_reward
from grm.data import (PRINCIPLES, Candidate, PreferenceGroup, build_groups, rating_from_reward,
                      rule_judgement, sample_candidates, split_groups)
from grm.format import (GRMPrompt, Principle, build_prompt, format_judgement, format_scores,
                        permutation, plain, prompt_ids, shuffle, unshuffle)
from grm.judge import (SampledJudgement, build_prompts, invalid_sample_counts, judge_completion,
                       sample_judgements, score_arrays)
from grm.meta_rm import (add_scalar_head, binary_cross_entropy, meta_batch, meta_input_ids,
                         meta_loss_fn, meta_scores)
from grm.pairwise import (PairwiseJudgement, PairwisePrompt, build_pairwise_prompt,
                          format_pairwise, judge_pairs, parse_pairwise, preferred_index)
from grm.parse import REASONS, Judgement, invalid_counts, parse_judgement
from grm.scalar_rm import (bradley_terry_loss, bt_loss_fn, pair_batch, score_sequences,
                           sequence_rewards, train_reward_model)
from grm.voting import (NO_WINNER, Vote, meta_vote, random_winners, select_top, unique_argmax,
                        vote, vote_correct, weighted_vote)
from grm.reward import BTReward, GRMReward, bt_input_ids, rating_to_reward, response_text
from grm.shared import meta_labels_from_rewards, shared_loss_fn
from grm.user_sim import SEED_WEIGHTS, AgentLayeredReward, user_satisfaction
