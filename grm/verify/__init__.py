"""Proof verification in the manner of DeepSeekMath-V2 (arXiv 2511.22570; docs/DESIGN.md §7).

On the toy proof domain (``opd.tasks.proof_task``, whose rule step checker
is the oracle): ``grm.verify.format`` holds the prompts and never-raising
parsers of the verifier, meta-verifier, generator (proof + self-evaluation)
and refinement, and the rule-written cold-start texts.
"""
from grm.verify import format
from grm.verify.format import (Analysis, Generation, MetaJudgement, confirmed, format_analysis,
                               format_meta, format_score, generator_prompt, meta_prompt, numbered,
                               parse_analysis, parse_generation, parse_meta, refine_prompt,
                               rule_meta_score, verifier_prompt, write_analysis, write_generation,
                               write_meta)
