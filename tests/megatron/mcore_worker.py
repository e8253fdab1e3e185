"""One rank of a gloo world that runs every Megatron layout check; launched by the tests.

Usage: python mcore_worker.py RANK WORLD PORT OUT_DIR
Each rank writes OUT_DIR/rank{RANK}.json with measured numbers; the pytest side asserts.
The references are independent of megatron: the HF model in float64 (per-sequence, unpadded)
for log-probs, and plain torch autograd + clip_grad_norm_ + AdamW for the training step.
"""

import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
RANK, WORLD, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=str(RANK), WORLD_SIZE=str(WORLD))

from openrlhf_lpo import cpu_megatron  # noqa: E402

cpu_megatron.apply()
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", rank=RANK, world_size=WORLD)

from openrlhf_lpo import listwise  # noqa: E402
from openrlhf_lpo.megatron import convert  # noqa: E402
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig  # noqa: E402
from openrlhf_lpo.megatron.losses import LossSpec  # noqa: E402
from openrlhf_lpo.tiny import tiny_config  # noqa: E402

K, G, P, A = 2, 4, 6, 6
LR, EPS, CLIP = 1e-3, 1e-4, 0.5
results = {"rank": RANK, "checks": {}}
T0 = time.time()


def make_hf(arch, tied):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(
        arch, vocab_size=128, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, tie_word_embeddings=tied,
    )
    torch.manual_seed(1234)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # non-trivial norms / biases so every tensor matters
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    return cfg, hf


def make_batch():
    g = torch.Generator().manual_seed(7)
    B = G * K
    seq = torch.zeros(B, P + A, dtype=torch.long)
    am = torch.zeros(B, P + A, dtype=torch.long)
    act = torch.zeros(B, A, dtype=torch.bool)
    for gi in range(G):
        plen = int(torch.randint(2, P + 1, (1,), generator=g))
        prompt = torch.randint(3, 128, (plen,), generator=g)
        for k in range(K):
            b = gi * K + k
            rlen = int(torch.randint(1, A + 1, (1,), generator=g))
            seq[b, P - plen : P] = prompt
            seq[b, P : P + rlen] = torch.randint(3, 128, (rlen,), generator=g)
            am[b, P - plen : P + rlen] = 1
            act[b, :rlen] = True
    rewards = torch.randint(0, 2, (G, K), generator=g).float()
    rewards[0] = torch.tensor([1.0, 0.0])  # at least one informative group
    return {"sequences": seq, "attention_mask": am, "action_mask": act}, rewards


def hf_logp(model, batch):
    """[B,A] response-token log-probs, each sequence run unpadded (no mask involved)."""
    seq, am, act = batch["sequences"], batch["attention_mask"], batch["action_mask"]
    out = []
    for b in range(seq.shape[0]):
        toks = seq[b][am[b].bool()]
        plen = int(am[b, :P].sum())
        logits = model(toks.unsqueeze(0)).logits[0]
        lp = torch.log_softmax(logits.to(torch.float64), -1)
        rlen = int(act[b].sum())
        row = torch.zeros(A, dtype=lp.dtype)
        idx = torch.arange(plen - 1, plen - 1 + rlen)
        row[:rlen] = lp[idx, toks[plen : plen + rlen]]
        out.append(row)
    return torch.stack(out)


def masked_maxdiff(a, b, mask):
    return float(((a.double() - b.double()).abs() * mask).max())


def reference_step(hf, batch, extra, spec):
    """Plain torch: loss on the whole batch, autograd, clip_grad_norm_, AdamW; float64."""
    import copy

    ref = copy.deepcopy(hf).double().train()
    logp = hf_logp(ref, batch)
    if spec.name == "pg":
        mask = batch["action_mask"].double()
        ratio = torch.exp(logp - extra["old_log_probs"].double())
        adv = extra["advantages"].double().unsqueeze(-1)
        surr = -torch.minimum(ratio * adv, ratio.clamp(1 - spec.clip_eps, 1 + spec.clip_eps) * adv)
        loss = ((surr * mask).sum(-1) / mask.sum(-1)).mean()
    else:
        s = listwise.sequence_log_ratio(logp, extra["old_log_probs"].double(), batch["action_mask"], spec.clip_eps)
        loss = listwise.listwise_loss(s.view(G, K), extra["target"].double().view(G, K), spec.divergence, spec.projection)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    opt.step()
    return norm, {k: v.detach() for k, v in ref.state_dict().items()}, float(loss)


