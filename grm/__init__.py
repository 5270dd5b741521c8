"""Generative reward models and test-time pipelines: planned, not yet implemented.

This package will hold the pointwise generative reward model with SPCT
training (rejective fine-tuning, then rule-based RL), k-sample and
meta-RM-guided voting, and the verifier / test-time pipelines
(DeepSeekMath-V2 proof verification, GENCLUSTER code selection), designed in
docs/DESIGN.md §6–§7. It sits above ``opd`` and below ``experiments``
(docs/DESIGN.md §1) and exports nothing yet; today a learned reward would
reach GRPO as a plain ``reward_fn`` callable (``opd.rl.scoring.score_episodes``).
"""
