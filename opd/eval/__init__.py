"""Evaluation: per-domain greedy and sampled scores on top of ``opd.rollout``
(``evaluation``), bootstrap standard errors (``stats``), result types
(``results``), tables, JSON and heatmaps (``report``), training-curve
metrics of the estimator ablation (``curves``), the V4 claims' ratios and
budget metrics (``claims``)."""
from opd.eval import claims, curves, evaluation, report, results, stats
from opd.eval.evaluation import eval_examples, evaluate
from opd.eval.report import (grid_heatmap_figure, heatmap, heatmap_figure, load_results,
                             results_table, save_results)
from opd.eval.results import GREEDY_METRICS, DomainResult, EvalConfig, EvalResult
from opd.eval.stats import Estimate, bootstrap_se, bootstrap_seed, estimate, ratio_estimate
