"""One process that feeds the same rollout batch through both backends' update (core.update.run_update with the
DeepSpeed trainer's engine and with the Megatron actor's engine) and through a float64 reference written here from
the paper, case by case; it prints one JSON record (tests/openrlhf/test_backend_conformance.py reads it).

Both backends start from the same tiny Qwen3 weights: the DeepSpeed side is OpenRLHF's Actor (float64, SGD, the
CPU strategy of lpo_fixtures.py), the Megatron side megatron-core's GPT (float32, TP1 PP1, Adam with betas 0 and
lr = eps = 1e5 x eta: an SGD step of eta to ~1e-5). The reference steps a float64 HF copy with SGD of eta: per window,
the gradient of the true loss at its current parameters (mean over the window's groups of D(w*, softmax(s)), or the
pointwise -sum w* s, or the PPO-clip token mean of a policy-gradient estimator), whatever the backend's mode; c as
dD/ds by autograd at s_t (shortcut), at the window's s (pre-pass, one pass) or -w* (pointwise); the windows from the
shuffle rule's definition (seed, update index, epoch) and the micro-batches as consecutive cuts.

Usage: python conformance_worker.py OUT_DIR
"""

import copy
import json
import math
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

torch.set_num_threads(1)

from openrlhf_lpo.cpu import megatron_redirect  # noqa: E402

megatron_redirect.apply()

import torch.distributed as dist  # noqa: E402

from gloo_util import free_port  # noqa: E402

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)

from lpo_fixtures import (CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_rollout_samples,  # noqa: E402
                          make_trainer, parse_args, tiny_model)
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from openrlhf_lpo.core.update import UpdateSettings, run_update  # noqa: E402
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig  # noqa: E402
from openrlhf_lpo.megatron.ray_actor import MegatronEngine, loss_spec_from_args, merge_experiences  # noqa: E402
from openrlhf_lpo.openrlhf.actor_trainer import DeepSpeedEngine, LPOActorTrainer, update_batch  # noqa: E402

K, G, ETA = 4, 4, 0.5
EPS = (0.2, 0.28)  # clip-higher: an asymmetric band

# name: (flags, updates: divergence of each update (None: the flags'), prev: s_t scale, budget)
CASES = {
    "one_pass_fwd": (["--lpo.divergence", "fwd"], [None], 0.0, None, 4),
    "split_rev_two_epochs": (["--lpo.divergence", "rev", "--train.max_epochs", "2"], [None], 0.0, None, 2),
    "pointwise": (["--lpo.projection", "pointwise"], [None], 0.0, None, 2),
    "schedule_fwd_then_rev": (["--lpo.divergence", "fwd"], ["fwd", "rev"], 0.0, None, 2),
    "replay_s_t": (["--lpo.divergence", "fwd"], [None], 0.3, None, 2),
    "temperature_scale": (["--lpo.divergence", "rev", "--lpo.temperature_scale", "0.5"], [None], 0.0, None, 4),
    "token_budget": (["--lpo.divergence", "rev", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "24",
                      "--rollout.max_tokens_per_gpu", "64"], [None], 0.0, 24, 1),
    "grpo": (["--actor.loss_agg_mode", "token-mean"], [None], 0.0, None, 2),
}


# ----------------------------------------------------------------------------- the float64 reference


def ref_log_probs(model, exp):
    """Token log-probs of the response tokens of one rollout sample (float64)."""
    seq = exp.sequences.reshape(1, -1)
    logits = model(seq, attention_mask=torch.ones_like(seq)).logits[:, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, seq[:, 1:].unsqueeze(-1)).squeeze(-1)[0]
    mask = exp.action_mask.reshape(-1).bool()
    return lp[-mask.numel():], mask


def ref_s(model, items, idx, prev):
    lo, hi = math.log(1 - EPS[0]), math.log(1 + EPS[1])
    out = []
    for i in idx:
        lp, mask = ref_log_probs(model, items[i])
        old = items[i].action_log_probs.reshape(-1).double()
        r = (lp - old).clamp(lo, hi)[mask]
        out.append(r.mean() + prev[i])
    return torch.stack(out)


def ref_divergence(name, w, log_p):
    p = log_p.exp()
    if name == "fwd":
        return (w * (w.log() - log_p)).sum(-1)
    return (p * (log_p - w.log())).sum(-1)  # rev


def ref_plan(gids, settings, update_index, micro):
    """Windows (LPO: groups in order of first appearance; a policy-gradient estimator: single samples), shuffled per
    epoch by the rule's definition, and consecutive micro-batch cuts."""
    groups = {}
    for i, g in enumerate(gids):
        groups.setdefault(g, []).append(i)
    members = list(groups.values()) if settings.listwise else [[i] for i in range(len(gids))]
    per = settings.batch_size // (settings.dp * (K if settings.listwise else 1))
    plans = []
    for epoch in range(settings.epochs):
        gen = torch.Generator().manual_seed(settings.seed * 1000003 + update_index * 1009 + epoch)
        order = [members[p] for p in torch.randperm(len(members), generator=gen).tolist()]
        for w in range(0, len(order), per):
            flat = [i for g in order[w:w + per] for i in g]
            plans.append({"epoch": epoch, "indices": flat, "micro": [flat[j:j + micro] for j in range(0, len(flat), micro)]})
    return plans