def state_maxdiff(exported, ref_sd, tied):
    keys = set(ref_sd) - ({"lm_head.weight"} if tied else set())
    if set(exported) != keys:
        raise AssertionError(f"exported names differ: {sorted(set(exported) ^ keys)}")
    return max(float((exported[k].double() - ref_sd[k].double()).abs().max()) for k in keys)


def dp_slice(batch, actor):
    ps = actor.ps
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = batch["sequences"].shape[0] // dp
    return {k: v[r * n : (r + 1) * n] for k, v in batch.items()}


def run_model(arch, tied, layouts, extra_checks):
    cfg, hf = make_hf(arch, tied)
    name = f"{arch}_{'tied' if tied else 'untied'}"
    batch, rewards = make_batch()
    mask = batch["action_mask"].double()
    with torch.no_grad():
        ref_lp = hf_logp(hf.double(), batch)
        hf.float()
    torch.manual_seed(99)
    old = (ref_lp + 0.05 * torch.randn(ref_lp.shape, dtype=torch.float64)).float()
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
    advantages = listwise.pg_advantages(rewards, "grpo").reshape(-1).float()
    extra = {"old_log_probs": old, "target": target, "advantages": advantages}
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    refs = {}
    for tp, pp, distopt, spec_name, mbs in layouts:
        # "listwise", "listwise_surrogate", "pg", or "listwise@<projection>@<divergence>"
        name_, proj, div = (spec_name.split("@") + ["listwise", "fwd"])[:3] if "@" in spec_name else (spec_name, "listwise", "fwd")
        spec = LossSpec(name=name_, group_size=K, divergence=div, projection=proj)
        ref_key = "pg" if spec_name == "pg" else f"listwise@{proj}@{div}"  # the surrogate: listwise gradient
        if ref_key not in refs:
            refs[ref_key] = reference_step(hf, batch, extra, spec)
        ref_norm, ref_sd, _ = refs[ref_key]
        t = time.time()
        actor = MegatronActor(
            cfg,
            MegatronActorConfig(tp=tp, pp=pp, micro_batch_size=mbs, lr=LR, adam_eps=EPS, clip_grad=CLIP,
                                use_distributed_optimizer=distopt),
            hf_weights=hf_sd.__getitem__,
        )
        key = f"{name}/tp{tp}pp{pp}{'_distopt' if distopt else ''}/{spec_name}/mbs{mbs}"
        rec = {}
        lp = actor.log_probs(batch)
        rec["logp_vs_hf"] = masked_maxdiff(lp, ref_lp, mask)
        rec["logp"] = (lp * batch["action_mask"]).tolist()
        ps = actor.ps
        rec["names_match"] = set(convert.local_tensors(actor.model)) == set(
            convert.expected_local_names(cfg, tp, pp, ps.get_pipeline_model_parallel_rank())
        )
        exported = dict(actor.export_hf_weights())
        rec["export_bitexact"] = all(torch.equal(exported[k], hf_sd[k]) for k in exported) and (
            set(exported) == set(hf_sd) - ({"lm_head.weight"} if tied else set())
        )
        local = dp_slice({**batch, **extra}, actor)
        m = actor.train_step(local, spec)
        rec["grad_norm"] = m["grad_norm"]
        rec["grad_norm_ref"] = ref_norm
        rec["entropy"] = m["entropy"]
        after = dict(actor.export_hf_weights())
        rec["weights_vs_ref"] = state_maxdiff(after, ref_sd, tied)
        rec["weights_moved"] = max(float((after[k] - hf_sd[k]).abs().max()) for k in after)
        if (tp, pp, distopt) in extra_checks.get("ckpt", ()):
            rec.update(check_resume(actor, cfg, hf_sd, tp, pp, distopt, mbs, {**batch, **extra}, spec))
        rec["seconds"] = time.time() - t
        results["checks"][key] = rec
        del actor
    if "wrong_qkv" in extra_checks:
        results["checks"][f"{name}/wrong_qkv"] = {"logp_vs_hf": wrong_qkv(cfg, hf_sd, batch, ref_lp, mask)}


