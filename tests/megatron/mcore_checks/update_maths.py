"""The update's maths on Megatron, each against an independent float64 computation.

* ``update_magnitude``: Adam with lr = eps = 1e5 and no clipping is an SGD step, so the exported update is
  minus the plain-torch gradient element by element (not only its signs), for two losses;
* ``recompute``: ``--actor.gradient_checkpointing_enable`` re-runs every layer, same update;
* ``offpolicy``: the off-policy target s_t (zero gradient for equal rewards at the start, brute force);
* ``kl_entropy``: the KL loss (k1/k2/k3) and the entropy bonus, the loss settings parsed from the flags;
* ``lr_schedule``: the learning rate of every optimizer step and after a resume;
* ``offpolicy_fit``: the behaviour correction's s_t through the policy actor's ``fit``, window by window,
  with the first-window shortcut (forwards counted);
* ``pg_partial_batch``: a partial GRPO batch dealt unequally to two replicas: equal step counts.
"""

import copy
import math
import os
import time
from types import SimpleNamespace as NS

import torch
import torch.distributed as dist

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig
from openrlhf_lpo.megatron.losses import LossSpec

from . import world as W
from .layouts import Layout
from .policy_fit import append, gids_to_rows, lpo_batch, make_policy_actor, tiny_dir
from .references import (CLIP, EPS, G, K, LR, dp_slice, hf_logp, make_batch, make_hf, reference_inputs,
                         reference_step, reference_windows, state_maxdiff)
from .registry import check


@check("update_magnitude")
def update_magnitude():
    """The update carries the gradient's size, not only its signs. Adam's first step is
    lr * g / (|g| + eps): with the default eps it is ~lr * sign(g) for every weight, whatever the loss.
    With lr = eps = 1e3 and no clipping it is g / (1 + |g|/1e3), i.e. an SGD step (lr 1) to ~1e-5
    relative: the exported update must equal minus the plain-torch float64 gradient element by element,
    for two losses whose gradient norms differ (TP2 x DP2)."""
    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs()
    extra = {"old_log_probs": old,
             "target": listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float(),
             "advantages": listwise.pg_advantages(rewards, "grpo").reshape(-1).float()}
    rec = {}
    for spec in (LossSpec(name="listwise", group_size=K), LossSpec(name="pg", group_size=K, clip_eps=0.2)):
        ref = copy.deepcopy(hf).double().train()
        logp = hf_logp(ref, batch)
        if spec.name == "pg":
            mask = batch["action_mask"].double()
            ratio = torch.exp(logp - old.double())
            adv = extra["advantages"].double().unsqueeze(-1)
            surr = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            loss = ((surr * mask).sum(-1) / mask.sum(-1)).mean()
        else:
            s = listwise.sequence_log_ratio(logp, old.double(), batch["action_mask"], 0.2)
            loss = listwise.listwise_loss(s.view(G, K), extra["target"].double().view(G, K), "fwd")
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        actor = MegatronActor(cfg, MegatronActorConfig(tp=2, pp=1, micro_batch_size=2, lr=1e5, adam_eps=1e5,
                                                       clip_grad=1e9), hf_weights=hf_sd.__getitem__)
        m = actor.train_step(dp_slice({**batch, **extra}, actor), spec)
        after = dict(actor.export_hf_weights())
        step = {k: (after[k].double() - hf_sd[k].double()) for k in after}
        scale = max(float(grads[k].abs().max()) for k in step)
        rec[spec.name] = {
            "update_vs_sgd_rel": max(float((step[k] + grads[k]).abs().max()) for k in step) / scale,
            "update_norm": math.sqrt(sum(float((v ** 2).sum()) for v in step.values())),
            "grad_norm_ref": math.sqrt(sum(float((grads[k] ** 2).sum()) for k in step)),
            "grad_norm": m["grad_norm"],
            "max_grad": scale,
        }
        del actor
    return {"update_magnitude": rec}


