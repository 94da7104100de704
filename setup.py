"""megatron_sparseloco: communication-efficient (DiLoCo / SparseLoCo / GASLoC) pretraining for Megatron.

Runtime dependencies are torch and megatron-core. Transformer Engine and Apex are optional
accelerators: megatron-core uses them when installed, and nothing here requires them.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_sparseloco",
    version="0.1.0",
    description="DiLoCo, SparseLoCo and GASLoC outer steps for Megatron-LM / megatron-core pretraining",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_sparseloco", "megatron_sparseloco.*"]),
    python_requires=">=3.12",
    install_requires=["torch>=2.4", "megatron-core>=0.17"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "einops", "psutil", "tensorboard", "numpy", "pybind11"],
        "bench": ["numpy", "matplotlib", "torchft==0.2.0"],
    },
    entry_points={"console_scripts": [
        "sparseloco-run=megatron_sparseloco.run:main",
        "sparseloco-layout=megatron_sparseloco.worker_layout:main",
    ]},
)
