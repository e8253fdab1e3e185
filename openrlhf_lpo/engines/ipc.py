"""How a tensor crosses to another process on the same device: the weight-sync interface of colocated rollout
engines (``--train.colocate_all``; the sender: :mod:`openrlhf_lpo.megatron.weight_sync`, the CPU receiver:
:mod:`openrlhf_lpo.engines.cpu_engine`).

Transports (:class:`Transport`: ``device_id()``, ``export(tensor)``, ``rebuild(handle)``):

* :class:`DeviceIPC`, the real one: ``reduce_tensor`` of the accelerator tensor, keyed by OpenRLHF's
  ``get_physical_gpu_id`` (what its worker looks its handle up by).
* :class:`SharedMemoryIPC`, the CPU stand-in: the same ``reduce_tensor`` on a CPU tensor whose storage is
  moved to shared memory (torch's ``file_system`` strategy: a named segment that an unrelated process
  maps by name), keyed by :func:`standin_device_id`. The stand-in is for the transport only; the
  resharding and naming are the real code. The CPU rollout engine's ``update_weight_cuda_ipc``
  (:mod:`openrlhf_lpo.engines.cpu_engine`) rebuilds it.
"""

from __future__ import annotations

import abc
import os
import socket
import warnings
from typing import Any, Optional

import torch

__all__ = ["Transport", "DeviceIPC", "SharedMemoryIPC", "standin_device_id", "transport_for"]


class Transport(abc.ABC):
    """How a tensor crosses to a process on the same device (see the module docstring)."""

    name = "abstract"

    @abc.abstractmethod
    def device_id(self) -> str:
        """The key of this process's device in ``ipc_handles`` (the receiver on that device looks it up)."""

    @abc.abstractmethod
    def export(self, tensor: torch.Tensor) -> Any:
        """A picklable handle of ``tensor``; the tensor must stay alive until the receiver has rebuilt it."""

    @abc.abstractmethod
    def rebuild(self, handle: Any) -> torch.Tensor:
        """The tensor behind ``handle``, in the receiving process."""


class DeviceIPC(Transport):
    """Accelerator IPC: ``reduce_tensor`` of a device tensor, OpenRLHF's handle format."""

    name = "device-ipc"

    def device_id(self) -> str:
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        return get_physical_gpu_id()

    def export(self, tensor: torch.Tensor) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(tensor)

    def rebuild(self, handle: Any) -> torch.Tensor:
        # what OpenRLHF's WorkerWrap.update_weight_cuda_ipc does: the device index (argument 6) is the
        # receiver's own, in case the two processes see different visible-device lists
        func, args = handle
        args = list(args)
        args[6] = torch.accelerator.current_device_index()
        return func(*args)


def standin_device_id() -> str:
    """The CPU stand-in for a physical GPU id: the Ray node and the logical GPU slot Ray gave this process
    (an actor rank and a rollout engine on one placement-group bundle get the same slot), else the host and
    the process's rank (``RANK`` / ``LOCAL_RANK``) or pid."""
    try:
        import ray

        if ray.is_initialized():
            gpus = ray.get_gpu_ids()
            if gpus:
                node = ray.get_runtime_context().get_node_id()
                return f"{node}:gpu{','.join(str(g) for g in gpus)}"
    except Exception:  # noqa: BLE001 - no Ray worker context: fall back to host and rank
        pass
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or f"pid{os.getpid()}"
    return f"{socket.gethostname()}:rank{rank}"


class SharedMemoryIPC(Transport):
    """CPU stand-in: ``reduce_tensor`` on a CPU tensor, its storage in a named shared-memory segment."""

    name = "shared-memory"

    def __init__(self, device_id: Optional[str] = None):
        self._device_id = device_id

    def device_id(self) -> str:
        return self._device_id or standin_device_id()

    def export(self, tensor: torch.Tensor) -> Any:
        import torch.multiprocessing as mp
        from torch.multiprocessing.reductions import reduce_storage, reduce_tensor

        if tensor.device.type != "cpu":
            raise ValueError(f"SharedMemoryIPC exports CPU tensors, got one on {tensor.device}")
        func, (cls, storage, metadata) = reduce_tensor(tensor.detach())
        previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")  # a named segment (a file descriptor cannot cross to Ray workers)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TypedStorage deprecation notes from torch's own reducer
                storage_handle = reduce_storage(storage)
        finally:
            mp.set_sharing_strategy(previous)
        return func, (cls, storage_handle, metadata)

    def rebuild(self, handle: Any) -> torch.Tensor:
        func, (cls, (rebuild_storage, storage_args), metadata) = handle
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            storage = rebuild_storage(*storage_args)
            if isinstance(storage, torch.UntypedStorage):  # the sender's own process: torch's cache hands it back untyped
                storage = torch.TypedStorage(wrap_storage=storage, dtype=storage_args[-1], _internal=True)
            return func(cls, storage, metadata)


def transport_for(device: torch.device) -> Transport:
    """The transport for tensors on ``device``: the CPU stand-in for the CPU, accelerator IPC otherwise."""
    return SharedMemoryIPC() if torch.device(device).type == "cpu" else DeviceIPC()