def ref_mode(settings, plan, first):
    if settings.projection == "pointwise":
        return "pointwise"
    if all(len(m) % K == 0 for m in plan["micro"]):
        return "one_pass"
    return "shortcut" if first else "pre_pass"


def ref_update(model, items, batch, settings, plans_of_updates, divergences):
    """Steps the float64 model window by window (SGD of ETA); per window its mode, c and parameter update."""
    out = []
    prev = batch.prev if batch.prev is not None else torch.zeros(len(items), dtype=torch.float64)
    for plans, div in zip(plans_of_updates, divergences):
        for w, plan in enumerate(plans):
            idx = plan["indices"]
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            model.zero_grad()
            if settings.listwise:
                target = batch.target[idx].view(-1, K)
                mode = ref_mode(settings, plan, w == 0)
                s = ref_s(model, items, idx, prev).view(-1, K)
                if settings.projection == "pointwise":
                    loss = -(target * s).sum(-1).mean()
                    c = -target.reshape(-1)
                else:
                    loss = ref_divergence(div, target, torch.log_softmax(s, -1)).mean()
                    at = (prev[idx].view(-1, K) if mode == "shortcut" else s.detach()).clone().requires_grad_(True)
                    d = ref_divergence(div, target, torch.log_softmax(at, -1)).sum()
                    c = torch.autograd.grad(d, at)[0].reshape(-1)
            else:  # PPO clip, token mean over the window (GRPO's advantages)
                mode, c = "pg", None
                num, den = 0.0, 0.0
                for i in idx:
                    lp, mask = ref_log_probs(model, items[i])
                    old = items[i].action_log_probs.reshape(-1).double()
                    adv = items[i].advantages.reshape(-1).double()
                    ratio = (lp - old).exp()
                    surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS[0], 1 + EPS[1]) * adv)
                    num = num - (surr * mask).sum()
                    den += float(mask.sum())
                loss = num / den
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= ETA * p.grad
            delta = {n: (p.detach() - before[n]) for n, p in model.named_parameters()}
            out.append({"mode": mode, "c": None if c is None else c.detach(), "delta": delta})
    return out


# ----------------------------------------------------------------------------- the two backends


class Recording:
    """Wraps an engine's ``step``: the weights after every optimizer step (the test's instrument)."""

    def __init__(self, engine, weights):
        self.engine, self.weights, self.after = engine, weights, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, window):
        out = self.engine.step(window)
        self.after.append(self.weights())
        return out


def one_update(engine, weights, batch, settings, divergence):
    """One update through run_update; its record, status and the parameter update of each optimizer step."""
    before = weights()
    rec_engine = Recording(engine, weights)
    status, record = run_update(batch, settings, rec_engine, divergence=divergence)
    deltas = []
    for w in rec_engine.after:
        deltas.append({k: w[k] - before[k] for k in w})
        before = w
    return record, deltas, status


def rel(a, b):
    keys = [k for k in b if k in a]
    scale = max(float(b[k].abs().max()) for k in keys)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys) / max(scale, 1e-30), scale


