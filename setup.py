"""Sparta: sparse-communication training for Mixture-of-Experts and embedding-heavy models."""

from setuptools import find_packages, setup

setup(
    name="sparta",
    version="0.1.0",
    description="MoE and sparse-embedding training with hierarchical, scheduled communication",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["sparta", "sparta.*", "sparta_tools", "sparta_tools.*"]),
    # torch is deliberately a lower bound only: a pinned or open range would let pip pull a
    # multi-GB CUDA build over the user's own torch.
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "ruff", "transformers", "tokenizers", "tqdm", "matplotlib"],
        "bench": ["tqdm", "matplotlib"],
        "demo": ["tokenizers", "tqdm"],
        "mpi": ["mpi4py>=3.1"],
        # Horovod 0.28.1 does not build against torch>=2.1 from PyPI's sdist; use
        # scripts/install_horovod.sh, which patches and caches a wheel.
        "horovod": ["horovod==0.28.1"],
    },
    entry_points={"console_scripts": ["sparta=sparta.cli:main"]},
)