@check("recompute")
def recompute():
    """--actor.gradient_checkpointing_enable: megatron's full recompute runs each layer's forward
    twice per step and leaves the update unchanged (TP2)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    cfg, hf = make_hf("qwen3", True)
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    batch, rewards = make_batch()
    with torch.no_grad():
        old = hf_logp(hf.double(), batch).float()
        hf.float()
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
    calls = [0]
    orig = TransformerLayer.forward

    def counting(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)

    TransformerLayer.forward = counting
    rec = {}
    try:
        for recompute in (False, True):
            actor = MegatronActor(cfg, MegatronActorConfig(tp=2, micro_batch_size=2, lr=LR, adam_eps=EPS, clip_grad=CLIP,
                                                           recompute=recompute), hf_weights=hf_sd)
            calls[0] = 0
            m = actor.train_step(dp_slice(dict(batch, old_log_probs=old, target=target), actor),
                                 LossSpec(name="listwise", group_size=K))
            rec[f"recompute={recompute}"] = {
                "layer_calls": calls[0], "grad_norm": m["grad_norm"],
                "granularity": actor.tconfig.recompute_granularity,
                "weights": {k: v.tolist() for k, v in list(actor.export_hf_weights())[:3]},
            }
            del actor
    finally:
        TransformerLayer.forward = orig
    a, b = rec["recompute=False"], rec["recompute=True"]
    rec["weights_diff"] = max(float((torch.tensor(a["weights"][k]) - torch.tensor(b["weights"][k])).abs().max())
                              for k in a["weights"])
    for v in (a, b):
        v.pop("weights")
    return {"recompute": rec}


@check("offpolicy")
def offpolicy():
    """Off-policy LPO target s_t (w* = softmax(R/tau + s_t), s against the behaviour log-probs):
    equal rewards and s_t = s at the start give a zero gradient; dropping s_t does not; with
    informative rewards the step equals the float64 brute force (TP2 x DP2)."""
    cfg, hf = make_hf("qwen3", True)
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    batch, rewards = make_batch()
    mask = batch["action_mask"]
    mk = lambda: MegatronActor(cfg, MegatronActorConfig(tp=2, micro_batch_size=2, lr=LR, adam_eps=EPS,  # noqa: E731
                                                        clip_grad=CLIP), hf_weights=hf_sd)
    actor = mk()
    lp0 = actor.log_probs(batch).double()
    torch.manual_seed(3)
    behaviour = (lp0 + 0.1 * torch.randn(lp0.shape, dtype=torch.float64) * mask).float()  # an older policy
    s_t = listwise.sequence_log_ratio(lp0, behaviour.double(), mask, 0.2).view(G, K)
    spec = LossSpec(name="listwise", group_size=K)
    ones = torch.ones(G, K)
    tau = listwise.group_temperature(rewards, "std")
    rec = {"s_t_abs_max": float(s_t.abs().max())}
    w_eq = listwise.gibbs_target(ones, listwise.group_temperature(ones, "std"), prev_log_ratio=s_t).reshape(-1).float()
    m = actor.train_step(dp_slice(dict(batch, old_log_probs=behaviour, target=w_eq), actor), spec)
    rec["equal_rewards_grad_norm"] = m["grad_norm"]
    w_on = listwise.gibbs_target(ones, listwise.group_temperature(ones, "std")).reshape(-1).float()
    m = actor.train_step(dp_slice(dict(batch, old_log_probs=behaviour, target=w_on), actor), spec)
    rec["without_s_t_grad_norm"] = m["grad_norm"]
    del actor
    target = listwise.gibbs_target(rewards, tau, prev_log_ratio=s_t).reshape(-1).float()
    extra = {"old_log_probs": behaviour, "target": target}
    ref_norm, ref_sd, _ = reference_step(hf, batch, extra, spec)
    actor = mk()
    m = actor.train_step(dp_slice(dict(batch, **extra), actor), spec)
    rec["grad_norm"], rec["grad_norm_ref"] = m["grad_norm"], ref_norm
    rec["weights_vs_ref"] = state_maxdiff(dict(actor.export_hf_weights()), ref_sd, True)
    del actor
    return {"offpolicy": rec}


@check("kl_entropy")
def kl_entropy():
    """--algo.kl.use_loss (k1/k2/k3 against reference log-probs) and --actor.entropy_coef on Megatron, the
    actor's loss settings parsed from the flags (``--algo.kl.estimator``, ``--algo.kl.init_coef``,
    ``--actor.entropy_coef``) as the Ray actor builds them:
    token means over the optimizer window, as the DeepSpeed trainer normalises them; grad norm and
    updated weights vs the float64 reference in TP1 (DP4), TP2 (DP2), PP2 (DP2), listwise and PG (the loss
    path's terms are shared by the surrogate). The reference without the terms differs (they matter)."""
    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs()
    g = torch.Generator().manual_seed(11)
    base = (ref_lp + 0.3 * torch.randn(ref_lp.shape, generator=g, dtype=torch.float64)).float() * batch["action_mask"]
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
    adv = listwise.pg_advantages(rewards, "grpo").reshape(-1).float()
    extra = {"old_log_probs": old, "target": target, "advantages": adv, "base_log_probs": base}
    rec = {}
    cases = [  # layout (its loss: listwise or pg; micro-batch 2), KL estimator, KL coef, entropy coef
        (Layout(tp=1, pp=1, spec="listwise"), "k3", 0.5, 0.05),
        (Layout(tp=2, pp=1, spec="listwise"), "k1", 0.5, 0.05),
        (Layout(tp=1, pp=2, spec="pg"), "k2", 0.3, 0.02),
    ]
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.megatron.ray_actor import loss_spec_from_args

    model_dir = os.path.join(W.OUT, f"kl_flags_config_rank{W.RANK}")
    cfg.save_pretrained(model_dir)  # what the flags' layout check reads
    for lay, est, kl, ent in cases:
        tp, pp, name, mbs = lay.tp, lay.pp, lay.spec, lay.micro_batch_size
        # the reference names the estimator itself; the actor's loss settings come from the flags
        # (lpo-train's parser and the Ray actor's loss_spec_from_args), so a flag that does not reach the
        # Megatron loss (an estimator dropped or replaced on the way) shows as a gradient mismatch
        ref_spec = LossSpec(name=name, group_size=K, clip_eps=0.2, kl_coef=kl, kl_estimator=est, entropy_coef=ent)
        spec = loss_spec_from_args(build_parser_and_parse([
            "--actor.model_name_or_path", model_dir, "--reward.remote_url", "http://127.0.0.1:1/reward",
            "--backend", "megatron", "--megatron.tp", str(tp), "--megatron.pp", str(pp),
            "--actor.num_gpus_per_node", str(W.WORLD), "--rollout.n_samples_per_prompt", str(K),
            "--rollout.batch_size", str(G), "--train.batch_size", str(G * K), "--train.micro_batch_size", str(mbs),
            "--algo.advantage.estimator", "lpo" if name == "listwise" else "group_norm", "--actor.eps_clip", "0.2",
            "--actor.loss_agg_mode", "seq-mean-token-mean",  # the reference's PG aggregation (stock: token-mean)
            "--algo.kl.use_loss", "--algo.kl.init_coef", str(kl), "--algo.kl.estimator", est,
            "--actor.entropy_coef", str(ent), "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0"]),
            kl_ctl=kl)
        assert spec.name == name, (spec.name, name)
        ref_norms, ref_sd = reference_windows(hf, batch, extra, ref_spec, [list(range(G * K))])
        plain_norm = reference_windows(hf, batch, extra, LossSpec(name=name, group_size=K, clip_eps=0.2),
                                       [list(range(G * K))])[0][0]
        actor = MegatronActor(cfg, lay.actor_config(), hf_weights=hf_sd)  # lr 1e-3, eps 1e-4, clip 0.5
        m = actor.train_step(dp_slice({**batch, **extra}, actor), spec)
        rec[f"tp{tp}pp{pp}/{name}/{est}"] = {
            "flags": {"kl_estimator": spec.kl_estimator, "kl_coef": spec.kl_coef, "entropy_coef": spec.entropy_coef},
            "grad_norm": m["grad_norm"], "grad_norm_ref": ref_norms[0], "grad_norm_without_terms": plain_norm,
            "weights_vs_ref": state_maxdiff(dict(actor.export_hf_weights()), ref_sd, True), "kl": W.step_metrics(actor, m)["kl"]}
        del actor
    return {"kl_entropy": rec}


@check("lr_schedule")
def lr_schedule():
    """--actor.lr_scheduler cosine_with_min_lr --actor.lr_warmup_ratio 0.03 (OpenRLHF's defaults) over
    40 steps: the learning rate of every optimizer step (what the Megatron optimizer's groups hold when
    it steps), the weights unchanged by step 0 (warmup starts at 0), and a resume after step 3 in a
    fresh actor continuing the sequence (TP2 x DP2)."""
    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs()
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
    data = dict(batch, old_log_probs=old, target=target)
    spec = LossSpec(name="listwise", group_size=K)
    mk = lambda: MegatronActor(cfg, MegatronActorConfig(  # noqa: E731
        tp=2, micro_batch_size=2, lr=LR, adam_eps=EPS, clip_grad=CLIP, lr_scheduler="cosine_with_min_lr",
        lr_warmup_ratio=0.03, min_lr_ratio=0.1, scheduler_steps=40), hf_weights=hf_sd)
    actor = mk()
    seen = []
    orig_step = type(actor.optimizer).step

    def recording_step(opt, *a, **k):
        seen.append(sorted({round(g["lr"], 15) for g in opt.param_groups}))
        return orig_step(opt, *a, **k)

    type(actor.optimizer).step = recording_step
    rec = {}
    try:
        lrs = []
        for i in range(6):
            m = actor.train_step(dp_slice(data, actor), spec)
            lrs.append(m["applied_lr"])
            if i == 0:
                rec["step0_moved"] = max(float((v - hf_sd[k]).abs().max()) for k, v in actor.export_hf_weights())
            if i == 2:
                actor.save_checkpoint(os.path.join(W.OUT, "lr_ckpt"))
        rec["lrs"] = lrs
        rec["optimizer_group_lrs"] = seen[:]
        rec["actor_lr_after"] = actor.lr_schedule.lr
        fresh = mk()
        fresh.load_checkpoint(os.path.join(W.OUT, "lr_ckpt"))
        rec["resumed_lrs"] = [fresh.train_step(dp_slice(data, fresh), spec)["applied_lr"] for _ in range(3)]
        del fresh
    finally:
        type(actor.optimizer).step = orig_step
    del actor
    return {"lr_schedule": rec}


@check("offpolicy_fit")
def offpolicy_fit():
    """The listwise off-policy target through the Ray policy actor's fit (TP2 x DP2, micro-batch 1 < K,
    2 windows x 2 epochs): --algo.advantage.is_correction_level token in clip and mask modes, s_t = delta
    from the behaviour log-probs (rollout_log_probs) as the DeepSpeed trainer maps it; every step's grad
    norm and the final weights equal the window-by-window float64 reference. The first window takes c
    from s_t (no pre-pass): forwards are counted (shortcut, then pre-pass, pre-pass, pre-pass)."""
    import numpy as np

    from openrlhf_lpo.core.offpolicy import BehaviourCorrection, behaviour_log_ratio

    model_dir, hf = tiny_dir()
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    n_groups = 4
    batch, rewards = lpo_batch(n_groups, seed=21)
    mask = batch["action_mask"]
    rec = {}
    for mode in ("clip", "mask"):
        pa = make_policy_actor(model_dir, algo__advantage__is_correction_level="token",
                           algo__advantage__is_correction_mode=mode, algo__advantage__is_correction_threshold=(0.8, 1.25),
                           train__batch_size=4, train__max_epochs=2, ckpt__path=os.path.join(W.OUT, f"off_{mode}"))
        dp, r = pa.actor.ps.get_data_parallel_world_size(), pa.actor.ps.get_data_parallel_rank()
        with torch.no_grad():
            old_full = pa.actor.log_probs(batch).cpu().float()
        g = torch.Generator().manual_seed(5)
        behaviour = (old_full + 0.2 * torch.randn(old_full.shape, generator=g)) * mask  # an older policy
        corr = BehaviourCorrection(mode, 0.8, 1.25)
        delta = behaviour_log_ratio(old_full, behaviour, mask, corr)
        tau = listwise.group_temperature(rewards, "std")
        target = listwise.gibbs_target(rewards.double(), tau.double(), prev_log_ratio=delta.view(-1, K)).reshape(-1)
        gid = torch.arange(n_groups).repeat_interleave(K)
        info = {"lpo_target": target, "lpo_gid": gid, "lpo_prev_log_ratio": delta}
        mine = gids_to_rows(range(r * n_groups // dp, (r + 1) * n_groups // dp))
        append(pa, batch, mine, info, behaviour=behaviour)
        before = pa.actor.forwards
        st = pa.fit()
        forwards = pa.actor.forwards - before
        plan = pa.last_update.windows
        # the global groups of each step: this replica's window + the other replica's
        mine_g = [sorted({int(gid[torch.as_tensor(mine)[i]]) for i in p.indices}) for p in plan]
        allg = [None] * dist.get_world_size()
        dist.all_gather_object(allg, mine_g)
        windows = [sorted(set().union(*(a[w] for a in allg))) for w in range(len(plan))]
        # the independent reference: its own delta, keep mask and target (numpy float64)
        ell = old_full.double().numpy() - behaviour.double().numpy()
        m_np = mask.numpy()
        lo_b, hi_b = math.log(0.8), math.log(1.25)
        if mode == "clip":
            keep = m_np.astype(bool)
            d_ref = (np.clip(ell, lo_b, hi_b) * keep).sum(1) / np.maximum(keep.sum(1), 1)
        else:
            keep = m_np.astype(bool) & (ell >= lo_b) & (ell <= hi_b)
            d_ref = (ell * keep).sum(1) / np.maximum(keep.sum(1), 1)
        rw = rewards.double().numpy()
        w_ref = []
        for gi in range(n_groups):
            rr = rw[gi]
            logits = (rr - rr.mean()) / rr.std(ddof=1) + d_ref[gi * K:(gi + 1) * K] if rr.max() > rr.min() \
                else d_ref[gi * K:(gi + 1) * K]
            e = np.exp(logits - logits.max())
            w_ref.append(e / e.sum())
        extra = {"old_log_probs": old_full, "target": torch.tensor(np.concatenate(w_ref)),
                 "delta": torch.tensor(d_ref), "keep": torch.tensor(keep)}
        spec = LossSpec(name="listwise", group_size=K, clip_eps=0.2)
        ref_norms, ref_sd = reference_windows(hf, batch, extra, spec, [gids_to_rows(w) for w in windows])
        final = dict(pa.actor.export_hf_weights())
        rec[mode] = {"modes": [str(p.mode) for p in plan], "grad_norms": pa.last_update.grad_norms,
                     "grad_norms_ref": ref_norms, "weights_vs_ref": state_maxdiff(final, ref_sd, hf.config.tie_word_embeddings),
                     "weights_moved": max(float((final[k] - hf_sd[k]).abs().max()) for k in final),
                     "forwards": forwards, "micro": [[len(mb) for mb in p.micro_batches] for p in plan],
                     "delta_abs_max": float(delta.abs().max()),
                     "delta_vs_ref": float((delta - torch.tensor(d_ref)).abs().max()),
                     "shortcut_windows": st["lpo/shortcut_windows"], "pre_pass_windows": st["lpo/pre_pass_windows"]}
        del pa
    return {"offpolicy_fit": rec}


@check("pg_partial_batch")
def pg_partial_batch():
    """Cluster review F1 (520 vs 512 samples at a window of 512), scaled down: GRPO on a partial batch dealt
    66 vs 64 samples to two replicas (--train.batch_size 128: window 64 per replica). Before, replica 0 ran 2 optimizer steps and
    replica 1 one, and replica 0's second step waited in the DP all-reduce until the timeout. Now both
    run the same number of steps (TP2 x DP2); every rank finishes."""
    model_dir, hf = tiny_dir()
    t = time.time()
    pa = make_policy_actor(model_dir, algo__advantage__estimator="group_norm", train__batch_size=128,
                       train__micro_batch_size=8, ckpt__path=os.path.join(W.OUT, "pg_partial"))
    r = pa.actor.ps.get_data_parallel_rank()
    n = 66 if r == 0 else 64
    g = torch.Generator().manual_seed(r)
    seq = torch.randint(3, 64, (n, 6), generator=g)
    am = torch.ones_like(seq)
    act = torch.ones(n, 3, dtype=torch.bool)
    adv = torch.randn(n, generator=g)
    exp = NS(sequences=seq, attention_mask=am, action_mask=act, advantages=adv.unsqueeze(1) * act, info={})
    exp.action_log_probs = pa.forward(seq, act, am)
    pa.append(exp)
    st = pa.fit()
    rec = {
        "samples": n, "optimizer_steps": st["optimizer_steps"], "windows": [len(p.indices) for p in pa.last_update.windows],
        "grad_norms": pa.last_update.grad_norms, "seconds": time.time() - t}
    del pa
    return {"pg_partial_batch": rec}

