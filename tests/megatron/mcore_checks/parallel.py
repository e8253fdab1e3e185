"""Sequence parallelism and virtual pipeline stages, after the other checks in the same world.

Against the same independent references (``references.py``): HF float64 log-probs per unpadded sequence,
plain-torch float64 autograd, and SP off / VPP 1. Gradients are compared through an SGD-like step: Adam
with lr = eps = 1e5 and no clipping moves each weight by ``-g / (1 + |g|/1e5)``, so the exported update is
minus the gradient to ~1e-5 relative (see ``update_maths.update_magnitude``).
"""

import copy
import json
import os
import time

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron import convert, memory
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig
from openrlhf_lpo.megatron.losses import LossSpec

from . import world as W
from .references import CLIP, EPS, G, K, LR, dp_slice, hf_logp, masked_maxdiff, reference_inputs
from .registry import check

SGD = dict(lr=1e5, adam_eps=1e5, clip_grad=1e9)  # Adam's first step = an SGD step of lr 1 (see above)


def inputs():
    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs()
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
    full = dict(batch, old_log_probs=old, target=target)
    return cfg, hf, hf_sd, batch, ref_lp, full


def reference_grads(hf, batch, full):
    """d(listwise fwd loss)/d(HF weights) in float64 on the whole batch."""
    ref = copy.deepcopy(hf).double().train()
    logp = hf_logp(ref, batch)
    s = listwise.sequence_log_ratio(logp, full["old_log_probs"].double(), batch["action_mask"], 0.2)
    loss = listwise.listwise_loss(s.view(G, K), full["target"].double().view(G, K), "fwd")
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def grad_of_step(actor, hf_sd, full, spec):
    """One SGD-like step; returns (minus the update = the gradient, metrics)."""
    m = actor.train_step(dp_slice(full, actor), spec)
    after = dict(actor.export_hf_weights())
    return {k: hf_sd[k].double() - after[k].double() for k in after}, m


def rel_diff(a, b):
    scale = max(float(b[k].abs().max()) for k in a)
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def layer_input_rows(actor, batch):
    """Rows of the hidden state entering the first decoder layer of this rank, and the packed row length."""
    rows = []
    layer = convert.unwrap(convert.chunks_of(actor.model)[0]).decoder.layers[0]
    h = layer.register_forward_pre_hook(lambda mod, args, kw: rows.append(int(kw.get("hidden_states", args[0] if args else None).shape[0])), with_kwargs=True)
    try:
        actor.log_probs(batch)
    finally:
        h.remove()
    mbs = min(actor.cfg.micro_batch_size, batch["sequences"].shape[0])
    packed = actor._micro_batches({k: v for k, v in batch.items() if k in ("sequences", "attention_mask", "action_mask")},
                                  actor.fixed_micro_batches(batch["sequences"].shape[0], mbs))
    return rows, [p["packed"].num_tokens for p in packed], [sum(p["packed"].seq_lens) for p in packed]


