"""Shared gloo world for the Megatron tests: one launch of 4 ranks runs every Megatron world check.

Each rank of tests/megatron/mcore_worker.py runs the named checks of ``mcore_checks/`` in their fixed order
(``mcore_checks.ORDER``: the layouts, checkpoints, the update's maths, packing, resharding, the policy
actor, syncs, then sequence parallelism and virtual pipeline stages), re-initialising megatron's parallel
state on the same process group, so process start-up and imports are paid once per session. A check that
fails fails the tests that read it (``mcore_records.world_checks``); the later checks still run.
OMP_NUM_THREADS=1 per rank.
"""

import pytest

from .mcore_records import launch_world


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Qwen3 (2 layers, hidden 64, 4 heads, 2 KV heads) for the flag and dry-run tests."""
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "q3", arch="qwen3", hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


@pytest.fixture(scope="session")
def mcore_world(tmp_path_factory):
    """Every rank's record: the checks' numbers (``checks``) and their outcome (``status``), per rank."""
    return launch_world(tmp_path_factory.mktemp("mcore_world"))
