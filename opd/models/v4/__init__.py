"""DeepSeek-V4 as a member of the model family (docs/DESIGN.md §2, "DeepSeek-V4").

``ModelConfig.v4`` (``opd.models.v4.config.V4Config``) selects it; the
components are pure functions and small linen modules, each driven by its own
frozen config and checked against ``transformers``' DeepSeek-V4 modules.
"""
