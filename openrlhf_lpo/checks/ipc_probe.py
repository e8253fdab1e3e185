"""The receiving end of the GPU check's IPC row (``megatron_offload_ipc``): a process of its own (spawned) rebuilds
each handle with the weight route's transport and returns a digest of every tensor's bytes."""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Tuple

import torch

__all__ = ["tensor_digest", "rebuild_digests"]


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and layout as stored)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def rebuild_digests(transport_name: str, handles: List[Tuple[str, object]]) -> Dict[str, str]:
    """Rebuild every ``(name, handle)`` with the named transport (:mod:`openrlhf_lpo.engines.ipc`) on this
    process's device; the digest of each tensor."""
    from openrlhf_lpo.engines.ipc import DeviceIPC, SharedMemoryIPC
    from openrlhf_lpo.megatron.device import accelerator_available, set_local_device

    if accelerator_available():
        set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
    transport = {"DeviceIPC": DeviceIPC, "SharedMemoryIPC": SharedMemoryIPC}[transport_name]()
    return {name: tensor_digest(transport.rebuild(handle)) for name, handle in handles}
