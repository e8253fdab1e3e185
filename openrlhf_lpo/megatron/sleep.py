"""Sleep of the Megatron policy actor between phases (``--ds.enable_sleep`` with ``--train.colocate_all``; a mixin
of ``MegatronPolicyActor``).

After start-up and after every ``fit`` (OpenRLHF's trainer calls ``offload_states``) the parameters and the
optimizer state go to host memory (:class:`.offload.HostOffload`, bit-exact) and the DDP gradient buffers are
dropped (their contents are dead: ``train_step`` zeroes them before it accumulates; they come back zeroed,
cluster review 3, G2); ``reload_states`` brings everything back before ``fit``. The weights alone come back for the
old-log-prob ``forward`` and stay until the next offload, and for the weight sync (offloaded again after it, since
generation follows). A checkpoint save brings nothing back: it reads the optimizer state where it lies in host
memory (:meth:`SleepMixin.host_view`, ``actor_checkpoints.py``), so the save phase of the colocated plan holds
the save's transients only (``colocation_memory.py``, G1). Both parts share one :class:`.offload.HostPool` per
actor: its size stops changing once the Adam state exists (after the first ``fit``) and is what
``host_memory.py`` plans.
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch


GRADIENT_SUFFIXES = (".grad", ".main_grad", ".grad_data")


def _is_weight(where: str) -> bool:
    """Tensors a forward reads (parameters, module buffers, DDP parameter buffers), by ``offload.tensors_of``'s
    names; the rest of a model (gradients, DDP gradient buffers) is training state."""
    return not where.endswith(GRADIENT_SUFFIXES)


def _is_gradient(where: str) -> bool:
    """Gradients and DDP gradient buffers: dropped on sleep, zeroed on wake (the next step zeroes them anyway)."""
    return where.endswith(GRADIENT_SUFFIXES)


class SleepMixin:
    """Needs ``self.actor``; keeps ``self._weights_off`` / ``self._state_off`` (HostOffloads while asleep), the
    actor's :class:`.offload.HostPool` (``self._host_pool``, made on the first sleep) and ``self.sleep_log``."""

    def reload_states(self):
        """Before ``fit`` (OpenRLHF's trainer, ``--ds.enable_sleep``): everything back on the device, bit-exact."""
        self._onload()

    def offload_states(self):
        """After ``fit`` and at start-up (``--ds.enable_sleep``): parameters and the optimizer's state (main
        shards, Adam moments) to host memory, the DDP gradient buffers dropped; nothing of them stays on the
        device. Each rank logs the bytes moved and dropped, the parameter bytes left on the device (0) and the size
        of its host pool."""
        import sys

        import torch.distributed as dist

        moved = self._offload()
        params = sum(p.untyped_storage().nbytes() for p in self.actor.model.parameters())
        entry = {"rank": dist.get_rank(), "weights_bytes": moved.get("weights", 0),
                 "state_bytes": moved.get("state", 0), "grad_bytes_dropped": moved.get("dropped", 0),
                 "param_bytes_resident": params,
                 "tracked_bytes_resident": sum(o.resident_bytes() for o in (self._weights_off, self._state_off) if o),
                 "host_pool_bytes": self._host_pool.nbytes()}
        self.sleep_log.append(entry)
        print(f"[megatron] rank {entry['rank']} asleep: {entry['weights_bytes']} weight bytes and "
              f"{entry['state_bytes']} optimizer bytes moved to host memory, {entry['grad_bytes_dropped']} gradient "
              f"bytes dropped (zeroed on wake); parameter bytes on the device: {params}; host pool: "
              f"{entry['host_pool_bytes']} bytes", file=sys.stderr, flush=True)

    def empty_cache(self):
        """Hand the allocator's cached blocks back to the device (the engines use them while the actor sleeps)."""
        from openrlhf_lpo.megatron.device import accelerator_available

        if accelerator_available():
            torch.accelerator.empty_cache()

    def _offload(self, weights: bool = True, state: bool = True) -> Dict[str, int]:
        """Offload the training state and / or the weights (whatever is still resident); bytes moved of each and
        the gradient bytes dropped."""
        from openrlhf_lpo.megatron.offload import HostOffload, HostPool

        moved: Dict[str, int] = {}
        model, optimizer = self.actor.model, self.actor.optimizer
        if getattr(self, "_host_pool", None) is None:  # one pool per actor, reused by every sleep
            self._host_pool = HostPool(pin=any(p.device.type != "cpu" for p in model.parameters()))
        pool = self._host_pool
        weights_off = HostOffload([model], where=_is_weight, pool=pool) \
            if weights and self._weights_off is None else None
        if state and self._state_off is None:  # built while the weights' storages can still be told apart
            off = HostOffload([model], [optimizer], exclude=[weights_off or HostOffload([model], where=_is_weight)],
                              discard=_is_gradient, pool=pool)
            moved["state"] = off.offload()
            moved["dropped"] = off.dropped_bytes()
            self._state_off = off
        if weights_off is not None:
            moved["weights"] = weights_off.offload()
            self._weights_off = weights_off
        self.empty_cache()
        return moved

    def _onload(self, weights: bool = True, state: bool = True) -> None:
        if weights and getattr(self, "_weights_off", None) is not None:
            self._weights_off.onload()
            self._weights_off = None
        if state and getattr(self, "_state_off", None) is not None:
            self._state_off.onload()
            self._state_off = None

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where it lies now: its host copy while it is offloaded, else ``t`` itself (what the checkpoint
        save reads, so the optimizer state never comes back to the device for it)."""
        for off in (getattr(self, "_weights_off", None), getattr(self, "_state_off", None)):
            view = off.host_view(t) if off is not None else None
            if view is not None:
                return view
        return t

    def resident_state_bytes(self) -> int:
        """Bytes the offloaded parts' storages hold on the device now (0 while asleep)."""
        return sum(o.resident_bytes() for o in (getattr(self, "_weights_off", None),
                                                getattr(self, "_state_off", None)) if o is not None)

    @contextlib.contextmanager
    def _awake(self, state: bool = True):
        """Inside: the weights (and the training state unless ``state=False``) on the device; what was offloaded
        before goes back to host memory after."""
        was = (getattr(self, "_weights_off", None) is not None, getattr(self, "_state_off", None) is not None)
        self._onload(state=state)
        try:
            yield
        finally:
            if was[0] or (state and was[1]):
                self._offload(weights=was[0], state=state and was[1])
