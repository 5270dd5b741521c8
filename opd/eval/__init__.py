"""Evaluation: per-domain greedy and sampled scores with bootstrap errors, tables and heatmaps."""
from opd.eval.evaluation import (GREEDY_METRICS, DomainResult, EvalConfig, EvalResult, Score,
                                 bootstrap_se, bootstrap_seed, eval_examples, evaluate,
                                 heatmap, heatmap_figure, load_results, results_table,
                                 save_results)
