"""Sleep of the Megatron policy actor between phases (``--ds.enable_sleep`` with ``--train.colocate_all``; a mixin
of ``MegatronPolicyActor``).

After start-up and after every ``fit`` (OpenRLHF's trainer calls ``offload_states``) the parameters, DDP gradient
buffers and optimizer state go to host memory (:class:`.offload.HostOffload`, bit-exact); ``reload_states`` brings
them back before ``fit``. The weights alone come back for the old-log-prob ``forward`` and stay until the next
offload, and for the weight sync (offloaded again after it, since generation follows); checkpoints bring everything
back for the save.
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch


def _is_weight(where: str) -> bool:
    """Tensors a forward reads (parameters, module buffers, DDP parameter buffers), by ``offload.tensors_of``'s
    names; the rest of a model (gradients, DDP gradient buffers) is training state."""
    return not where.endswith((".grad", ".main_grad", ".grad_data"))


class SleepMixin:
    """Needs ``self.actor``; keeps ``self._weights_off`` / ``self._state_off`` (HostOffloads while asleep) and
    ``self.sleep_log``."""

    def reload_states(self):
        """Before ``fit`` (OpenRLHF's trainer, ``--ds.enable_sleep``): everything back on the device, bit-exact."""
        self._onload()

    def offload_states(self):
        """After ``fit`` and at start-up (``--ds.enable_sleep``): parameters, DDP gradient buffers and the
        optimizer's state (main shards, Adam moments) to host memory; nothing of them stays on the device.
        Each rank logs the bytes moved and the parameter bytes left on the device (0)."""
        import sys

        import torch.distributed as dist

        moved = self._offload()
        params = sum(p.untyped_storage().nbytes() for p in self.actor.model.parameters())
        entry = {"rank": dist.get_rank(), "weights_bytes": moved.get("weights", 0),
                 "state_bytes": moved.get("state", 0), "param_bytes_resident": params,
                 "tracked_bytes_resident": sum(o.resident_bytes() for o in (self._weights_off, self._state_off) if o)}
        self.sleep_log.append(entry)
        print(f"[megatron] rank {entry['rank']} asleep: {entry['weights_bytes']} weight bytes and "
              f"{entry['state_bytes']} gradient/optimizer bytes moved to host memory; parameter bytes on the "
              f"device: {params}", file=sys.stderr, flush=True)

    def empty_cache(self):
        """Hand the allocator's cached blocks back to the device (the engines use them while the actor sleeps)."""
        from openrlhf_lpo.megatron.device import accelerator_available

        if accelerator_available():
            torch.accelerator.empty_cache()

    def _offload(self, weights: bool = True, state: bool = True) -> Dict[str, int]:
        """Offload the training state and / or the weights (whatever is still resident); bytes moved of each."""
        from openrlhf_lpo.megatron.offload import HostOffload

        moved: Dict[str, int] = {}
        model, optimizer = self.actor.model, self.actor.optimizer
        weights_off = HostOffload([model], where=_is_weight) if weights and self._weights_off is None else None
        if state and self._state_off is None:  # built while the weights' storages can still be told apart
            off = HostOffload([model], [optimizer], exclude=[weights_off or HostOffload([model], where=_is_weight)])
            moved["state"] = off.offload()
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
