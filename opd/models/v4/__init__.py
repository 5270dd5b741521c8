"""DeepSeek-V4 components (docs/DESIGN.md §2, "DeepSeek-V4 components (in progress)").

Pure functions and small linen modules, each driven by its own frozen config
and checked against ``transformers``' DeepSeek-V4 modules; the decoder that
stacks them is not built yet.
"""
