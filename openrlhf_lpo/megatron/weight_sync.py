"""Weights from the Megatron actor to the rollout engines: bucketed and in order, on both routes (issue 43,
items 4 and 5; the engine side: :mod:`openrlhf_lpo.engines.weight_updates`).

**Buckets** (:mod:`openrlhf_lpo.engines.buckets`): the HF-named stream of ``export_hf_weights`` is cut into flat
buffers of at most ``--megatron.sync_bucket_mb`` (default 512 MiB); a tensor larger than a bucket goes alone, as
its own bytes. One engine call per bucket instead of one per tensor (OpenRLHF 0.11.2's ``update_weight`` /
``update_weight_cuda_ipc``): Qwen3-8B's 399 tensors (16.4 GB in bf16) make 30 buckets, 2 of them the
embedding and the output layer alone (``benchmarks/weight_sync_buckets.py``).

**Order**: every call carries the next number of its sender's counter (:class:`WeightSender`, one per actor
process for the run); the engines apply the numbers strictly in order (Ray does not order the calls of an asyncio
actor). Up to :data:`IN_FLIGHT` buckets are with the engines before the sender waits for the oldest.

**Broadcast route** (:meth:`WeightSender.stream`, engines on GPUs of their own): rank 0 alone receives the
tensors (``export_hf_weights(dst=0)``), announces each bucket with ``update_weight_bucket(seq, metas,
empty_cache)`` and broadcasts its buffer over OpenRLHF's model-update group.

**IPC route** (:meth:`WeightSender.send_ipc`, ``--train.colocate_all``): NCCL refuses a group with two ranks on
one GPU, so colocated engines take the weights through inter-process handles, as OpenRLHF's DeepSpeed hybrid
engine does. Every rank of every replica receives each full HF tensor (``export_hf_weights(dst=None)``: the
broadcast route's TP gather, PP broadcast, QKV / gate-up un-fusing and naming), since every GPU has an engine
worker to feed; vLLM's ``load_weights`` cuts its own TP shard out of each, which is how a vLLM TP that differs
from the actor's is served. Per node (:class:`NodeRoute`, as verl and NeMo-RL hand weights over inside a node):
the node's ranks all-gather ``{device id: handle of the bucket}`` over a gloo group of their own, and the node's
lowest rank calls ``update_weight_bucket_ipc(seq, metas, ipc_handles, empty_cache)`` on the node's engines
(those whose ``weight_sync_device_ids()`` are devices of the node), each worker rebuilding the handle of its own
GPU. A handle never leaves its node and the world never gathers handles; a multi-node colocated run (``COLOCATE=1``
on several nodes) works the same way on every node. Every rank keeps its buckets alive until its leader has seen
them loaded (the leader enters the next all-gather only after that wait).

Transports: :mod:`openrlhf_lpo.engines.ipc` (accelerator IPC; the CPU stand-in over shared memory, for the
transport only: bucketing, ordering and routing here are the real code).
"""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from openrlhf_lpo.engines.buckets import MB, bucketize
from openrlhf_lpo.engines.ipc import DeviceIPC, SharedMemoryIPC, Transport, standin_device_id, transport_for

__all__ = ["Transport", "DeviceIPC", "SharedMemoryIPC", "standin_device_id", "transport_for", "NodeRoute",
           "node_route", "WeightSender", "send_weights", "IN_FLIGHT", "DEFAULT_BUCKET_MB", "bucket_bytes_of"]

IN_FLIGHT = 1  # buckets with the engines before the sender waits for the oldest (each holds a bucket's memory)
DEFAULT_BUCKET_MB = 512.0
MAX_BUCKET_MB = 16384.0


def bucket_bytes_of(args) -> int:
    """``--megatron.sync_bucket_mb`` in bytes (the default where the flag is absent)."""
    megatron = getattr(args, "megatron", None)
    mb = getattr(megatron, "sync_bucket_mb", None)
    return max(1, int(float(DEFAULT_BUCKET_MB if mb is None else mb) * MB))


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


