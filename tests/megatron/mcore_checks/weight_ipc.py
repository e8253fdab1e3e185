"""The colocated weight route (openrlhf_lpo/megatron/weight_sync.py) with the shared-memory stand-in for CUDA IPC:
at TP2 and at PP2 (DP2 each, so both replicas hand over handles), in the actor's fp32 and in the vLLM engines' bf16,
in buckets of 13107 bytes (--megatron.sync_bucket_mb 0.0125), every rank exports through
``send_weights(export_hf_weights(dst=None))``; a receiver on rank 0 (the node's leader: one host, one node group)
rebuilds every rank's handle of every bucket (those of ranks 1-3 come from other processes) and each unpacked
tensor must equal the NCCL route's tensor (``export_hf_weights(dst=0)``) bit for bit, with the same name, order,
dtype and shape; the calls are numbered 0, 1, ... per sender."""

import torch
import torch.distributed as dist

from openrlhf_lpo.engines.buckets import unpack
from openrlhf_lpo.megatron.actor import MegatronActor
from openrlhf_lpo.megatron.weight_sync import SharedMemoryIPC, WeightSender, node_route, send_weights

from . import world as W
from .layouts import Layout
from .references import make_hf
from .registry import check

BUCKET_BYTES = int(0.0125 * (1 << 20))


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class RebuildingReceiver:
    """Stands in for the colocated engines' ``update_weight_bucket_ipc`` (the transport's receiving side and the
    unpacking are the real ones): rebuilds the handle of every device and keeps a copy of each tensor."""

    def __init__(self, device_ids):
        self.calls = []  # (seq, [(name, {device id: tensor})], empty_cache, bucket bytes)
        self.update_weight_bucket_ipc = _Remote(self._update)
        self.weight_sync_device_ids = _Remote(lambda: list(device_ids))
        self.reset_prefix_cache = _Remote(lambda: self.calls.append(("reset",)))

    def _update(self, seq, metas, ipc_handles=None, empty_cache=False):
        ipc = SharedMemoryIPC()
        buffers = {key: ipc.rebuild(h) for key, h in ipc_handles.items()}
        tensors = {key: dict((n, t.clone()) for n, t in unpack(b, metas)) for key, b in buffers.items()}
        self.calls.append((seq, [(m[0], {k: tensors[k][m[0]] for k in tensors}) for m in metas], empty_cache,
                           sorted({int(b.numel()) for b in buffers.values()})))
        return len(self.calls)


@check("weight_ipc")
def weight_ipc():
    import ray

    cfg, hf = make_hf("qwen3", True)  # tied embeddings: the export must name the tensors as HF does
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    saved_get = ray.get
    ray.get = lambda refs: refs  # no Ray cluster: the stand-in's calls return their results at once
    rec = {}
    route = node_route()
    ids = [None] * W.WORLD
    dist.all_gather_object(ids, SharedMemoryIPC().device_id())
    try:
        for name, lay in (("tp2", Layout(tp=2, pp=1)), ("pp2", Layout(tp=1, pp=2))):
            a = MegatronActor(cfg, lay.actor_config(), hf_weights=hf_sd)
            sender = WeightSender(in_flight=2)  # numbers run on over both dtypes' syncs
            for dtype in (None, torch.bfloat16):
                key = f"{name}/{'bf16' if dtype is not None else 'fp32'}"
                nccl = list(a.export_hf_weights(dtype, dst=0))  # global rank 0 only
                receiver = RebuildingReceiver(ids)
                info = send_weights(a.export_hf_weights(dtype), [receiver] if W.RANK == 0 else [],
                                    SharedMemoryIPC(), route=route, bucket_bytes=BUCKET_BYTES,
                                    reset_prefix_cache=True, sender=sender)
                r = {k: info[k] for k in ("tensors", "buckets", "calls", "engines", "device_ids", "seq")}
                r["route_ranks"] = route.ranks
                if W.RANK == 0:
                    updates = [c for c in receiver.calls if c[0] != "reset"]
                    got = [item for c in updates for item in c[1]]
                    r["seqs"] = [c[0] for c in updates]
                    r["names_equal"] = [n for n, _ in got] == [n for n, _ in nccl]
                    r["nccl_tensors"] = len(nccl)
                    r["empty_cache"] = [i for i, c in enumerate(updates) if c[2]]
                    r["reset_last"] = receiver.calls[-1] == ("reset",)
                    r["per_bucket"] = [[len(c[1]), c[3]] for c in updates]
                    r["handles_per_tensor"] = sorted({len(d) for _, d in got})
                    r["keys_equal_device_ids"] = all(sorted(d) == sorted(info["device_ids"]) for _, d in got)
                    bad = []
                    for (n, rebuilt), (m, ref) in zip(got, nccl):
                        if n != m:
                            bad.append(f"{n} != {m}")
                        for dev, t in rebuilt.items():
                            if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t, ref):
                                bad.append(f"{n} from {dev}")
                    r["mismatches"] = bad
                    r["dtypes"] = sorted({str(t.dtype) for _, d in got for t in d.values()})
                    r["elements"] = sum(t.numel() for _, t in nccl)
                rec[key] = r
            del a
            dist.barrier()
    finally:
        ray.get = saved_get
        dist.destroy_process_group(route.group)
    return {"weight_ipc": rec}
