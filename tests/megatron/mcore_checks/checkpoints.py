"""Checkpoints and the HF weight stream of a layout run (Qwen3, tied embeddings).

Two of the parity layouts (``layouts.py``) go on after their training step: TP2 x PP2 and PP2 with the
distributed optimizer save a checkpoint (its traffic counted on each rank: the full tensors a rank holds
are exactly those it writes), train step 2, and a fresh actor that loads the checkpoint repeats step 2;
TP2 x PP2 also streams its HF weights to every rank and to rank 0 alone, counting the collectives.
"""

import json
import math
import os

import torch
import torch.distributed as dist

from openrlhf_lpo.megatron.actor import MegatronActor

from . import world as W
from .layouts import Layout, ParityRun, run_layouts
from .references import dp_slice
from .registry import check

CHECKPOINTED = (
    Layout(tp=2, pp=2, micro_batch_size=4),  # save traffic, resume, and the HF weight stream
    Layout(tp=1, pp=2, distributed_optimizer=True),  # resume with the distributed optimizer's state
)
STREAMED = CHECKPOINTED[:1]


@check("checkpoint_export")
def checkpoint_export():
    run = ParityRun.of("qwen3", tied=True)
    full = {**run.batch, **run.extra}

    def stream_save_resume(actor, lay, spec):
        rec = {}
        if lay in STREAMED:
            rec["export_accounting"] = counted_export(actor)
        rec.update(resume(actor, run, lay, full, spec))
        return rec

    return run_layouts(run, CHECKPOINTED, after_step=stream_save_resume)


def resume(actor, run: ParityRun, lay: Layout, full, spec):
    """save after step 1 -> step 2; fresh actor + load -> step 2; compare weights and metrics."""
    ckpt = os.path.join(W.OUT, f"ckpt_tp{lay.tp}pp{lay.pp}")
    accounting = counted_save(actor, ckpt, client_state={"iteration": 1})
    local = dp_slice(full, actor)
    m2 = actor.train_step(local, spec)
    w2 = dict(actor.export_hf_weights())
    fresh = MegatronActor(run.cfg, lay.actor_config(), hf_weights=run.hf_sd.__getitem__)
    client = fresh.load_checkpoint(ckpt)
    m2b = fresh.train_step(local, spec)
    w2b = dict(fresh.export_hf_weights())
    return {
        "save_accounting": accounting,
        "resume_client_state": client.get("iteration"),
        "resume_grad_norm_diff": abs(m2["grad_norm"] - m2b["grad_norm"]),
        "resume_weights_diff": max(float((w2[k] - w2b[k]).abs().max()) for k in w2),
        "step2_moved": max(float((w2[k] - run.hf_sd[k]).abs().max()) for k in w2),
    }


def counted_save(actor, root, client_state):
    """One checkpoint save with its traffic counted on this rank: the full fp32 tensors it held (and their
    bytes), the all-gathers and gathers it made; beside them the tensors and bytes of the files this rank wrote
    (read back from its stage/TP weight map)."""
    from safetensors import safe_open

    from openrlhf_lpo.megatron import checkpoint as mckpt

    counts = {"full": 0, "full_bytes": 0, "all_gather": 0, "gather": 0}
    saved = mckpt._gather_full, dist.all_gather, dist.gather

    def full(*a, **k):
        out = saved[0](*a, **k)
        if out is not None:
            counts["full"] += 1
            counts["full_bytes"] += out.numel() * out.element_size()
        return out

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapped

    mckpt._gather_full, dist.all_gather, dist.gather = full, counting("all_gather", saved[1]), counting("gather", saved[2])
    try:
        actor.save_checkpoint(root, client_state=client_state)
    finally:
        mckpt._gather_full, dist.all_gather, dist.gather = saved
    ps = actor.ps
    tag_dir = os.path.join(root, mckpt.latest_tag(root))
    prefix = f"stage{ps.get_pipeline_model_parallel_rank():02d}-tp{ps.get_tensor_model_parallel_rank():02d}"
    weight_map = json.load(open(os.path.join(tag_dir, f"{prefix}.json")))["weight_map"]
    written = 0
    for fname in sorted(set(weight_map.values())):
        with safe_open(os.path.join(tag_dir, fname), "pt") as f:
            written += sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys() if k in weight_map)
    total = sum(len(json.load(open(os.path.join(tag_dir, name)))["weight_map"])
                for name in os.listdir(tag_dir) if name.startswith("stage") and name.endswith(".json"))
    return dict(counts, written_tensors=len(weight_map), written_bytes=written, checkpoint_tensors=total)


def counted_export(actor):
    """The HF weight stream to every rank (``dst=None``) and to rank 0 only (``dst=0``, the weight sync and the HF
    export), counted on this rank: collectives by kind, tensors received and their bytes; on rank 0, whether
    both streams give the same tensors bit for bit."""
    kinds = ("broadcast", "all_gather", "gather", "send", "recv")
    out, streams = {}, {}
    for mode in (None, 0):
        counts = dict.fromkeys(kinds, 0)
        saved = {k: getattr(dist, k) for k in kinds}

        def counting(kind):
            def wrapped(*a, **k):
                counts[kind] += 1
                return saved[kind](*a, **k)
            return wrapped

        for kind in kinds:
            setattr(dist, kind, counting(kind))
        try:
            got = dict(actor.export_hf_weights(dst=mode))
        finally:
            for kind in kinds:
                setattr(dist, kind, saved[kind])
        streams[mode] = got
        out["all_ranks" if mode is None else "rank0"] = dict(
            counts, tensors=len(got), bytes=sum(t.numel() * t.element_size() for t in got.values()))
    if W.RANK == 0:
        out["same_tensors"] = list(streams[0]) == list(streams[None]) and all(
            torch.equal(streams[0][k], streams[None][k]) for k in streams[None])
    return out

