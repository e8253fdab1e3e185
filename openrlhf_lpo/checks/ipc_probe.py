"""The receiving end of the GPU check's IPC rows (``megatron_offload_ipc``, ``weight_sync_buckets``): a process of its
own (spawned) rebuilds each handle with the weight route's transport (and unpacks each bucket as the engines do) and
returns a digest of every tensor's bytes."""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Tuple

import torch

__all__ = ["tensor_digest", "rebuild_digests", "rebuild_bucket_digests"]


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and layout as stored)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _transport(transport_name: str):
    """The named transport (:mod:`openrlhf_lpo.engines.ipc`) on this process's device."""
    from openrlhf_lpo.engines.ipc import DeviceIPC, SharedMemoryIPC
    from openrlhf_lpo.megatron.device import accelerator_available, set_local_device

    if accelerator_available():
        set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
    return {"DeviceIPC": DeviceIPC, "SharedMemoryIPC": SharedMemoryIPC}[transport_name]()


def rebuild_digests(transport_name: str, handles: List[Tuple[str, object]]) -> Dict[str, str]:
    """Rebuild every ``(name, handle)`` with the named transport on this process's device; the digest of each
    tensor."""
    transport = _transport(transport_name)
    return {name: tensor_digest(transport.rebuild(handle)) for name, handle in handles}


def rebuild_bucket_digests(transport_name: str, buckets: List[Tuple[list, object]]) -> Dict[str, str]:
    """Rebuild every ``(metas, handle)`` bucket and unpack it (:func:`openrlhf_lpo.engines.buckets.unpack`, the
    engines' code); the digest of each named tensor."""
    from openrlhf_lpo.engines.buckets import unpack

    transport = _transport(transport_name)
    return {name: tensor_digest(t) for metas, handle in buckets for name, t in unpack(transport.rebuild(handle), metas)}
