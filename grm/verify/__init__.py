"""Proof verification in the manner of DeepSeekMath-V2 (arXiv 2511.22570; docs/DESIGN.md §7).

On the toy proof domain (``opd.tasks.proof_task``, whose rule step checker
is the oracle):

  format     prompts and never-raising parsers of the verifier, meta-verifier,
             generator (proof + self-evaluation) and refinement; rule-written
             cold-start texts
  rewards    R_score, the verifier's (with and without R_meta) and the
             generator's rewards over a batch; issue faithfulness
  labelling  automatic labels from n analyses and m meta-checks; agreement
             with the checker as n and m vary
  refine     sequential refinement until the self-score is 1
  search     the high-compute candidate-pool search
  sampling   a model as the batched ``prompts -> texts`` callable all of them take
"""
from grm.verify import format, labelling, refine, rewards, sampling, search
from grm.verify.format import (Analysis, Generation, MetaJudgement, confirmed, format_analysis,
                               format_meta, format_score, generator_prompt, meta_prompt, numbered,
                               parse_analysis, parse_generation, parse_meta, refine_prompt,
                               rule_meta_score, split_generation, verifier_prompt, write_analysis,
                               write_generation, write_meta)
from grm.verify.labelling import Labelling, agreement_table, auto_labels, label_proofs
from grm.verify.refine import Refinement
from grm.verify.rewards import (GeneratorReward, faithfulness, generator_reward,
                                generator_reward_from_parsed, r_score, verifier_reward,
                                verifier_reward_from_parsed)
from grm.verify.sampling import TRUNCATED, sampler_fn
from grm.verify.search import Candidate, RoundRecord, SearchConfig, SearchResult
