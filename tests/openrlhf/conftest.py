"""Fixtures for the LPO-in-OpenRLHF tests (real openrlhf 0.11.2 classes; see lpo_fixtures.py)."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from gloo_util import free_port  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from lpo_fixtures import tiny_model

    return tiny_model(str(tmp_path_factory.mktemp("openrlhf_tiny")))


@pytest.fixture(scope="session")
def gloo_world1():
    """A one-process gloo group, so the stock collectives run for real (dp = 1)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """The tiny random Qwen2.5-VL + processor (vlm_harness.py), built offline once per session."""
    from vlm_harness import tiny_vlm

    return tiny_vlm(str(tmp_path_factory.mktemp("openrlhf_tiny_vlm")))
