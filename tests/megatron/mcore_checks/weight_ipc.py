"""The colocated weight route (openrlhf_lpo/megatron/weight_sync.py) with the shared-memory stand-in for CUDA IPC:
at TP2 and at PP2 (DP2 each, so both replicas hand over handles), in the actor's fp32 and in the vLLM engines' bf16,
every rank exports through ``send_weights(export_hf_weights(dst=None))``; a receiver on rank 0 rebuilds every
rank's handle of every tensor (those of ranks 1-3 come from other processes) and each must equal the NCCL route's
tensor (``export_hf_weights(dst=0)``) bit for bit, with the same name, order, dtype and shape."""

import torch
import torch.distributed as dist

from openrlhf_lpo.megatron.actor import MegatronActor
from openrlhf_lpo.megatron.weight_sync import SharedMemoryIPC, send_weights

from . import world as W
from .layouts import Layout
from .references import make_hf
from .registry import check


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class RebuildingReceiver:
    """Stands in for the colocated engines' ``update_weight_cuda_ipc`` (the transport's receiving side is the
    real one): rebuilds the handle of every device and keeps a copy of each tensor."""

    def __init__(self):
        self.calls = []  # (name, announced dtype, announced shape, empty_cache, {device id: tensor})
        self.update_weight_cuda_ipc = _Remote(self._update)
        self.reset_prefix_cache = _Remote(lambda: self.calls.append(("reset",)))

    def _update(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        ipc = SharedMemoryIPC()
        rebuilt = {key: ipc.rebuild(h).clone() for key, h in ipc_handles.items()}
        self.calls.append((name, dtype, tuple(shape), empty_cache, rebuilt))
        return len(self.calls)


@check("weight_ipc")
def weight_ipc():
    import ray

    cfg, hf = make_hf("qwen3", True)  # tied embeddings: the export must name the tensors as HF does
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    saved_get = ray.get
    ray.get = lambda refs: refs  # no Ray cluster: the stand-in's calls return their results at once
    rec = {}
    try:
        for name, lay in (("tp2", Layout(tp=2, pp=1)), ("pp2", Layout(tp=1, pp=2))):
            a = MegatronActor(cfg, lay.actor_config(), hf_weights=hf_sd)
            for dtype in (None, torch.bfloat16):
                key = f"{name}/{'bf16' if dtype is not None else 'fp32'}"
                nccl = list(a.export_hf_weights(dtype, dst=0))  # global rank 0 only
                receiver = RebuildingReceiver()
                info = send_weights(a.export_hf_weights(dtype), [receiver] if W.RANK == 0 else [],
                                    SharedMemoryIPC(), in_flight=2, reset_prefix_cache=True)
                r = {"tensors": info["tensors"], "device_ids": info["device_ids"]}
                if W.RANK == 0:
                    updates = [c for c in receiver.calls if c[0] != "reset"]
                    r["names_equal"] = [c[0] for c in updates] == [n for n, _ in nccl]
                    r["nccl_tensors"] = len(nccl)
                    r["empty_cache"] = [i for i, c in enumerate(updates) if c[3]]
                    r["reset_last"] = receiver.calls[-1] == ("reset",)
                    r["handles_per_tensor"] = sorted({len(c[4]) for c in updates})
                    r["keys_equal_device_ids"] = all(sorted(c[4]) == sorted(info["device_ids"]) for c in updates)
                    bad = []
                    for (n, announced, shape, _, rebuilt), (m, ref) in zip(updates, nccl):
                        if n != m or announced != ref.dtype or shape != tuple(ref.shape):
                            bad.append(f"{n}: announced {announced} {shape}")
                        for dev, t in rebuilt.items():
                            if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t, ref):
                                bad.append(f"{n} from {dev}")
                    r["mismatches"] = bad
                    r["dtypes"] = sorted({str(c[4][k].dtype) for c in updates for k in c[4]})
                    r["elements"] = sum(t.numel() for _, t in nccl)
                rec[key] = r
            del a
            dist.barrier()
    finally:
        ray.get = saved_get
    return {"weight_ipc": rec}
