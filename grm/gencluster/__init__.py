"""GENCLUSTER: test-time clustering for code (arXiv 2510.14232; docs/DESIGN.md §7).

The data flow, one module per step:

  ``problems``    code-domain function specs with three subtasks of growing input
                  range; fallback input generator and rule-based validator
  ``execution``   the harness and batched, concurrent sandbox runs
  ``inputs``      model (or fallback) generators and validators, the 75% rule
  ``clustering``  clusters by output hash; drop a cluster that errs or is empty
  ``tournament``  pairwise judge tournament between cluster representatives
  ``submission``  round-robin submission, hardest subtask first, under a budget
  ``pipeline``    sampling, hidden tests, strategies and solve-rate curves
"""
from grm.gencluster.clustering import Cluster, cluster, is_bad, output_hash
from grm.gencluster.execution import (EMPTY, Outputs, RunStats, function_program, read_outputs,
                                      run_functions, run_programs)
from grm.gencluster.inputs import KEEP_SHARE, SubtaskInputs, build_inputs, keep_mask
from grm.gencluster.problems import (LEVEL_NAMES, Problem, Subtask, fallback_inputs,
                                     make_problem, rule_accepts)
from grm.gencluster.submission import Submission, round_robin, score_curve, submit
from grm.gencluster.tournament import Match, Ranking, matches, rank, run_tournament
