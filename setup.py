"""Installs the DeepSeek-V4-style post-training reference codebase.

Packages: ``pallas_kernels`` (fused LM-head + divergence kernels, jax only),
``opd`` (model family, sampler, sharded training, OPD), ``grm`` (generative
reward models) and ``experiments`` (launchers, configs, benchmarks).
"""
import pathlib

import setuptools

HERE = pathlib.Path(__file__).parent


def _requirements(name):
  lines = (HERE / name).read_text().splitlines()
  return [l.strip() for l in lines if l.strip() and not l.startswith("#")]


setuptools.setup(
    name="opd-grm",
    version="0.1.0",
    description="JAX reference for multi-teacher on-policy distillation and generative reward models",
    packages=setuptools.find_packages(
        include=["opd", "opd.*", "grm", "grm.*", "pallas_kernels",
                 "pallas_kernels.*", "experiments", "experiments.*"]),
    python_requires=">=3.10",
    install_requires=_requirements("requirements.txt"),
    extras_require={
        "test": _requirements("requirements-test.txt"),
        "notebooks": ["jupyter", "ipywidgets"],
    },
)
