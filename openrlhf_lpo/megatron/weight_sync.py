"""Weights to colocated rollout engines through inter-process handles (``--train.colocate_all``).

When the rollout engines share the actor's GPUs, a process group between them cannot carry the weights
(NCCL refuses two ranks on one GPU). OpenRLHF's DeepSpeed hybrid engine hands each tensor over by IPC
instead: every actor rank makes a handle of the full tensor with ``reduce_tensor``, keyed by the physical
id of its GPU; the handles are all-gathered and rank 0 calls
``engine.update_weight_cuda_ipc(name, dtype, shape, ipc_handles, empty_cache)`` on every engine; each
vLLM worker (OpenRLHF's ``WorkerWrap``) rebuilds the handle of its own GPU and passes the full HF tensor
to ``model.load_weights``, which cuts the worker's own TP shard out of it. That is how a vLLM TP that
differs from the actor's TP is served: the actor always hands over full, HF-named tensors.

:func:`send_weights` is that protocol for the Megatron actor, fed by ``export_hf_weights(dst=None)``:
the same TP gather, PP broadcast, QKV / gate-up un-fusing and HF naming as the NCCL stream
(``export_hf_weights(dst=0)``), so the two routes differ only in the transport. Every rank of every
data-parallel replica receives each full tensor (each GPU has an engine worker to feed).

Transports: :mod:`openrlhf_lpo.engines.ipc` (the rollout engines import them too): the real one,
accelerator IPC, and the CPU stand-in over shared memory; the stand-in is for the transport only, the
resharding and naming here are the real code.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from openrlhf_lpo.engines.ipc import DeviceIPC, SharedMemoryIPC, Transport, standin_device_id, transport_for

__all__ = ["Transport", "DeviceIPC", "SharedMemoryIPC", "standin_device_id", "transport_for", "send_weights",
           "IN_FLIGHT"]

IN_FLIGHT = 3  # tensors rank 0 hands to the engines before waiting for the oldest


def _with_last(items: Iterable) -> Iterator[Tuple[bool, Any]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield False, prev
        prev = item
    yield True, prev


def send_weights(named_tensors: Iterable[Tuple[str, torch.Tensor]], engines: List, transport: Transport,
                 group=None, in_flight: int = IN_FLIGHT, reset_prefix_cache: bool = False) -> Dict[str, Any]:
    """Hand every ``(name, full tensor)`` of ``named_tensors`` to ``engines`` through ``transport``.

    Collective over ``group`` (default: the world): every rank iterates the same names in the same order
    and contributes ``{its device id: handle}``; rank 0 of the group calls
    ``update_weight_cuda_ipc(name, dtype=, shape=, ipc_handles=, empty_cache=)`` on every engine with all
    ranks' handles, ``empty_cache=True`` on the last tensor (as OpenRLHF marks it). Up to ``in_flight``
    tensors are with the engines before rank 0 waits for the oldest; every rank keeps its tensors alive
    until rank 0 has seen them loaded (rank 0 enters the next all-gather only after that wait). Then the
    engines' prefix caches are reset when asked (cached KV blocks hold the old weights).

    Returns ``{"tensors": n, "device_ids": [per rank]}`` (the device ids of the last all-gather)."""
    import ray
    import torch.distributed as dist

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    key = transport.device_id()
    pending: deque = deque()  # rank 0: (refs, tensor); other ranks: tensor
    count, keys = 0, []
    for last, (name, tensor) in _with_last(named_tensors):
        tensor = tensor.detach().contiguous()
        gathered: List[Optional[dict]] = [None] * world
        dist.all_gather_object(gathered, {key: transport.export(tensor)}, group=group)
        keys = [next(iter(d)) for d in gathered]
        if len(set(keys)) != world:
            raise RuntimeError(f"weight sync by IPC: two ranks report the same device {keys}; each actor rank "
                               "must sit on a device of its own (--train.colocate_all places one per GPU)")
        count += 1
        if rank == 0:
            handles = {k: v for d in gathered for k, v in d.items()}
            refs = [e.update_weight_cuda_ipc.remote(name, dtype=tensor.dtype, shape=tuple(tensor.shape),
                                                    ipc_handles=handles, empty_cache=last) for e in engines]
            pending.append((refs, tensor))
            while len(pending) > in_flight:
                ray.get(pending.popleft()[0])
        else:
            pending.append(tensor)
            while len(pending) > in_flight + 1:  # rank 0 has waited for those before joining this all-gather
                pending.popleft()
    if rank == 0:
        while pending:
            ray.get(pending.popleft()[0])
        if engines and reset_prefix_cache:
            ray.get([e.reset_prefix_cache.remote() for e in engines])
    dist.barrier(group=group)  # every engine has loaded every tensor: the others may free theirs
    pending.clear()
    return {"tensors": count, "device_ids": keys}
