"""Flat buckets of named tensors: the unit of the weight sync into the rollout engines (issue 43, item 5).

A sync hands the engines one bucket per call instead of one tensor per call (OpenRLHF 0.11.2's engine API): the
small tensors of the stream are copied, in stream order, into one flat byte buffer of at most ``bucket_bytes``;
a tensor larger than a bucket travels alone, as its own bytes (no copy). Each tensor of a bucket is described by
a :class:`TensorMeta` ``(name, dtype, shape, offset)``, the offset in bytes from the buffer's start, aligned to
:data:`ALIGN` bytes so that every slice can be viewed as its dtype. The receiver rebuilds the buffer (a broadcast
into a buffer of :func:`bucket_nbytes` bytes, or an IPC handle) and :func:`unpack` gives it the named tensors as
views of that buffer, without a copy.

Planning is shared by the sender and by anyone who counts calls (``benchmarks/weight_sync_buckets.py``):
:class:`BucketPlanner` is the greedy rule (a tensor joins the open bucket when it still fits, else the bucket is
closed first; a tensor larger than a bucket closes the open bucket and goes alone), :func:`plan_buckets` applies
it to ``(name, dtype, shape)`` items without data, :func:`bucketize` to a stream of tensors. Pure torch.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, NamedTuple, Sequence, Tuple

import torch

__all__ = ["ALIGN", "TensorMeta", "Bucket", "BucketPlanner", "plan_buckets", "bucketize", "unpack",
           "bucket_nbytes", "nbytes_of", "MB"]

ALIGN = 256  # byte alignment of every tensor in a bucket (any dtype's element size divides it)
MB = 1 << 20  # --megatron.sync_bucket_mb counts MiB


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class TensorMeta(NamedTuple):
    """One tensor of a bucket: its name, dtype, shape and byte offset in the bucket's buffer."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


class Bucket(NamedTuple):
    """``metas`` (plain tuples on the wire) and ``buffer``: one-dimensional ``uint8`` on the tensors' device,
    exactly :func:`bucket_nbytes` long. ``alone``: a tensor larger than a bucket, ``buffer`` is its own bytes."""

    metas: Tuple[TensorMeta, ...]
    buffer: torch.Tensor
    alone: bool

    def wire_metas(self) -> List[tuple]:
        """The metas as plain tuples ``(name, dtype, shape, offset)``: what an engine call carries."""
        return [tuple(m) for m in self.metas]


def bucket_nbytes(metas: Iterable[Sequence]) -> int:
    """Bytes of the buffer that holds ``metas``: the end of its last tensor."""
    return max((int(m[3]) + nbytes_of(m[1], m[2]) for m in metas), default=0)


class BucketPlanner:
    """The greedy bucketing rule, one tensor at a time (see the module docstring)."""

    def __init__(self, bucket_bytes: int):
        if int(bucket_bytes) < 1:
            raise ValueError(f"bucket size must be at least 1 byte, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)
        self.open: List[TensorMeta] = []
        self.used = 0  # bytes of the open bucket, the last tensor's padding included

    def add(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> List[Tuple[List[TensorMeta], bool]]:
        """Place one tensor; returns the buckets this closes, ``(metas, alone)`` in stream order (0, 1 or 2)."""
        shape = tuple(int(d) for d in shape)
        size = nbytes_of(dtype, shape)
        closed: List[Tuple[List[TensorMeta], bool]] = []
        if size > self.bucket_bytes:
            closed += self.finish()
            closed.append(([TensorMeta(name, dtype, shape, 0)], True))
            return closed
        offset = _aligned(self.used)
        if self.open and offset + size > self.bucket_bytes:
            closed += self.finish()
            offset = 0
        self.open.append(TensorMeta(name, dtype, shape, offset))
        self.used = offset + size
        return closed

    def finish(self) -> List[Tuple[List[TensorMeta], bool]]:
        """Close the open bucket (if any)."""
        if not self.open:
            return []
        out, self.open, self.used = [(self.open, False)], [], 0
        return out


def plan_buckets(items: Iterable[Tuple[str, torch.dtype, Sequence[int]]],
                 bucket_bytes: int) -> List[Tuple[List[TensorMeta], bool]]:
    """The buckets a stream of ``(name, dtype, shape)`` makes, without data."""
    planner = BucketPlanner(bucket_bytes)
    out: List[Tuple[List[TensorMeta], bool]] = []
    for name, dtype, shape in items:
        out += planner.add(name, dtype, shape)
    return out + planner.finish()


def bucketize(named_tensors: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Buckets of the stream ``(name, tensor)``, in stream order (see the module docstring).

    The open bucket keeps its tensors until it closes; then they are copied into one buffer of exactly the
    bucket's size (on the first tensor's device) and let go. Extra memory while the caller holds ``n`` buckets:
    at most ``n + 2`` buckets' worth (the held ones, the one being packed and its tensors), a tensor that goes
    alone counting as a bucket. Every rank that iterates the same names, dtypes and shapes gets the same
    buckets."""
    planner = BucketPlanner(bucket_bytes)
    waiting: List[torch.Tensor] = []  # the open bucket's tensors, in its order

    def pack(metas: List[TensorMeta]) -> Bucket:
        buffer = torch.empty(bucket_nbytes(metas), dtype=torch.uint8, device=waiting[0].device)
        for meta in metas:
            t = waiting.pop(0)
            buffer[meta.offset:meta.offset + meta.nbytes].view(t.dtype).view(t.shape).copy_(t)
        return Bucket(tuple(metas), buffer, False)

    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        for metas, alone in planner.add(name, tensor.dtype, tensor.shape):
            yield Bucket(tuple(metas), tensor.reshape(-1).view(torch.uint8), True) if alone else pack(metas)
        if planner.open:  # it joined the open bucket (a tensor that went alone leaves none open)
            waiting.append(tensor)
    for metas, _ in planner.finish():
        yield pack(metas)


def unpack(buffer: torch.Tensor, metas: Iterable[Sequence]) -> List[Tuple[str, torch.Tensor]]:
    """The named tensors of a bucket: views of ``buffer`` (one-dimensional ``uint8``), in the bucket's order."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"a bucket buffer is one-dimensional uint8, got {buffer.dtype} of shape {tuple(buffer.shape)}")
    metas = [tuple(m) for m in metas]
    need = bucket_nbytes(metas)
    if buffer.numel() < need:
        raise ValueError(f"bucket buffer of {buffer.numel()} bytes is shorter than its tensors' {need} bytes")
    out = []
    for name, dtype, shape, offset in metas:
        n = nbytes_of(dtype, shape)
        out.append((name, buffer[int(offset):int(offset) + n].view(dtype).view(tuple(shape))))
    return out
