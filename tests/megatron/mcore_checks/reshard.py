"""Checkpoints resumed in another layout, and TP groups kept inside a node.

TP2 -> TP1 and PP2 (distributed optimizer) -> TP2 continue the uninterrupted run (the Adam moments
restored: without them step 2 differs), TP1 -> PP2 puts the tied output layer back, ``--ckpt.max_num``
prunes, a crash mid-save keeps 'latest'; the placement check's collective over the world names the TP
group that spans nodes.
"""

import os

import torch
import torch.distributed as dist

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron.actor import MegatronActor
from openrlhf_lpo.megatron.losses import LossSpec

from . import world as W
from .layouts import Layout
from .references import K, dp_slice, reference_inputs
from .registry import check


@check("reshard")
def reshard():
    """Checkpoints resume in another layout: TP2 -> TP1, PP2 (distributed optimizer) -> TP2,
    TP1 -> PP2 (tied output layer); --ckpt.max_num pruning; a crash mid-save keeps 'latest'."""
    from openrlhf_lpo.megatron import checkpoint

    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs()
    full = dict(batch, old_log_probs=old,
                target=listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float())
    spec = LossSpec(name="listwise", group_size=K)

    def mk(lay, weights=None):  # micro-batch 2, lr 1e-3, eps 1e-4, clip 0.5
        return MegatronActor(cfg, lay.actor_config(), hf_weights=weights or hf_sd)

    def wdiff(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    rec = {}
    moves = (("tp2_to_tp1", Layout(tp=2, pp=1), Layout(tp=1, pp=1)),
             ("pp2_to_tp2", Layout(tp=1, pp=2, distributed_optimizer=True), Layout(tp=2, pp=1)))
    for name, src, dst in moves:
        root = os.path.join(W.OUT, f"reshard_{name}")
        a = mk(src)
        a.train_step(dp_slice(full, a), spec)
        w1 = dict(a.export_hf_weights())
        a.save_checkpoint(root, client_state={"episode": 7, "rng": torch.arange(3)})
        m2 = a.train_step(dp_slice(full, a), spec)
        w2 = dict(a.export_hf_weights())
        del a
        b = mk(dst)
        client = b.load_checkpoint(root)
        loaded = dict(b.export_hf_weights())
        n2 = b.train_step(dp_slice(full, b), spec)
        got = dict(b.export_hf_weights())
        r = {"client_ok": client["episode"] == 7 and client["rng"].tolist() == [0, 1, 2], "step": b.step,
             "loaded_vs_saved": wdiff(loaded, w1), "step2_vs_continued": wdiff(got, w2),
             "grad_norm": [m2["grad_norm"], n2["grad_norm"]], "step2_moved": wdiff(w2, w1)}
        if name == "tp2_to_tp1":
            # negative control: the same weights without the Adam moments give another step 2
            c = mk(dst, weights={k: v.clone() for k, v in w1.items()})
            c.train_step(dp_slice(full, c), spec)
            r["no_moments_vs_continued"] = wdiff(dict(c.export_hf_weights()), w2)
            del c
            # max_num=1: saving step 2 prunes step 1; then TP1 -> PP2 puts the tied output layer back
            b.save_checkpoint(root, max_num=1)
            r["dirs_after_prune"] = [n for _, n in checkpoint.step_dirs(root)]
            r["latest"] = checkpoint.latest_tag(root)
            # a crash in the middle of saving step 3 leaves step 2 and 'latest' untouched
            orig = checkpoint._gather_full
            calls = [0]

            def failing(*args, **kw):
                calls[0] += 1
                if calls[0] > 3:
                    raise RuntimeError("simulated crash")
                return orig(*args, **kw)

            checkpoint._gather_full = failing
            try:
                b.train_step(dp_slice(full, b), spec)
                b.save_checkpoint(root)
                r["crash_raised"] = False
            except RuntimeError:
                r["crash_raised"] = True
            finally:
                checkpoint._gather_full = orig
            dist.barrier()
            r["latest_after_crash"] = checkpoint.latest_tag(root)
            r["dirs_after_crash"] = sorted(os.listdir(root))
            del b
            p = mk(Layout(tp=1, pp=2))
            p.load_checkpoint(root)
            r["tp1_to_pp2_vs_saved"] = wdiff(dict(p.export_hf_weights()), got)
            del p
        else:
            del b
        rec[name] = r
    return {"reshard": rec}


@check("nodes")
def nodes():
    """TP groups must stay inside a node: the collective check over the 4-rank world."""
    from openrlhf_lpo.megatron.cluster import PlacementError, check_tp_groups_within_nodes

    rec = {}
    try:
        for name, nodes_, tp in (("AABB_tp2", "AABB", 2), ("AABB_tp4", "AABB", 4), ("ABAB_tp2", "ABAB", 2)):
            os.environ["LPO_NODE_ID"] = nodes_[W.RANK]
            try:
                check_tp_groups_within_nodes(tp)
                rec[name] = "ok"
            except PlacementError as e:
                rec[name] = str(e)
    finally:
        os.environ.pop("LPO_NODE_ID", None)
    return {"nodes": rec}