def main(out_dir):
    model_dir = tiny_model(os.path.join(out_dir, "tiny"))
    result = {}
    for case, (flags, divergences, s_t_scale, budget, micro) in CASES.items():
        estimator = "group_norm" if case == "grpo" else "lpo"
        args = parse_args(model_dir, K=K, G=G, micro=micro, train_batch=2 * K, estimator=estimator,
                          extra=["--actor.eps_clip_low_high", str(EPS[0]), str(EPS[1]), "--train.seed", "3"] + flags)
        settings = UpdateSettings.from_args(args, dp=1)
        divergences = [d or settings.divergence for d in divergences]
        actor = make_actor(model_dir)  # float64 (weights loaded in bf16 by OpenRLHF's Actor, then cast)
        state = copy.deepcopy(actor.model.state_dict())
        exps = make_experiences(args, CPUStrategy(args), actor, make_rollout_samples(G, K, seed=11),
                                behaviour_noise=s_t_scale)
        if s_t_scale:  # replayed groups: s_t against their own behaviour log-probs (no correction flag)
            from openrlhf_lpo.openrlhf.experience_maker import _attach_targets

            for e in exps:
                e.info["lpo_replayed"] = torch.ones(len(e.index))
            _attach_targets(exps, args)
            assert all(float(e.info["lpo_prev_log_ratio"].abs().max()) > 0 for e in exps)
        # the DeepSpeed trainer (float64 Actor, SGD) and the Megatron actor (float32, Adam as SGD) from one state
        strategy = CPUStrategy(args)
        trainer = make_trainer(LPOActorTrainer, args, strategy, actor, lr=ETA)
        cfg = MegatronActorConfig(tp=1, pp=1, params_dtype="fp32", lr=ETA * 1e5, adam_eps=1e5, adam_betas=(0.0, 0.0),
                                  weight_decay=0.0, clip_grad=1e9, micro_batch_size=micro, seed=3)
        mg = MegatronActor(AutoConfig.from_pretrained(model_dir), cfg,
                           hf_weights={k: v.float() for k, v in state.items()}.__getitem__)
        policy, spec = SimpleNamespace(actor=mg), loss_spec_from_args(args)
        ref = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
        ref.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
        ds_weights = lambda: {n: p.detach().clone() for n, p in actor.model.named_parameters()}  # noqa: E731
        mg_weights = lambda: {k: v.detach().clone() for k, v in mg.export_hf_weights()}  # noqa: E731
        rec = {"windows": [], "n_ref_windows": 0, "n_windows": [0, 0]}
        steps = 0
        for u, div in enumerate(divergences):
            if u:  # a new rollout batch's old log-probs come from the current actor (the shortcut's premise)
                with torch.no_grad():
                    for e in exps:
                        e.action_log_probs = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask)
            trainer.replay_buffer.items.clear()
            for e in exps:
                trainer.replay_buffer.append(copy.deepcopy(e))
            items = trainer.replay_buffer.items
            batch = update_batch(items, estimator == "lpo")  # the one UpdateBatch both backends get
            assert "reward" in batch.info and "response_length" in batch.info
            with cpu_cuda_queries():
                ds_record, ds_deltas, ds_status = one_update(DeepSpeedEngine(trainer, items, batch, 0.0), ds_weights,
                                                             batch, settings, div)
            mg_record, mg_deltas, mg_status = one_update(MegatronEngine(policy, merge_experiences(exps), spec),
                                                         mg_weights, batch, settings, div)
            gids = batch.gids if batch.gids is not None else [i // K for i in range(len(items))]
            plans = ref_plan(gids, settings, steps, micro)
            steps += len(plans)
            ref_steps = ref_update(ref, items, batch, settings, [plans], [div])
            rec["status_keys"] = {"deepspeed": sorted(ds_status), "megatron": sorted(mg_status)}
            rec["n_ref_windows"] += len(plans)
            rec["n_windows"] = [rec["n_windows"][0] + len(ds_record.windows), rec["n_windows"][1] + len(mg_record.windows)]
            for j, (rp, step) in enumerate(zip(plans, ref_steps)):
                dw, mw = ds_record.windows[j], mg_record.windows[j]
                entry = {
                    "update": u, "ref_indices": rp["indices"], "ds_indices": dw.indices, "mg_indices": mw.indices,
                    "ref_micro": [len(m) for m in rp["micro"]] if budget is None else None,
                    "ds_micro": [list(m) for m in dw.micro_batches], "mg_micro": [list(m) for m in mw.micro_batches],
                    "ref_mode": step["mode"], "ds_mode": str(dw.mode or "pg"), "mg_mode": str(mw.mode or "pg"),
                    "micro_tokens": [sum(batch.lengths[i] for i in m) for m in dw.micro_batches],
                }
                if step["c"] is not None:  # c in each plan's own sample order
                    c_ref = dict(zip(rp["indices"], step["c"].tolist()))
                    want = torch.tensor([c_ref[i] for i in dw.indices], dtype=torch.float64)
                    entry["c_ds_vs_ref"] = float((ds_record.coefficients[j] - want).abs().max())
                    entry["c_mg_vs_ref"] = float((mg_record.coefficients[j] - want).abs().max())
                    entry["c_scale"] = float(want.abs().max())
                    if step["mode"] == "pre_pass":  # c at the window's s, not at s_t: the pre-pass matters
                        at_s_t = dict(zip(rp["indices"], _c_at(batch, rp, div).tolist()))
                        entry["c_pre_vs_s_t"] = float((want - torch.tensor([at_s_t[i] for i in dw.indices])).abs().max())
                entry["delta_ds_vs_ref"], entry["delta_scale"] = rel(ds_deltas[j], step["delta"])
                entry["delta_mg_vs_ref"], _ = rel(mg_deltas[j], step["delta"])
                rec["windows"].append(entry)
        result[case] = rec
        mg = policy = None  # (the next case builds its own)
    print("CONFORMANCE " + json.dumps(result))


def _c_at(batch, plan, divergence):
    """c of the window at s_t (what a shortcut would have used): the pre-pass's c must differ from it."""
    idx = plan["indices"]
    prev = batch.prev if batch.prev is not None else torch.zeros(len(batch), dtype=torch.float64)
    at = prev[idx].view(-1, K).clone().requires_grad_(True)
    d = ref_divergence(divergence, batch.target[idx].view(-1, K), torch.log_softmax(at, -1)).sum()
    return torch.autograd.grad(d, at)[0].reshape(-1)


if __name__ == "__main__":
    main(sys.argv[1])
