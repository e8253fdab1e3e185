"""Moving a Megatron actor's state to host memory between phases, and back, bit for bit.

What a colocated actor must give up while the rollout engines generate on its GPUs: the parameters, the
gradient buffers, the distributed optimizer's state (main fp32 shards, Adam moments) and the reference model.
:class:`HostOffload` finds every tensor of those objects, groups them by the storage they live in (a
megatron-core DDP buffer holds many parameters; the distributed optimizer's params are views into it), copies
each storage's bytes to host memory and frees the storage in place (``resize_(0)``): every parameter, view and
optimizer reference keeps its identity, so nothing has to be re-bound on the way back. :meth:`HostOffload.onload`
re-allocates each storage and copies the bytes back.

Storages whose contents are dead between steps (``discard``: the gradient buffers, which the next step zeroes
before it accumulates, cluster review 3, G2) are not copied: they are freed on offload and come back zeroed, as
megatron-core's own ``_ParamAndGradBuffer.offload_to_cpu`` / ``reload_from_cpu`` and DeepSpeed's ZeRO-3 offload
treat gradients.

Host memory comes from a :class:`HostPool`: each storage gets one region, the same on every offload, so the pool
stops growing once every storage has been offloaded once (after the first optimizer step has created the Adam
state). The pool is made of slabs whose sizes are powers of two: torch's pinned-memory allocator
(``CachingHostAllocator``) rounds a request up to a power of two and never returns its blocks, so a per-storage
request such as 14.8 GB would hold 17.2 GB for good; a power-of-two request is taken as it is. The pool therefore
holds exactly the regions' bytes rounded up to :data:`HostPool.GRANULE` (regions start at multiples of
:data:`HostPool.ALIGN`): :meth:`HostPool.planned_bytes`.

``resident_bytes()`` is what the tracked storages hold on their device now (0 after ``offload``): the figure
the memory plan and the tests state. The storages are found once, at construction, from the objects handed
in; a storage allocated later (e.g. Adam state created by the first step) needs a new ``HostOffload``.
``where`` keeps only the tensors whose location (the names :func:`tensors_of` gives) it accepts, and
``exclude`` skips the storages another ``HostOffload`` tracks: the Megatron Ray actor offloads its weights
and its training state (gradients, optimizer) as two parts, since a forward needs the weights alone.
:meth:`HostOffload.host_view` reads an offloaded tensor where it lies in host memory (the colocated actor's
checkpoint save reads the optimizer state from there instead of bringing it back to the device).
"""

from __future__ import annotations

import bisect
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

__all__ = ["HostOffload", "HostPool", "tensors_of"]