def _node_id() -> str:
    """The Ray node of this process (the host name outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not a Ray worker: the host
        pass
    return socket.gethostname()


@dataclass
class NodeRoute:
    """The ranks of this process's node (ascending global ranks) and their gloo group; the first is the leader."""

    node: str
    ranks: List[int]
    group: Any

    @property
    def leader(self) -> int:
        return self.ranks[0]


def node_route(node: Optional[str] = None) -> NodeRoute:
    """Collective over the world: every rank names its node (``node`` or its Ray node) and every rank creates one
    gloo group per node, in the order of the nodes' first ranks; returns this rank's."""
    import torch.distributed as dist

    node = node or _node_id()
    nodes: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    mine = None
    for name in dict.fromkeys(nodes):  # first-rank order, the same on every rank
        ranks = [r for r, n in enumerate(nodes) if n == name]
        group = dist.new_group(ranks, backend="gloo")  # every rank creates every node's group
        if name == node:
            mine = NodeRoute(node, ranks, group)
    return mine


class WeightSender:
    """One actor process's side of the weight sync: its sequence counter (for the engines it calls) for the
    whole run, and what it learnt of the engines' devices. See the module docstring for the two routes."""

    def __init__(self, in_flight: int = IN_FLIGHT):
        self.in_flight = int(in_flight)
        self.seq = 0  # the number of this sender's next call
        self.syncs = 0
        self._engine_devices: Optional[List[List[str]]] = None

    def _take(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    @staticmethod
    def _require(engines: List, method: str) -> None:
        lacking = [i for i, e in enumerate(engines) if not hasattr(e, method)]
        if lacking:
            raise RuntimeError(f"weight sync: rollout engines {lacking} have no {method}(): the Megatron actor sends "
                               "buckets in sequence order, which this project's engines take (the CPU rollout engine, "
                               "vLLM's actor as lpo-train starts it: openrlhf/seeded_vllm.py); start them through "
                               "lpo-train")

    def _drain(self, pending: deque, keep: int) -> None:
        import ray

        while len(pending) > keep:
            ray.get(pending.popleft()[0])

    # ------------------------------------------------------------------ broadcast route
    def stream(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], engines: List,
               broadcast: Callable[[torch.Tensor], None], bucket_bytes: int) -> Dict[str, Any]:
        """Rank 0 of the model-update group: each bucket of ``named_tensors`` announced to every engine
        (``update_weight_bucket``) and its buffer broadcast with ``broadcast(buffer)``. Ranks that receive no
        tensors iterate the stream all the same (the export is collective)."""
        self._require(engines, "update_weight_bucket")
        pending: deque = deque()  # (refs, bucket): a buffer stays alive until its engines took it
        tensors = buckets = 0
        for last, bucket in _with_last(bucketize(named_tensors, bucket_bytes)):
            tensors += len(bucket.metas)
            buckets += 1
            if not engines:
                continue
            seq = self._take()
            refs = [e.update_weight_bucket.remote(seq, bucket.wire_metas(), empty_cache=last) for e in engines]
            broadcast(bucket.buffer)
            pending.append((refs, bucket))
            self._drain(pending, self.in_flight)
        self._drain(pending, 0)
        self.syncs += 1
        return {"tensors": tensors, "buckets": buckets, "calls": buckets * len(engines), "seq": self.seq}

    # ------------------------------------------------------------------ IPC route
    def _node_engines(self, engines: List, keys: List[str], route: NodeRoute) -> List:
        """The engines whose devices are devices of this node's ranks (asked once per run)."""
        import ray

        self._require(engines, "update_weight_bucket_ipc")
        if self._engine_devices is None or len(self._engine_devices) != len(engines):
            self._engine_devices = [list(ids) for ids in ray.get([e.weight_sync_device_ids.remote() for e in engines])]
        node_keys, mine, covered = set(keys), [], set()
        for i, (engine, ids) in enumerate(zip(engines, self._engine_devices)):
            inside = set(ids) & node_keys
            if inside and inside != set(ids):
                raise RuntimeError(f"weight sync by IPC: engine {i} has workers on devices {sorted(ids)}, of which only "
                                   f"{sorted(inside)} belong to node {route.node}'s actor ranks: an engine must sit "
                                   "on the GPUs of one node (--vllm.tensor_parallel_size dividing "
                                   "--actor.num_gpus_per_node)")
            if inside:
                mine.append(engine)
                covered |= inside
        if covered != node_keys:
            raise RuntimeError(f"weight sync by IPC: actor ranks {route.ranks} on node {route.node} sit on devices "
                               f"{sorted(node_keys - covered)} where no engine worker runs; --train.colocate_all puts "
                               "one engine worker on each actor GPU")
        return mine

    def send_ipc(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], engines: List, transport: Transport,
                 route: NodeRoute, bucket_bytes: int, reset_prefix_cache: bool = False) -> Dict[str, Any]:
        """Collective over ``route.group`` (every rank of the node iterates the same stream): each bucket's handle
        of every rank of the node, to the node's engines; the prefix caches reset after the last one when asked.

        Returns ``{"tensors", "buckets", "calls" (the leader's engine calls), "engines" (the node's), "node",
        "device_ids" (the node's ranks'), "seq" (the leader's next number)}``."""
        import torch.distributed as dist

        group = route.group
        leader = dist.get_rank() == route.leader
        key = transport.device_id()
        pending: deque = deque()  # leader: (refs, bucket); the others: (None, bucket)
        tensors = buckets = 0
        keys: List[str] = []
        mine: List = []
        for last, bucket in _with_last(bucketize(named_tensors, bucket_bytes)):
            gathered: List[Optional[dict]] = [None] * len(route.ranks)
            dist.all_gather_object(gathered, {key: transport.export(bucket.buffer)}, group=group)
            keys = [next(iter(d)) for d in gathered]
            if len(set(keys)) != len(keys):
                raise RuntimeError(f"weight sync by IPC: two ranks of node {route.node} report the same device "
                                   f"{keys}; each actor rank must sit on a device of its own (--train.colocate_all "
                                   "places one per GPU)")
            tensors += len(bucket.metas)
            buckets += 1
            if leader:
                if buckets == 1:
                    mine = self._node_engines(engines, keys, route)
                handles = {k: v for d in gathered for k, v in d.items()}
                seq = self._take()
                refs = [e.update_weight_bucket_ipc.remote(seq, bucket.wire_metas(), ipc_handles=handles,
                                                          empty_cache=last) for e in mine]
                pending.append((refs, bucket))
                self._drain(pending, self.in_flight)
            else:
                pending.append((None, bucket))
                while len(pending) > self.in_flight + 1:  # the leader waited for those before this all-gather
                    pending.popleft()
        if leader:
            self._drain(pending, 0)
            if mine and reset_prefix_cache:
                import ray

                ray.get([e.reset_prefix_cache.remote() for e in mine])
        dist.barrier(group=group)  # the node's engines hold every bucket: the ranks may free theirs
        pending.clear()
        self.syncs += 1
        return {"tensors": tensors, "buckets": buckets, "calls": buckets * len(mine) if leader else 0,
                "engines": len(mine), "node": route.node, "device_ids": keys, "seq": self.seq}


def send_weights(named_tensors: Iterable[Tuple[str, torch.Tensor]], engines: List, transport: Transport,
                 route: Optional[NodeRoute] = None, bucket_bytes: int = int(DEFAULT_BUCKET_MB * MB),
                 reset_prefix_cache: bool = False, sender: Optional[WeightSender] = None) -> Dict[str, Any]:
    """:meth:`WeightSender.send_ipc` with a fresh sender (numbers from 0) and, by default, this rank's node."""
    return (sender or WeightSender()).send_ipc(named_tensors, engines, transport, route or node_route(), bucket_bytes,
                                                reset_prefix_cache)

