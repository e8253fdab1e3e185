"""Fixtures for the demo tests: a private warm-up cache and a micro warm-up configuration; puts this
directory on sys.path for the shared run checks (``demo_checks``)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from openrlhf_lpo.demo.warmup import WarmupConfig

# A model small enough that a few supervised steps take seconds on one core.
MICRO = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
             batch_size=8, max_steps=4, eval_every=2, eval_prompts=8, target_accuracy=1.0, threads=1)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("LPO_CACHE_DIR", str(d))
    return d


@pytest.fixture
def micro_warmup_config():
    return WarmupConfig(**MICRO)


@pytest.fixture(scope="module")
def micro_tiny_model(tmp_path_factory):
    """An untrained micro Qwen3 (the demo's tokenizer), for loop runs that only need rows."""
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "micro", seed=3, hidden_size=32, num_layers=1,
                                num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64))