def _optimizers(optimizer) -> List:
    """The torch optimizers inside a megatron-core optimizer (chained, distributed, mixed precision)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is not None:
        return [o for c in inner for o in _optimizers(c)]
    return [optimizer]


def _walk(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def tensors_of(modules: Iterable = (), optimizers: Iterable = ()) -> Iterator[Tuple[str, torch.Tensor]]:
    """(where, tensor) for every parameter, gradient, buffer, DDP param/grad buffer of ``modules`` and every
    state tensor and main-parameter shard of ``optimizers`` (megatron-core or torch)."""
    for i, module in enumerate(modules):
        if module is None:
            continue
        for name, p in module.named_parameters():
            yield f"module{i}.{name}", p
            for attr in ("grad", "main_grad"):
                g = getattr(p, attr, None)
                if isinstance(g, torch.Tensor):
                    yield f"module{i}.{name}.{attr}", g
        for name, b in module.named_buffers():
            yield f"module{i}.buffer.{name}", b
        for m in module.modules():  # megatron-core DDP: flat param / grad buffers per dtype (lists, not nn.Module.buffers)
            flat = [b for attr in ("buffers", "expert_parallel_buffers")
                    for b in (getattr(m, attr, None) if isinstance(getattr(m, attr, None), (list, tuple)) else [])]
            for j, buf in enumerate(flat):
                for attr in ("param_data", "grad_data"):
                    t = getattr(buf, attr, None)
                    if isinstance(t, torch.Tensor):
                        yield f"module{i}.ddp_buffer{j}.{attr}", t
    for i, opt in enumerate(optimizers):
        for k, inner in enumerate(_optimizers(opt)):
            torch_opt = getattr(inner, "optimizer", inner)
            for state in getattr(torch_opt, "state", {}).values():
                for t in _walk(state):
                    yield f"optimizer{i}.{k}.state", t
            for group in getattr(torch_opt, "param_groups", []):
                for t in _walk(group.get("params", [])):
                    yield f"optimizer{i}.{k}.param", t
            for attr in ("shard_fp32_from_float16_groups", "shard_fp32_groups", "fp32_from_float16_groups",
                         "shard_float16_groups", "model_float16_groups", "model_fp32_groups"):
                for t in _walk(getattr(inner, attr, None) or []):
                    yield f"optimizer{i}.{k}.{attr}", t


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class HostPool:
    """Host memory for offloaded storages, reused across offloads (module docstring).

    ``region(key, nbytes)`` gives storage ``key`` (its ``StorageImpl``, stable across ``resize_``) the same byte
    range of the pool every time; a new key (or a storage whose size changed) gets a new range at the end, and the
    pool grows by slabs whose sizes are the binary digits of the growth rounded up to :data:`GRANULE`, so every
    slab is a power of two (taken by torch's pinned allocator without rounding) and the pool's size is the regions'
    end rounded up to :data:`GRANULE`. ``pin``: page-locked slabs (the storages live on an accelerator)."""

    ALIGN = 64  # regions start on cache-line multiples, so any dtype can be viewed in place
    GRANULE = 4096  # the smallest slab (a page)

    def __init__(self, pin: bool = False):
        self.pin = bool(pin)
        self._slabs: List[torch.Tensor] = []
        self._starts: List[int] = []  # each slab's first byte in the pool
        self._regions: Dict[int, Tuple[int, int]] = {}  # key -> (first byte, bytes)
        self._end = 0

    @staticmethod
    def planned_bytes(sizes: Iterable[int]) -> int:
        """The pool's size after one region of each size: their aligned sum, rounded up to :data:`GRANULE`."""
        end = 0
        for n in sizes:
            end = _round_up(end, HostPool.ALIGN) + int(n)
        return _round_up(end, HostPool.GRANULE)

    def nbytes(self) -> int:
        """Host bytes the pool holds (every slab, whatever is in use)."""
        return sum(s.numel() for s in self._slabs)

    def slab_sizes(self) -> List[int]:
        return [s.numel() for s in self._slabs]

    def region(self, key: int, nbytes: int) -> int:
        """The first byte of ``key``'s region of ``nbytes`` (made, and the pool grown, on first use)."""
        got = self._regions.get(key)
        if got is not None and got[1] == nbytes:
            return got[0]
        start = _round_up(self._end, self.ALIGN)
        self._end = start + nbytes
        self._grow(_round_up(self._end, self.GRANULE))
        self._regions[key] = (start, nbytes)
        return start

    def _grow(self, size: int) -> None:
        need = size - self.nbytes()
        while need > 0:
            slab = 1 << (need.bit_length() - 1)  # the binary digits of the growth, largest first
            self._starts.append(self.nbytes())
            self._slabs.append(torch.empty(slab, dtype=torch.uint8, device="cpu", pin_memory=self.pin))
            need -= slab

    def _pieces(self, start: int, nbytes: int) -> Iterator[Tuple[torch.Tensor, int]]:
        """(slab slice, offset inside the region) covering ``[start, start + nbytes)``."""
        i = bisect.bisect_right(self._starts, start) - 1
        done = 0
        while done < nbytes:
            slab, first = self._slabs[i], start + done - self._starts[i]
            n = min(nbytes - done, slab.numel() - first)
            yield slab[first : first + n], done
            done += n
            i += 1

    def store(self, start: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy the bytes ``src`` (uint8) into the region at ``start``."""
        for piece, at in self._pieces(start, src.numel()):
            piece.copy_(src[at : at + piece.numel()], non_blocking=non_blocking)

    def load(self, start: int, dst: torch.Tensor) -> None:
        """Copy the region at ``start`` into ``dst`` (uint8)."""
        for piece, at in self._pieces(start, dst.numel()):
            dst[at : at + piece.numel()].copy_(piece)

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        """The region as uint8: the slab's memory itself, or a copy when the region spans two slabs."""
        pieces = [p for p, _ in self._pieces(start, nbytes)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class HostOffload:
    """Offload / onload every storage behind ``modules`` and ``optimizers`` (module docstring). ``discard``: names
    (as :func:`tensors_of` gives them) whose storages are dropped instead of copied and zeroed on the way back (a
    storage is dropped only when every tensor in it is named so). ``pool``: the :class:`HostPool` to copy into (a
    private one by default)."""

    def __init__(self, modules: Iterable = (), optimizers: Iterable = (),
                 where: Optional[Callable[[str], bool]] = None, exclude: Iterable["HostOffload"] = (),
                 discard: Optional[Callable[[str], bool]] = None, pool: Optional[HostPool] = None):
        self._storages: Dict[int, Tuple[torch.UntypedStorage, torch.device, int]] = {}
        self.where: Dict[int, str] = {}
        dropped: Dict[int, bool] = {}
        skip = {key for other in exclude for key in other._storages}
        for name, t in tensors_of(list(modules), list(optimizers)):
            if where is not None and not where(name):
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the StorageImpl: the same before and after resize_
            if not storage.nbytes() or key in skip:
                continue
            if key not in self._storages:
                self._storages[key] = (storage, t.device, storage.nbytes())
                self.where[key] = name
            dropped[key] = dropped.get(key, True) and discard is not None and discard(name)
        self._dropped = {key for key, d in dropped.items() if d}
        self.pool = pool if pool is not None else HostPool(
            pin=any(d.type != "cpu" for _, d, _ in self._storages.values()))
        self._at: Dict[int, int] = {}  # key -> first byte of its region, while offloaded
        self._offloaded = False

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def tracked_bytes(self) -> int:
        """Bytes of every tracked storage at full size."""
        return sum(n for _, _, n in self._storages.values())

    def dropped_bytes(self) -> int:
        """Bytes of the storages an offload drops (``discard``) instead of copying."""
        return sum(self._storages[k][2] for k in self._dropped)

    def resident_bytes(self) -> int:
        """Bytes the tracked storages hold on their device now."""
        return sum(s.nbytes() for s, _, _ in self._storages.values())

    def offload(self) -> int:
        """Copy each kept storage to host memory, drop the discarded ones, free all on their device; returns the
        bytes copied."""
        if self._offloaded:
            raise RuntimeError("HostOffload.offload: already offloaded (call onload first)")
        moved, asynchronous = 0, False
        for key, (storage, device, nbytes) in self._storages.items():
            if key in self._dropped:
                continue
            start = self.pool.region(key, nbytes)
            pinned = self.pool.pin and device.type != "cpu"  # the accelerator copies into page-locked memory
            self.pool.store(start, _byte_view(storage, device), non_blocking=pinned)
            asynchronous |= pinned
            self._at[key] = start
            moved += nbytes
        if asynchronous:
            torch.accelerator.synchronize()  # the copies above were queued on the accelerator
        for storage, _, _ in self._storages.values():
            storage.resize_(0)
        self._offloaded = True
        return moved

    def onload(self) -> int:
        """Re-allocate each storage on its device: the kept ones with their bytes, the dropped ones zeroed;
        returns the bytes copied back."""
        if not self._offloaded:
            raise RuntimeError("HostOffload.onload: nothing is offloaded")
        moved = 0
        for key, (storage, device, nbytes) in self._storages.items():
            storage.resize_(nbytes)
            if key in self._dropped:
                _byte_view(storage, device).zero_()
                continue
            self.pool.load(self._at[key], _byte_view(storage, device))
            moved += nbytes
        self._at.clear()
        self._offloaded = False
        return moved

    def host_view(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """``t`` as it lies in host memory while offloaded (same dtype, shape and strides; read it, do not write
        it), or None when its storage is not tracked here or not offloaded. A dropped storage has no bytes to read:
        ValueError."""
        key = t.untyped_storage()._cdata
        if not self._offloaded or key not in self._storages:
            return None
        if key in self._dropped:
            raise ValueError(f"{self.where[key]} was dropped on offload (a gradient buffer): it has no host copy")
        region = self.pool.view(self._at[key], self._storages[key][2])
        size = t.element_size()
        first = region.storage_offset()
        if first % size:  # a region of a slab always starts aligned (ALIGN); a copy starts at 0
            raise RuntimeError(f"host region of {self.where[key]} is not aligned to {size} bytes")
        return torch.empty(0, dtype=t.dtype).set_(region.untyped_storage(), first // size + t.storage_offset(),
                                                  t.size(), t.stride())
