"""Device-agnostic helpers for the Megatron backend (no accelerator named in product code).

* :func:`accelerator_available` / :func:`set_local_device` / :func:`default_backend` use
  ``torch.accelerator`` and ``torch.distributed.get_default_backend_for_device``.
* :func:`seed_model_parallel` calls megatron-core's model-parallel seeding function (an upstream
  API name, not a device choice: on CPU the CPU mode maps its RNG tracker onto the CPU generator).
"""

from __future__ import annotations

import torch

def accelerator_available() -> bool:
    return bool(torch.accelerator.is_available())


def set_local_device(local_rank: int) -> None:
    if accelerator_available():
        torch.accelerator.set_device_index(local_rank)


def default_backend() -> str:
    """Process-group backend for the current machine: the accelerator's default, else gloo."""
    import torch.distributed as dist

    if accelerator_available():
        return dist.get_default_backend_for_device(torch.accelerator.current_accelerator())
    return "gloo"


def seed_model_parallel(seed: int) -> None:
    """``torch.manual_seed`` plus megatron's per-TP-rank RNG tracker states."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