def check_resume(actor, cfg, hf_sd, tp, pp, distopt, mbs, full, spec):
    """save after step 1 -> step 2; fresh actor + load -> step 2; compare weights and metrics."""
    ckpt = os.path.join(OUT, f"ckpt_tp{tp}pp{pp}")
    actor.save_checkpoint(ckpt, client_state={"iteration": 1})
    local = dp_slice(full, actor)
    m2 = actor.train_step(local, spec)
    w2 = dict(actor.export_hf_weights())
    fresh = MegatronActor(
        cfg,
        MegatronActorConfig(tp=tp, pp=pp, micro_batch_size=mbs, lr=LR, adam_eps=EPS, clip_grad=CLIP,
                            use_distributed_optimizer=distopt),
        hf_weights=hf_sd.__getitem__,
    )
    client = fresh.load_checkpoint(ckpt)
    m2b = fresh.train_step(local, spec)
    w2b = dict(fresh.export_hf_weights())
    return {
        "resume_client_state": client.get("iteration"),
        "resume_grad_norm_diff": abs(m2["grad_norm"] - m2b["grad_norm"]),
        "resume_weights_diff": max(float((w2[k] - w2b[k]).abs().max()) for k in w2),
        "step2_moved": max(float((w2[k] - hf_sd[k]).abs().max()) for k in w2),
    }


