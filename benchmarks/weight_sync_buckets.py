"""Weight sync into the rollout engines: one tensor per call (before) vs flat buckets (after), same run.

    python benchmarks/weight_sync_buckets.py [--model examples/model_configs/qwen3-8b] [--bucket-mb 512]
                                             [--scale 256] [--syncs 3]

1. **Calls per sync at the real shapes**: the model's HF tensors (names and shapes from its ``config.json``, built
   on the meta device: no weights) in the engines' bf16, cut by the sender's own rule
   (:func:`openrlhf_lpo.engines.buckets.plan_buckets`). Before: one engine call per tensor and engine (OpenRLHF
   0.11.2's ``update_weight`` / ``update_weight_cuda_ipc``) and, on the IPC route, one all-gather of handles per
   tensor over the world; after: one call per bucket and engine, one all-gather per bucket over the node.

2. **CPU time per sync**, measured here on a local Ray cluster: two actor ranks (a gloo world, one node) and two
   engines on two one-GPU bundles (logical GPUs), every tensor of the model with its element count divided by
   ``--scale`` (the same 399 tensors for Qwen3-8B, 1/scale of the bytes, buckets of ``--bucket-mb / scale``: the
   same number of calls as at full size). Engines are the CPU rollout engine's receiving code
   (:class:`~openrlhf_lpo.engines.cpu_engine.CPURolloutEngine`: rebuild the handle, unpack, copy, in sequence
   order) without its HF model (the 8B names fit no tiny model; loading is the same work before and after).

   * IPC route, before: the per-tensor sender this project ran until issue 43 (each rank makes a handle of each
     tensor, an all-gather over the world per tensor, rank 0 calls ``update_weight_cuda_ipc`` on every engine, 3
     tensors in flight), reimplemented below as it was; after: :meth:`WeightSender.send_ipc`.
   * Broadcast route (a gloo group of the driver and the two engines standing in for OpenRLHF's model-update
     group), before: per tensor ``update_weight(name, dtype, shape)`` announced to every engine and broadcast (as
     OpenRLHF's worker receives it), 3 in flight; after: :meth:`WeightSender.stream` (one
     ``update_weight_bucket`` and one broadcast per bucket; the engines receive the buffer and unpack it as the
     vLLM worker extension does).

   Reported per sync (mean of ``--syncs`` after a warm-up): wall seconds, CPU seconds of the senders (the ranks,
   or the driver) and of the engines, and before/after ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from openrlhf_lpo.engines.buckets import MB, plan_buckets  # noqa: E402

IN_FLIGHT_BEFORE = 3  # the per-tensor senders kept 3 calls in flight


def model_items(model_dir: str, dtype=torch.bfloat16):
    """``(name, dtype, shape)`` of every HF tensor of the model, in its state-dict order (meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return [(n, dtype, tuple(p.shape)) for n, p in model.state_dict().items()]


def plan(items, bucket_mb: float):
    buckets = plan_buckets(items, int(bucket_mb * MB))
    nbytes = sum(torch.empty((), dtype=d).element_size() * torch.Size(s).numel() for _, d, s in items)
    return {"tensors": len(items), "gb": nbytes / 1e9, "buckets": len(buckets),
            "alone": sum(alone for _, alone in buckets),
            "largest_mb": max(torch.Size(s).numel() * 2 for _, _, s in items) / MB}


def scaled(items, scale: int, seed: int = 0):
    """The stream at 1/scale of the elements: each tensor's first dimension divided (at least 1 row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, dtype, shape in items:
        shape = (max(1, shape[0] // scale),) + tuple(shape[1:]) if len(shape) > 1 else (max(1, shape[0] // scale),)
        out.append((name, torch.randn(shape, generator=g).to(dtype)))
    return out


# ----------------------------------------------------------------------------- Ray actors (defined in main)


def run(args) -> dict:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from openrlhf_lpo.engines.cpu_engine import CPURolloutEngine

    items = model_items(args.model)
    bucket_bytes = max(1, int(args.bucket_mb * MB / args.scale))

    class BenchEngine(CPURolloutEngine):
        """The CPU engine's receiving code without its model (see the module docstring)."""

        def __init__(self):
            self._ipc_pending = {}
            self.num_weight_updates = 0
            self.group = None

        def update_weights(self, state):
            self.num_weight_updates += 1
            self.loaded = len(state)

        def cpu(self):
            return time.process_time()

        def join(self, port, rank, world):
            self.group = _gloo(port, rank, world)

        async def update_weight(self, name, dtype, shape, empty_cache=False):  # OpenRLHF's per-tensor receive
            weight = torch.empty(shape, dtype=dtype)  # (async as vLLM's actor: runs in the order Ray starts it)
            _bcast(self.group, weight)
            return self._take([(name, weight)], empty_cache)

        def _receive_bucket(self, metas, empty_cache):  # the vLLM worker extension's receive, on gloo
            from openrlhf_lpo.engines.buckets import bucket_nbytes, unpack

            buffer = torch.empty(bucket_nbytes(metas), dtype=torch.uint8)
            _bcast(self.group, buffer)
            return self._take(unpack(buffer, metas), empty_cache)

    class Rank:
        def __init__(self, rank, world, port, scale):
            import torch.distributed as dist

            torch.set_num_threads(1)
            from datetime import timedelta

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=120))
            self.stream = scaled(items, scale)
            self.sender = self.route = None

        def sync(self, engines, mode, bucket_bytes):
            from openrlhf_lpo.megatron.weight_sync import SharedMemoryIPC, WeightSender, node_route

            if self.sender is None:
                self.sender, self.route = WeightSender(), node_route()
            c0, t0 = time.process_time(), time.time()
            fresh = ((n, t.clone()) for n, t in self.stream)  # the export makes new tensors at every sync
            if mode == "ready":
                return 0.0, 0.0, 0
            if mode == "after":
                info = self.sender.send_ipc(fresh, engines, SharedMemoryIPC(), self.route, bucket_bytes)
                calls = info["calls"]
            else:
                calls = per_tensor_ipc(fresh, engines, SharedMemoryIPC())
            return time.process_time() - c0, time.time() - t0, calls

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}})
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready())
    on = lambda b: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b)  # noqa: E731
    Eng = ray.remote(BenchEngine)
    engines = [Eng.options(num_cpus=0.1, num_gpus=0.2, scheduling_strategy=on(b)).remote() for b in range(2)]
    port = _free_port()
    ranks = [ray.remote(Rank).options(num_cpus=0.1, num_gpus=0.2, scheduling_strategy=on(r)).remote(
        r, 2, port, args.scale) for r in range(2)]
    out = {}

    def get(refs, what):
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=args.timeout)
        if waiting:
            raise TimeoutError(f"{what}: no answer within {args.timeout:g} s")
        return ray.get(refs)

    def engines_cpu():
        return sum(get([e.cpu.remote() for e in engines], "engines"))

    get([e.cpu.remote() for e in engines] + [r.sync.remote([], "ready", 1) for r in ranks], "start-up")
    _say("actors up")

    for mode in ("before", "after"):  # the IPC route
        rows = []
        for i in range(args.syncs + 1):
            e0 = engines_cpu()
            res = get([r.sync.remote(engines, mode, bucket_bytes) for r in ranks], f"ipc/{mode} sync {i}")
            _say(f"ipc/{mode} sync {i}: {res[0][1]:.2f} s")
            if i:  # the first is a warm-up
                rows.append((sum(c for c, _, _ in res), max(w for _, w, _ in res), engines_cpu() - e0, res[0][2]))
        out[f"ipc/{mode}"] = _mean(rows)
    # the broadcast route: the driver is rank 0 of a gloo group with the two engines
    stream = scaled(items, args.scale)
    bport = _free_port()
    joins = [e.join.remote(bport, i + 1, 3) for i, e in enumerate(engines)]
    group = _gloo(bport, 0, 3)
    get(joins, "gloo group")
    from openrlhf_lpo.megatron.weight_sync import WeightSender

    sender = WeightSender()
    # the engines apply one sender's numbers: continue where the IPC route's leader (rank 0) left them
    sender.seq = get([engines[0].weight_update_stats.remote()], "engine stats")[0]["next_seq"]
    for mode in ("before", "after"):
        rows = []
        for i in range(args.syncs + 1):
            e0, c0, t0 = engines_cpu(), time.process_time(), time.time()
            fresh = ((n, t.clone()) for n, t in stream)
            if mode == "after":
                calls = sender.stream(fresh, engines, lambda b: _bcast(group, b), bucket_bytes)["calls"]
            else:
                calls = per_tensor_broadcast(fresh, engines, group)
            _say(f"broadcast/{mode} sync {i}: {time.time() - t0:.2f} s")
            if i:
                rows.append((time.process_time() - c0, time.time() - t0, engines_cpu() - e0, calls))
        out[f"broadcast/{mode}"] = _mean(rows)
    ray.shutdown()
    return out


