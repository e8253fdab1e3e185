"""vLLM worker extension for the bucketed weight sync (issue 43, item 5): OpenRLHF's ``WorkerWrap`` (its
per-tensor ``update_weight`` / ``update_weight_cuda_ipc`` and ``init_process_group`` stay) plus one method per
route that takes a whole bucket (:mod:`openrlhf_lpo.engines.buckets`):

* ``update_weight_bucket(metas, empty_cache)``: a flat ``uint8`` buffer of :func:`bucket_nbytes` bytes arrives over
  the model-update group OpenRLHF set up (PyNccl, or Ray collectives with ``--vllm.sync_with_ray``), as its
  ``update_weight`` receives one tensor;
* ``update_weight_bucket_ipc(metas, ipc_handles, empty_cache)``: the handle of this worker's GPU (keyed by
  OpenRLHF's ``get_physical_gpu_id``), rebuilt on this worker's device as ``update_weight_cuda_ipc`` does
  (:class:`~openrlhf_lpo.engines.ipc.DeviceIPC`);

then the named views of the buffer go to ``model.load_weights`` in one call (vLLM cuts its own TP shard out of
each full tensor). Like upstream, every tensor must be in the engine's dtype. ``weight_sync_device_id`` is the key
this worker looks its handle up by. vLLM's actor (``openrlhf/seeded_vllm.py``) starts its workers with this class
and calls these methods in sequence order (:mod:`openrlhf_lpo.engines.weight_updates`). Imported by vLLM's
workers; needs vLLM and a GPU (not run in this repository's CPU tests).
"""

from __future__ import annotations

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_lpo.engines.buckets import bucket_nbytes, unpack
from openrlhf_lpo.engines.ipc import transport_for

WORKER_EXTENSION = "openrlhf_lpo.engines.vllm_worker.BucketWorkerWrap"


class BucketWorkerWrap(WorkerWrap):
    """``WorkerWrap`` plus the bucket methods (see the module docstring)."""

    def weight_sync_device_id(self) -> str:
        return transport_for(self.device).device_id()

    def _check_dtypes(self, metas) -> None:
        want = self.model_config.dtype
        bad = sorted({str(m[1]) for m in metas if m[1] != want})
        if bad:
            raise ValueError(f"weight bucket holds {bad}, the engine runs {want}: the sender casts to the engine's dtype")

    def _load_bucket(self, buffer: torch.Tensor, metas) -> int:
        weights = unpack(buffer, metas)
        self.model_runner.model.load_weights(weights=weights)
        torch.accelerator.synchronize()  # the buffer (the sender's, by IPC) may be reused once this returns
        return len(weights)

    def update_weight_bucket(self, metas, empty_cache=False) -> int:
        self._check_dtypes(metas)
        buffer = torch.empty(bucket_nbytes(metas), dtype=torch.uint8, device=self.device)
        if self._model_update_with_ray:
            import ray.util.collective as collective

            collective.broadcast(buffer, 0, group_name=self._model_update_group)
        else:
            self._model_update_group.broadcast(buffer, src=0)  # on the current stream, as upstream
        n = self._load_bucket(buffer, metas)
        del buffer
        return n

    def update_weight_bucket_ipc(self, metas, ipc_handles=None, empty_cache=False) -> int:
        self._check_dtypes(metas)
        transport = transport_for(self.device)  # accelerator IPC: the handle rebuilt on this worker's device
        key = transport.device_id()
        if not ipc_handles or key not in ipc_handles:
            raise ValueError(f"update_weight_bucket_ipc: no handle for this worker's device {key!r} among "
                             f"{sorted(ipc_handles or {})}")
        return self._load_bucket(transport.rebuild(ipc_handles[key]), metas)
