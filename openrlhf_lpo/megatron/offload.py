"""Moving a Megatron actor's state to host memory between phases, and back, bit for bit.

What a colocated actor must give up while the rollout engines generate on its GPUs: the parameters, the
gradient buffers, the distributed optimizer's state (main fp32 shards, Adam moments) and the reference model.
:class:`HostOffload` finds every tensor of those objects, groups them by the storage they live in (a
megatron-core DDP buffer holds many parameters; the distributed optimizer's params are views into it), copies
each storage's bytes to a host buffer (pinned when the storage is on an accelerator) and frees the storage in
place (``resize_(0)``): every parameter, view and optimizer reference keeps its identity, so nothing has to be
re-bound on the way back. :meth:`HostOffload.onload` re-allocates each storage and copies the bytes back.

``resident_bytes()`` is what the tracked storages hold on their device now (0 after ``offload``): the figure
the memory plan and the tests state. The storages are found once, at construction, from the objects handed
in; a storage allocated later (e.g. Adam state created by the first step) needs a new ``HostOffload``.
``where`` keeps only the tensors whose location (the names :func:`tensors_of` gives) it accepts, and
``exclude`` skips the storages another ``HostOffload`` tracks: the Megatron Ray actor offloads its weights
and its training state (gradients, optimizer) as two parts, since a forward needs the weights alone.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

__all__ = ["HostOffload", "tensors_of"]


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


class HostOffload:
    """Offload / onload every storage behind ``modules`` and ``optimizers`` (module docstring)."""

    def __init__(self, modules: Iterable = (), optimizers: Iterable = (),
                 where: Optional[Callable[[str], bool]] = None, exclude: Iterable["HostOffload"] = ()):
        self._storages: Dict[int, Tuple[torch.UntypedStorage, torch.device, int]] = {}
        self.where: Dict[int, str] = {}
        skip = {key for other in exclude for key in other._storages}
        for name, t in tensors_of(list(modules), list(optimizers)):
            if where is not None and not where(name):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else id(storage)
            if storage.nbytes() and key not in self._storages and key not in skip:
                self._storages[key] = (storage, t.device, storage.nbytes())
                self.where[key] = name
        self._host: Dict[int, torch.Tensor] = {}

    @property
    def offloaded(self) -> bool:
        return bool(self._host)

    def tracked_bytes(self) -> int:
        """Bytes of every tracked storage at full size (what an offload moves)."""
        return sum(n for _, _, n in self._storages.values())

    def resident_bytes(self) -> int:
        """Bytes the tracked storages hold on their device now."""
        return sum(s.nbytes() for s, _, _ in self._storages.values())

    def offload(self) -> int:
        """Copy each storage to host memory and free it on its device; returns the bytes moved."""
        if self._host:
            raise RuntimeError("HostOffload.offload: already offloaded (call onload first)")
        moved, asynchronous = 0, False
        for key, (storage, device, nbytes) in self._storages.items():
            pin = device.type != "cpu"  # host memory the accelerator copies into directly
            host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_byte_view(storage, device), non_blocking=pin)
            asynchronous |= pin
            self._host[key] = host
            moved += nbytes
        if asynchronous:
            torch.accelerator.synchronize()  # the copies above were queued on the accelerator
        for storage, _, _ in self._storages.values():
            storage.resize_(0)
        return moved

    def onload(self) -> int:
        """Re-allocate each storage on its device and copy its bytes back; returns the bytes moved."""
        if not self._host:
            raise RuntimeError("HostOffload.onload: nothing is offloaded")
        moved = 0
        for key, (storage, device, nbytes) in self._storages.items():
            storage.resize_(nbytes)
            _byte_view(storage, device).copy_(self._host[key])
            moved += nbytes
        self._host.clear()
        return moved