def per_tensor_ipc(named, engines, transport):
    """The IPC sender before issue 43 (one tensor per call; its code as it was, less comments)."""
    import ray
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    key = transport.device_id()
    pending: deque = deque()
    items = list(named)
    calls = 0
    for i, (name, tensor) in enumerate(items):
        last = i == len(items) - 1
        tensor = tensor.detach().contiguous()
        gathered = [None] * world
        dist.all_gather_object(gathered, {key: transport.export(tensor)})
        if rank == 0:
            handles = {k: v for d in gathered for k, v in d.items()}
            refs = [e.update_weight_cuda_ipc.remote(name, dtype=tensor.dtype, shape=tuple(tensor.shape),
                                                    ipc_handles=handles, empty_cache=last) for e in engines]
            calls += len(refs)
            pending.append((refs, tensor))
            while len(pending) > IN_FLIGHT_BEFORE:
                ray.get(pending.popleft()[0])
        else:
            pending.append(tensor)
            while len(pending) > IN_FLIGHT_BEFORE + 1:
                pending.popleft()
    if rank == 0:
        while pending:
            ray.get(pending.popleft()[0])
    dist.barrier()
    return calls


def per_tensor_broadcast(named, engines, group):
    """The broadcast stream before issue 43: per tensor ``update_weight`` to every engine, then the broadcast."""
    import ray

    pending: deque = deque()
    calls = 0
    for name, t in named:
        t = t.contiguous()
        refs = [e.update_weight.remote(name, dtype=t.dtype, shape=t.shape, empty_cache=False) for e in engines]
        calls += len(refs)
        _bcast(group, t)
        pending.append((refs, t))
        if len(pending) > IN_FLIGHT_BEFORE:
            ray.get(pending.popleft()[0])
    while pending:
        ray.get(pending.popleft()[0])
    return calls


