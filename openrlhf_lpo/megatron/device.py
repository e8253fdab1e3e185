"""Device-agnostic helpers for the Megatron backend (no accelerator named in product code).

* :func:`accelerator_available` / :func:`set_local_device` / :func:`default_backend` use
  ``torch.accelerator`` and ``torch.distributed.get_default_backend_for_device``.
* :func:`local_device` is where this rank's model lives (megatron-core leaves some parameters
  on the CPU unless the model is moved, as Megatron-LM's ``get_model`` does).
* :func:`group_device` is the device a collective's tensors must live on for a process group
  (CPU for gloo, the current accelerator for NCCL and other accelerator backends): every
  collective of this backend allocates or moves its tensors there.
* :func:`seed_model_parallel` calls megatron-core's model-parallel seeding function (an upstream
  API name, not a device choice: on CPU the CPU mode maps its RNG tracker onto the CPU generator).
* :func:`memory_allocated` / :func:`max_memory_allocated` / :func:`reset_peak_memory`: the accelerator's
  allocation counters (None without an accelerator).
"""

from __future__ import annotations

from typing import Optional

import torch

# process-group backends whose collectives take CPU tensors
CPU_BACKENDS = ("gloo", "mpi")

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


def init_default_group(timeout=None) -> None:
    """``torch.distributed.init_process_group`` with this machine's backend; with an accelerator the
    group is bound to this rank's device (``device_id``), so NCCL need not guess it from the rank."""
    import torch.distributed as dist

    kw = {} if timeout is None else {"timeout": timeout}
    if accelerator_available():
        kw["device_id"] = local_device()
    dist.init_process_group(default_backend(), **kw)


def seed_model_parallel(seed: int) -> None:
    """``torch.manual_seed`` plus megatron's per-TP-rank RNG tracker states."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def backend_device(backend: str) -> torch.device:
    """Device of the tensors a ``backend`` process group communicates (gloo: CPU)."""
    if str(backend).lower() in CPU_BACKENDS:
        return torch.device("cpu")
    if not accelerator_available():
        raise ValueError(
            f"process-group backend {backend!r} needs an accelerator, and torch sees none; "
            "use gloo on a machine without one"
        )
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def local_device() -> torch.device:
    """This rank's compute device: the current accelerator (its index), else the CPU."""
    if not accelerator_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def group_device(group=None) -> torch.device:
    """Device for the tensors of collectives on ``group`` (None: the default group)."""
    import torch.distributed as dist

    return backend_device(dist.get_backend(group))


def memory_allocated() -> Optional[int]:
    """Bytes allocated on the current accelerator now (None on CPU)."""
    if not accelerator_available():
        return None
    return int(torch.accelerator.memory_allocated())


def max_memory_allocated() -> Optional[int]:
    """Peak bytes allocated on the current accelerator since the last reset (None on CPU)."""
    if not accelerator_available():
        return None
    return int(torch.accelerator.max_memory_allocated())


def reset_peak_memory() -> None:
    if accelerator_available():
        torch.accelerator.reset_peak_memory_stats()