@check("sp_vpp_layouts")
def sp_vpp_layouts():
    """Log-probs vs HF float64, gradients vs HF float64 autograd, export bit-exact, per layout."""
    cfg, hf, hf_sd, batch, ref_lp, full = inputs()
    grads = reference_grads(hf, batch, full)
    spec = LossSpec(name="listwise", group_size=K)
    mask = batch["action_mask"].double()
    layouts = {  # name -> actor config
        "tp2": dict(tp=2, micro_batch_size=2),
        "tp2_sp": dict(tp=2, micro_batch_size=2, sequence_parallel=True),
        "tp2pp2_sp_recompute": dict(tp=2, pp=2, micro_batch_size=2, sequence_parallel=True, recompute=True),
        "pp2_vpp2": dict(pp=2, vpp=2, micro_batch_size=4),  # 1 micro-batch per replica: padded to 2
        "tp2pp2_vpp2_sp": dict(tp=2, pp=2, vpp=2, micro_batch_size=2, sequence_parallel=True),
    }
    out = {}
    only = os.environ.get("MCORE_PARALLEL_LAYOUTS")
    for name, kw in layouts.items():
        if only and name not in only.split(","):
            continue
        t = time.time()
        W.log(f"layout {name}")
        actor = MegatronActor(cfg, MegatronActorConfig(**kw, **SGD), hf_weights=hf_sd.__getitem__)
        rec = {"logp": (actor.log_probs(batch) * batch["action_mask"]).tolist()}
        rec["logp_vs_hf"] = masked_maxdiff(torch.tensor(rec["logp"]), ref_lp, mask)
        exported = dict(actor.export_hf_weights())
        rec["export_bitexact"] = set(exported) == set(hf_sd) - {"lm_head.weight"} and all(
            torch.equal(exported[k], hf_sd[k]) for k in exported)
        ps = actor.ps
        chunks = convert.chunks_of(actor.model)
        rec["names_match"] = all(
            set(convert.local_tensors(c)) == set(convert.expected_local_names(
                cfg, actor.cfg.tp, actor.cfg.pp, ps.get_pipeline_model_parallel_rank(), vpp=actor.cfg.vpp, vp_stage=v))
            for v, c in enumerate(chunks))
        rec["chunks"] = len(chunks)
        rec["local_numel"] = sum(p.numel() for c in chunks for p in convert.unwrap(c).parameters())
        rec["memory_rank_parameters"] = memory.rank_parameters(
            memory.Shape.of(cfg), actor.cfg.tp, actor.cfg.pp, ps.get_pipeline_model_parallel_rank())
        rec["chunk_offsets"] = [convert.chunk_offset(c) for c in chunks]
        if actor.cfg.vpp > 1:  # a forward-only pass of 3 micro-batches (padded to 4 for the schedule)
            three = {k: v[:3] for k, v in batch.items()}
            old_mbs, actor.cfg.micro_batch_size = actor.cfg.micro_batch_size, 1
            rec["three_vs_hf"] = masked_maxdiff(actor.log_probs(three), ref_lp[:3], mask[:3])
            rec["three_micro_batches"] = len(actor._micro_batches(three, actor.fixed_micro_batches(3, 1)))
            actor.cfg.micro_batch_size = old_mbs
            train = dp_slice(full, actor)
            rec["train_micro_batches"] = len(actor._micro_batches(train, actor.fixed_micro_batches(train["sequences"].shape[0], old_mbs)))
        if actor.cfg.sequence_parallel:
            rec["layer_rows"], rec["packed_tokens"], rec["real_tokens"] = layer_input_rows(actor, batch)
        W.log("  log-probs, export done")
        g, m = grad_of_step(actor, hf_sd, full, spec)
        rec["grad_vs_hf_rel"] = rel_diff(g, grads)
        rec["grad_norm"] = m["grad_norm"]
        out[name] = rec
        out[name]["grad"] = g
        rec["seconds"] = time.time() - t
        del actor
    if only:
        for rec in out.values():
            rec.pop("grad")
        return {"sp_vpp_layouts": out}
    # SP on == SP off (gradients element-wise, log-probs)
    out["tp2_sp"]["grad_vs_sp_off_rel"] = rel_diff(out["tp2_sp"]["grad"], out["tp2"]["grad"])
    lp_on, lp_off = torch.tensor(out["tp2_sp"]["logp"]), torch.tensor(out["tp2"]["logp"])
    out["tp2_sp"]["logp_vs_sp_off"] = float((lp_on - lp_off).abs().max())
    # negative control: SP without the TP sum of the norms' gradients (each rank saw T/tp tokens)
    import importlib

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the module, not the function
    orig = fmg._allreduce_non_tensor_model_parallel_grads
    fmg._allreduce_non_tensor_model_parallel_grads = lambda *a, **k: None
    try:
        actor = MegatronActor(cfg, MegatronActorConfig(**layouts["tp2_sp"], **SGD), hf_weights=hf_sd.__getitem__)
        g, _ = grad_of_step(actor, hf_sd, full, spec)
        out["tp2_sp"]["no_norm_reduce_grad_vs_hf_rel"] = rel_diff(g, grads)
        del actor
    finally:
        fmg._allreduce_non_tensor_model_parallel_grads = orig
    for rec in out.values():
        rec.pop("grad")
    return {"sp_vpp_layouts": out}


@check("vpp_checkpoints")
def vpp_checkpoints():
    """Save at PP2 x VPP2 after step 1; load into PP2 x VPP1 and TP2 x PP1: weights bit-exact and
    step 2 equal to the uninterrupted VPP2 run (Adam moments restored); VPP1 -> VPP2 bit-exact."""
    cfg, hf, hf_sd, batch, ref_lp, full = inputs()
    spec = LossSpec(name="listwise", group_size=K)

    def mk(**kw):
        return MegatronActor(cfg, MegatronActorConfig(micro_batch_size=2, lr=LR, adam_eps=EPS, clip_grad=CLIP,
                                                      **kw), hf_weights=hf_sd)

    def wdiff(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    root = os.path.join(W.OUT, "ckpt_vpp2")
    a = mk(pp=2, vpp=2)
    a.train_step(dp_slice(full, a), spec)
    w1 = dict(a.export_hf_weights())
    a.save_checkpoint(root, client_state={"episode": 3})
    m2 = a.train_step(dp_slice(full, a), spec)
    w2 = dict(a.export_hf_weights())
    del a
    rec = {"step2_moved": wdiff(w2, w1)}
    with open(os.path.join(root, "global_step1", "meta.json")) as f:
        rec["meta_layout"] = json.load(f)["layout"]
    for name, kw in (("vpp2_to_vpp1", dict(pp=2)), ("vpp2_to_tp2", dict(tp=2))):
        b = mk(**kw)
        client = b.load_checkpoint(root)
        loaded = dict(b.export_hf_weights())
        n2 = b.train_step(dp_slice(full, b), spec)
        rec[name] = {"client_ok": client.get("episode") == 3, "loaded_vs_saved": wdiff(loaded, w1),
                     "step2_vs_continued": wdiff(dict(b.export_hf_weights()), w2),
                     "grad_norm": [m2["grad_norm"], n2["grad_norm"]]}
        if name == "vpp2_to_vpp1":
            b.save_checkpoint(os.path.join(W.OUT, "ckpt_vpp1"))
            w_saved = dict(b.export_hf_weights())
        del b
    c = mk(pp=2, vpp=2)
    c.load_checkpoint(os.path.join(W.OUT, "ckpt_vpp1"))
    rec["vpp1_to_vpp2_vs_saved"] = wdiff(dict(c.export_hf_weights()), w_saved)
    del c
    return {"vpp_checkpoints": rec}