def _gloo(port, rank, world):
    from torch.distributed import ProcessGroupGloo, TCPStore

    from datetime import timedelta

    store = TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    return ProcessGroupGloo(store, rank, world, timedelta(seconds=120))


def _bcast(group, tensor):
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _say(msg: str) -> None:
    print(f"[weight_sync_buckets] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mean(rows):
    n = len(rows)
    return {"sender_cpu_s": sum(r[0] for r in rows) / n, "wall_s": sum(r[1] for r in rows) / n,
            "engines_cpu_s": sum(r[2] for r in rows) / n, "calls": rows[0][3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "examples/model_configs/qwen3-8b"))
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--scale", type=int, default=256)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a sync may take before the run stops")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    items = model_items(args.model)
    full = plan(items, args.bucket_mb)
    small = plan([(n, t.dtype, t.shape) for n, t in scaled(items, args.scale)], args.bucket_mb / args.scale)
    print(f"{Path(args.model).name}: {full['tensors']} tensors, {full['gb']:.1f} GB in bf16, largest "
          f"{full['largest_mb']:.0f} MiB; buckets of {args.bucket_mb:g} MiB: {full['buckets']} "
          f"({full['alone']} tensors alone)")
    print(f"calls per sync and engine: before {full['tensors']}, after {full['buckets']} "
          f"({full['tensors'] / full['buckets']:.1f}x fewer); IPC all-gathers per sync: before {full['tensors']} "
          f"(world), after {full['buckets']} (per node)")
    print(f"timed at 1/{args.scale} of the elements ({small['gb'] * 1e3:.0f} MB, buckets of "
          f"{args.bucket_mb / args.scale:g} MiB: {small['buckets']} buckets)")
    res = run(args)
    for route in ("ipc", "broadcast"):
        b, a = res[f"{route}/before"], res[f"{route}/after"]
        print(f"{route:9s} calls {b['calls']:4d} -> {a['calls']:3d} | wall {b['wall_s']:.3f} -> {a['wall_s']:.3f} s "
              f"({b['wall_s'] / a['wall_s']:.1f}x) | sender CPU {b['sender_cpu_s']:.3f} -> {a['sender_cpu_s']:.3f} s "
              f"({b['sender_cpu_s'] / a['sender_cpu_s']:.1f}x) | engines CPU {b['engines_cpu_s']:.3f} -> "
              f"{a['engines_cpu_s']:.3f} s ({b['engines_cpu_s'] / a['engines_cpu_s']:.1f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"plan": full, "scaled_plan": small, **res}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