def wrong_qkv(cfg, hf_sd, batch, ref_lp, mask):
    """Negative control: a naive [q; k; v] concatenation must be caught by the HF comparison."""
    good = convert.fuse_qkv
    convert.fuse_qkv = lambda q, k, v, c, tp=1: torch.cat([q, k, v], 0)
    try:
        actor = MegatronActor(cfg, MegatronActorConfig(tp=1, pp=1, micro_batch_size=4), hf_weights=hf_sd.__getitem__)
        return masked_maxdiff(actor.log_probs(batch), ref_lp, mask)
    finally:
        convert.fuse_qkv = good


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeRolloutEngine:
    """Stands in for a CPU rollout engine: takes a state dict, scores sequences with HF."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        self.updates = 0
        self.update_weights = _Remote(self._update)
        self.log_probs_of = _Remote(self._log_probs_of)

    def _log_probs_of(self, ids, temperature=1.0):
        with torch.no_grad():
            logits = self.hf(torch.tensor([ids])).logits[0].double() / temperature
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        return lp.tolist()

    def _update(self, state):
        missing = {n for n, _ in self.hf.named_parameters()} - set(state)
        if missing:
            raise AssertionError(f"weight sync misses {sorted(missing)[:3]}")
        self.hf.load_state_dict(state, strict=False)
        self.updates += 1


def check_policy_actor():
    """The Ray policy-actor class driven directly (no Ray cluster): forward / append / fit /
    broadcast_to_vllm / save_checkpoint / resume, TP=2 x DP=2 on the 4-rank world."""
    from types import SimpleNamespace as NS

    import ray

    from openrlhf_lpo.megatron.ray_actor import plain_class
    from openrlhf_lpo.tiny import build_tiny_model

    ray.put = lambda x: x  # no Ray cluster in this test: the object store is the identity
    ray.get = lambda x: x
    model_dir = os.path.join(OUT, "tiny_qwen3")
    if RANK == 0:
        build_tiny_model(model_dir, arch="qwen3", seed=0, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128)
    dist.barrier()

    def make_args(load):
        return NS(
            megatron=NS(tp=2, pp=1, vpp=1, params_dtype="fp32", distributed_optimizer=False),
            actor=NS(adam=NS(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0), max_norm=1.0,
                     eps_clip=0.2, eps_clip_low_high=(0.2, 0.2), gradient_checkpointing_enable=False),
            train=NS(micro_batch_size=2, batch_size=8, max_epochs=1),
            rollout=NS(temperature=1.0, n_samples_per_prompt=K),
            algo=NS(advantage=NS(estimator="lpo")),
            lpo=NS(divergence="fwd", projection="listwise", force_two_pass=False, end_kl=True),
            ckpt=NS(path=os.path.join(OUT, "policy_ckpt"), load_enable=load, save_hf=True,
                    output_dir=os.path.join(OUT, "policy_final"), max_num=3, max_mem=float("inf")),
            vllm=NS(sync_backend="gloo", sync_with_ray=False, enable_prefix_caching=False), seed=42,
        )

    cls = plain_class()
    engine = FakeRolloutEngine(model_dir)
    pa = cls.__new__(cls)
    pa.init_model_from_pretrained(NS(args=make_args(False)), model_dir, max_steps=2, vllm_engines=[engine])
    batch, rewards = make_batch()
    for k in ("sequences",):
        batch[k] = batch[k] % 64  # tiny tokenizer vocabulary
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
    gid = torch.arange(G).repeat_interleave(K)
    dp, r = pa.actor.ps.get_data_parallel_world_size(), pa.actor.ps.get_data_parallel_rank()
    n = batch["sequences"].shape[0] // dp
    sl = slice(r * n, (r + 1) * n)
    rec = {}
    # old log-probs of the whole batch (what each rank's per-experience forward + 0.01 gives, up to
    # float noise), for the brute-force --lpo.end_kl reference below
    old_full = (pa.forward(batch["sequences"], batch["action_mask"], batch["attention_mask"]) + 0.01).double()

    def one_iteration(actor_obj):
        for j in range(0, n, 2):  # two experiences per rank, merged by fit()
            idx = slice(sl.start + j, sl.start + j + 2)
            exp = NS(sequences=batch["sequences"][idx], attention_mask=batch["attention_mask"][idx],
                     action_mask=batch["action_mask"][idx], advantages=None,
                     info={"lpo_target": target[idx], "lpo_gid": gid[idx]})
            exp.action_log_probs = actor_obj.forward(exp.sequences, exp.action_mask, exp.attention_mask) + 0.01
            actor_obj.append(exp)
        status = actor_obj.fit()
        actor_obj.broadcast_to_vllm()
        return status

    st1 = one_iteration(pa)
    rec["fit_steps"] = st1["optimizer_steps"]
    rec["fit_grad_norm"] = st1["actor_grad_norm"]
    mask = batch["action_mask"].double()
    lp_actor = pa.forward(batch["sequences"], batch["action_mask"], batch["attention_mask"])
    if RANK == 0:
        rec["engine_updates"] = engine.updates
        with torch.no_grad():
            new_lp = hf_logp(engine.hf.double(), batch)  # independent HF forward of the synced weights
            rec["engine_vs_actor"] = masked_maxdiff(new_lp, lp_actor, mask)
            engine.hf.float()
        w = target.double().view(G, K)

        def ref_kl(lp):
            """Mean KL(w*||softmax(s)) with s from HF log-probs ``lp`` (clip band of eps 0.2)."""
            s_ref = ((lp - old_full).clamp(math.log(0.8), math.log(1.2)) * mask).sum(1) / mask.sum(1)
            p = torch.softmax(s_ref.view(G, K), 1)
            return float(torch.where(w > 0, w * (w.log() - p.log()), torch.zeros_like(w)).sum(1).mean())

        rec["end_kl"] = [st1["lpo/kl_end"], ref_kl(new_lp)]
        rec["start_kl"] = [st1["lpo/kl_start"], float(math.log(K) + torch.where(w > 0, w * w.log(), 0 * w).sum(1).mean())]
        rec["end_groups"] = st1["lpo/groups"]
    pa.save_checkpoint("global_step1", {"episode": 1})
    saved = dict(pa.actor.export_hf_weights())
    st2 = one_iteration(pa)
    after2 = dict(pa.actor.export_hf_weights())
    # resume from the checkpoint in a fresh actor, replay iteration 2
    pa2 = cls.__new__(cls)
    pa2.init_model_from_pretrained(NS(args=make_args(True)), model_dir, max_steps=2, vllm_engines=[engine])
    rec["resume_states"] = pa2.get_checkpoint_states()
    got = dict(pa2.actor.export_hf_weights())
    rec["resume_vs_saved"] = max(float((got[k] - saved[k]).abs().max()) for k in saved)
    from safetensors.torch import load_file

    hf_saved = load_file(os.path.join(OUT, "policy_ckpt", "global_step1_hf", "model-00001.safetensors"))
    rec["hf_ckpt_vs_saved"] = max(float((hf_saved[k] - saved[k]).abs().max()) for k in saved)
    rec["iter2_moved"] = max(float((after2[k] - saved[k]).abs().max()) for k in saved)
    st2b = one_iteration(pa2)
    after2b = dict(pa2.actor.export_hf_weights())
    rec["resume_iter2_diff"] = max(float((after2b[k] - after2[k]).abs().max()) for k in saved)
    rec["grad_norm_iter2"] = [st2["actor_grad_norm"], st2b["actor_grad_norm"]]
    rec["status_keys"] = sorted(st2)

    # GRPO (group_norm) with --lpo.end_kl: fit()'s policy-gradient path logs the same listwise metrics
    pg_args = make_args(False)
    pg_args.algo.advantage.estimator = "group_norm"
    pg_args.ckpt.path = os.path.join(OUT, "policy_ckpt_pg")
    pa3 = cls.__new__(cls)
    pa3.init_model_from_pretrained(NS(args=pg_args), model_dir, max_steps=2, vllm_engines=[engine])
    adv = listwise.pg_advantages(rewards, "grpo").reshape(-1, 1) * batch["action_mask"].float()
    for j in range(0, n, 2):
        idx = slice(sl.start + j, sl.start + j + 2)
        exp = NS(sequences=batch["sequences"][idx], attention_mask=batch["attention_mask"][idx],
                 action_mask=batch["action_mask"][idx], advantages=adv[idx],
                 info={"lpo_target": target[idx], "lpo_gid": gid[idx]})
        exp.action_log_probs = pa3.forward(exp.sequences, exp.action_mask, exp.attention_mask) + 0.01
        pa3.append(exp)
    st3 = pa3.fit()
    pa3.broadcast_to_vllm()
    if RANK == 0:
        with torch.no_grad():
            pg_lp = hf_logp(engine.hf.double(), batch)
            engine.hf.float()
        rec["pg_end_kl"] = [st3["lpo/kl_end"], ref_kl(pg_lp)]
        rec["pg_moved"] = abs(st3["lpo/kl_end"] - st3["lpo/kl_start"])
    results["checks"]["policy_actor"] = rec


def main():
    which = os.environ.get("MCORE_WORKER_SUITE", "layouts")
    if which == "layouts":
        q3 = [
            (1, 1, False, "listwise", 2),
            (2, 1, False, "listwise", 2),
            (1, 2, False, "listwise", 2),
            (2, 2, False, "listwise", 4),
            (1, 2, True, "listwise", 2),
            (2, 1, True, "listwise", 2),
            (2, 2, False, "listwise_surrogate", 1),
            (2, 1, False, "pg", 2),
            (2, 1, False, "listwise@pointwise@fwd", 2),
            (1, 2, False, "listwise@listwise@js", 2),
        ]
        run_model("qwen3", True, q3, {"ckpt": {(1, 2, True)}, "wrong_qkv": True})
        q3u = [(1, 1, False, "listwise", 2), (2, 2, False, "listwise", 4)]
        run_model("qwen3", False, q3u, {})
        q2 = [(1, 1, False, "listwise", 2), (2, 2, False, "listwise", 4)]
        run_model("qwen2", False, q2, {})
        check_policy_actor()
    results["seconds"] = time.time() - T0


if __name__ == "__main__":
    try:
        main()
        results["ok"] = True
    except Exception:
        results["ok"] = False
        results["error"] = traceback.format_exc()
    tmp = os.path.join(OUT, f"rank{RANK}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, os.path.join(OUT, f"rank{RANK}.json"))
    if results["ok"]:
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(1)
