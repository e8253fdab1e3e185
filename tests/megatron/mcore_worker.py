"""One rank of a gloo world that runs every Megatron layout check; launched by the tests.

Usage: python mcore_worker.py RANK WORLD PORT OUT_DIR
Each rank writes OUT_DIR/rank{RANK}.json with measured numbers; the pytest side asserts.
The references are independent of megatron: the HF model in float64 (per-sequence, unpadded)
for log-probs, and plain torch autograd + clip_grad_norm_ + AdamW for the training step.
"""

import copy
import json
import math
import os
import sys
import time
import traceback
from types import SimpleNamespace as NS

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

torch.set_num_threads(1)
RANK, WORLD, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=str(RANK), WORLD_SIZE=str(WORLD))

from openrlhf_lpo.cpu import megatron_redirect as cpu_megatron  # noqa: E402

cpu_megatron.apply()
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", rank=RANK, world_size=WORLD)

from openrlhf_lpo import listwise  # noqa: E402
from openrlhf_lpo.megatron import convert  # noqa: E402
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig  # noqa: E402
from openrlhf_lpo.megatron.losses import LossSpec  # noqa: E402
from openrlhf_lpo.testing.tiny import tiny_config  # noqa: E402

K, G, P, A = 2, 4, 6, 6
LR, EPS, CLIP = 1e-3, 1e-4, 0.5
results = {"rank": RANK, "checks": {}}
T0 = time.time()


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
ARCH_KWARGS = {  # Llama 3.1's RoPE scaling; Mistral with a sliding window longer than the test sequences
    "llama": dict(rope_scaling=LLAMA3_ROPE, max_position_embeddings=16384),
    "mistral": dict(sliding_window=64),
}


def make_hf(arch, tied):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(
        arch, vocab_size=128, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, tie_word_embeddings=tied, **ARCH_KWARGS.get(arch, {}),
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
        lo, hi = spec.clip_eps if isinstance(spec.clip_eps, tuple) else (spec.clip_eps, spec.clip_eps)
        surr = -torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
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


def reference_inputs(arch="qwen3", tied=True):
    """A tiny HF model (and its weights), the shared batch, its float64 action log-probs, and old
    log-probs 0.05 away from them (seed 99; the global RNG goes on from there)."""
    cfg, hf = make_hf(arch, tied)
    batch, rewards = make_batch()
    with torch.no_grad():
        ref_lp = hf_logp(hf.double(), batch)
        hf.float()
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    torch.manual_seed(99)
    old = (ref_lp + 0.05 * torch.randn(ref_lp.shape, dtype=torch.float64)).float()
    return cfg, hf, hf_sd, batch, rewards, ref_lp, old


def run_model(arch, tied, layouts, extra_checks):
    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs(arch, tied)
    name = f"{arch}_{'tied' if tied else 'untied'}"
    mask = batch["action_mask"].double()
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
    advantages = listwise.pg_advantages(rewards, "grpo").reshape(-1).float()
    extra = {"old_log_probs": old, "target": target, "advantages": advantages}
    # ratios in (1.2, 1.28): the symmetric clip cuts them, clip-higher (eps_high 0.28) does not
    extra_far = dict(extra, old_log_probs=(ref_lp - 0.215 + 0.02 * torch.randn(ref_lp.shape, dtype=torch.float64)).float())
    refs = {}
    for tp, pp, distopt, spec_name, mbs in layouts:
        # "listwise", "listwise_surrogate", "pg", "pg_hi" (eps 0.2 / 0.28), or "listwise@<projection>@<divergence>"
        name_, proj, div = (spec_name.split("@") + ["listwise", "fwd"])[:3] if "@" in spec_name else (spec_name, "listwise", "fwd")
        ex = extra
        if spec_name == "pg_hi":
            name_, ex = "pg", extra_far
        spec = LossSpec(name=name_, group_size=K, divergence=div, projection=proj,
                        clip_eps=(0.2, 0.28) if spec_name == "pg_hi" else 0.2)
        ref_key = spec_name if spec_name.startswith("pg") else f"listwise@{proj}@{div}"  # surrogate: listwise gradient
        if ref_key not in refs:
            refs[ref_key] = reference_step(hf, batch, ex, spec)
        if spec_name == "pg_hi" and "pg_sym_far" not in refs:  # sensitivity: the symmetric clip differs
            refs["pg_sym_far"] = reference_step(hf, batch, ex, LossSpec(name="pg", group_size=K, clip_eps=0.2))
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
        local = dp_slice({**batch, **ex}, actor)
        m = actor.train_step(local, spec)
        rec["grad_norm"] = m["grad_norm"]
        rec["grad_norm_ref"] = ref_norm
        if spec_name == "pg_hi":
            rec["grad_norm_sym_ref"] = refs["pg_sym_far"][0]
            rec["clip_ratio"] = m.get("ppo_clip_ratio")
        rec["entropy"] = m["entropy"]
        after = dict(actor.export_hf_weights())
        rec["weights_vs_ref"] = state_maxdiff(after, ref_sd, tied)
        rec["weights_moved"] = max(float((after[k] - hf_sd[k]).abs().max()) for k in after)
        if (tp, pp, distopt, spec_name) in extra_checks.get("stream", ()):
            rec["export_accounting"] = counted_export(actor)
        if {(tp, pp, distopt), (tp, pp, distopt, spec_name)} & set(extra_checks.get("ckpt", ())):
            rec.update(check_resume(actor, cfg, hf_sd, tp, pp, distopt, mbs, {**batch, **extra}, spec))
        rec["seconds"] = time.time() - t
        results["checks"][key] = rec
        del actor
    if "wrong_qkv" in extra_checks:
        results["checks"][f"{name}/wrong_qkv"] = {"logp_vs_hf": wrong_qkv(cfg, hf_sd, batch, ref_lp, mask)}
    if "wrong_rope" in extra_checks:  # negative control: Llama 3 RoPE scaling left out
        plain = copy.deepcopy(cfg)
        plain.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
        actor = MegatronActor(plain, MegatronActorConfig(tp=1, pp=1, micro_batch_size=4), hf_weights=hf_sd)
        results["checks"][f"{name}/wrong_rope"] = {"logp_vs_hf": masked_maxdiff(actor.log_probs(batch), ref_lp, mask)}
        del actor


def check_resume(actor, cfg, hf_sd, tp, pp, distopt, mbs, full, spec):
    """save after step 1 -> step 2; fresh actor + load -> step 2; compare weights and metrics."""
    ckpt = os.path.join(OUT, f"ckpt_tp{tp}pp{pp}")
    accounting = counted_save(actor, ckpt, client_state={"iteration": 1})
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
        "save_accounting": accounting,
        "resume_client_state": client.get("iteration"),
        "resume_grad_norm_diff": abs(m2["grad_norm"] - m2b["grad_norm"]),
        "resume_weights_diff": max(float((w2[k] - w2b[k]).abs().max()) for k in w2),
        "step2_moved": max(float((w2[k] - hf_sd[k]).abs().max()) for k in w2),
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
    if RANK == 0:
        out["same_tensors"] = list(streams[0]) == list(streams[None]) and all(
            torch.equal(streams[0][k], streams[None][k]) for k in streams[None])
    return out


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
    from openrlhf_lpo.testing.tiny import build_tiny_model

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
    prev = 0.03 * torch.arange(G * K, dtype=torch.float64).remainder(3)  # s_t, rides along for kl_start
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
                     info={"lpo_target": target[idx], "lpo_gid": gid[idx], "lpo_prev_log_ratio": prev[idx]})
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

        def ref_kl(lp, delta=0.0):
            """Mean KL(w*||softmax(s)) with s from HF log-probs ``lp`` (clip band of eps 0.2), plus ``delta``:
            s_t rides in s as in the DeepSpeed trainer (offpolicy.py placement B)."""
            s_ref = ((lp - old_full).clamp(math.log(0.8), math.log(1.2)) * mask).sum(1) / mask.sum(1) + delta
            p = torch.softmax(s_ref.view(G, K), 1)
            return float(torch.where(w > 0, w * (w.log() - p.log()), torch.zeros_like(w)).sum(1).mean())

        rec["end_kl"] = [st1["lpo/kl_end"], ref_kl(new_lp, prev)]
        logp_t = torch.log_softmax(prev.view(G, K), 1)
        rec["start_kl"] = [st1["lpo/kl_start"], float(torch.where(w > 0, w * (w.log() - logp_t), 0 * w).sum(1).mean())]
        rec["end_groups"] = st1["lpo/groups"]
    rec["lpo_metrics"] = {k: v for k, v in st1.items() if k.startswith("lpo/")}
    pa.save_checkpoint("global_step1", {"episode": 1})
    saved = dict(pa.actor.export_hf_weights())
    pa.set_lpo_divergence("rev")  # --lpo.divergence_schedule fwd@0,rev@1: the driver's call before update 2
    st2 = one_iteration(pa)
    rec["iter2_divergence"] = pa.last_spec.divergence
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
    pa2.set_lpo_divergence("rev")  # the resumed driver re-sends the schedule's divergence
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
    rec.update(check_vllm_stream(pa3))
    results["checks"]["policy_actor"] = rec


class _FakeUpdateGroup:
    """Stands in for OpenRLHF's model-update group (vLLM's PyNccl communicator) on rank 0."""

    def __init__(self):
        self.sent = []

    def broadcast(self, t, src=0, stream=None):
        self.sent.append((t.dtype, tuple(t.shape), t.detach().clone()))


def check_vllm_stream(pa):
    """broadcast_to_vllm towards vLLM engines (no state-dict method): every tensor in the engines'
    bf16, one update_weight per tensor, prefix caches reset after the last one, and the Ray
    collective path with --vllm.sync_with_ray."""
    import ray.util.collective as collective

    from openrlhf_lpo.megatron.ray_actor import VLLM_ENGINE_DTYPE

    events = []
    engine = NS(update_weight=_Remote(lambda name, dtype, shape, empty_cache=False: events.append(("w", name, dtype))),
                reset_prefix_cache=_Remote(lambda: events.append(("reset",))))
    group = _FakeUpdateGroup()
    saved = (pa.vllm_engines, pa._model_update_group, pa.args.vllm)
    pa.vllm_engines, pa._model_update_group = [engine], group
    pa.args.vllm = NS(sync_backend="nccl", sync_with_ray=False, enable_prefix_caching=True)
    expect = {k: v.to(VLLM_ENGINE_DTYPE) for k, v in pa.actor.export_hf_weights()}
    pa.broadcast_to_vllm()
    out = {}
    if RANK == 0:
        out["vllm_names_ok"] = [e[1] for e in events if e[0] == "w"] == list(expect)
        out["vllm_dtypes"] = sorted({str(e[2]) for e in events if e[0] == "w"} | {str(d) for d, _, _ in group.sent})
        out["vllm_values_ok"] = all(torch.equal(t, expect[n]) for (_, _, t), n in zip(group.sent, expect))
        out["vllm_reset_last"] = events[-1] == ("reset",) and sum(e[0] == "reset" for e in events) == 1
    # --vllm.sync_with_ray: the same stream through ray.util.collective
    ray_sent = []
    orig = collective.broadcast
    collective.broadcast = lambda t, src, group_name=None: ray_sent.append((t.dtype, group_name))
    pa.args.vllm = NS(sync_backend="nccl", sync_with_ray=True, enable_prefix_caching=False)
    pa._model_update_group = "openrlhf"
    events.clear()
    try:
        pa.broadcast_to_vllm()
    finally:
        collective.broadcast = orig
    if RANK == 0:
        out["ray_sync_count"] = [len(ray_sent), len(expect)]
        out["ray_sync_ok"] = all(d == VLLM_ENGINE_DTYPE and g == "openrlhf" for d, g in ray_sent)
        out["ray_sync_no_reset"] = ("reset",) not in events
    pa.vllm_engines, pa._model_update_group, pa.args.vllm = saved
    return out


# ----------------------------------------------------------------------------- layouts, packing, resharding


def _seq_rows(lp, batch):
    """Per row: the log-probs of its real tokens 1..L-1 (A = S-1 layouts)."""
    out = []
    am = batch["attention_mask"]
    for i in range(am.shape[0]):
        f = int(am[i].int().argmax())
        L = int(am[i].sum())
        out.append(lp[i, f : f + L - 1].double())
    return out


def _batch_of(rows, left=0):
    """Rows of real tokens, each left-padded by ``left`` and right-padded to the widest; A = S-1."""
    S = max(len(r) for r in rows) + left
    seq = torch.zeros(len(rows), S, dtype=torch.long)
    am = torch.zeros_like(seq)
    for i, r in enumerate(rows):
        seq[i, left : left + len(r)] = r
        am[i, left : left + len(r)] = 1
    act = torch.zeros(len(rows), S - 1, dtype=torch.bool)
    for i, r in enumerate(rows):
        act[i, left : left + len(r) - 1] = True
    return {"sequences": seq, "attention_mask": am, "action_mask": act}


def check_packing():
    """The same sequence alone, left-padded by 300 and packed with others gives the same log-probs
    (vs HF float64 too) in TP1 / TP2 / PP2; each rank reads only its slices of the checkpoint."""
    cfg, hf = make_hf("qwen3", True)
    model_dir = os.path.join(OUT, "packing_model")
    if RANK == 0:
        hf.save_pretrained(model_dir, safe_serialization=True)
    dist.barrier()
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (13, 7, 21, 10)]
    with torch.no_grad():
        hfd = hf.double()
        ref = [torch.log_softmax(hfd(r[None]).logits[0], -1)[:-1].gather(-1, r[1:, None])[:, 0] for r in rows]
        hf.float()
    total = sum(v.numel() for k, v in hf.state_dict().items() if k != "lm_head.weight")
    rec = {"hf_numel": total}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        actor = MegatronActor(cfg, MegatronActorConfig(tp=tp, pp=pp, micro_batch_size=4), hf_weights=model_dir)
        local = sum(p.numel() for p in convert.unwrap(actor.model).parameters())
        with torch.no_grad():
            packed = _seq_rows(actor.log_probs(_batch_of(rows)), _batch_of(rows))
            alone = [_seq_rows(actor.log_probs(_batch_of([r])), _batch_of([r]))[0] for r in rows]
            left = [_seq_rows(actor.log_probs(_batch_of([r], left=300)), _batch_of([r], left=300))[0] for r in rows]
        d = lambda xs, ys: max(float((x - y).abs().max()) for x, y in zip(xs, ys))  # noqa: E731
        rec[f"tp{tp}pp{pp}"] = {
            "packed_vs_alone": d(packed, alone), "left300_vs_alone": d(left, alone),
            "packed_vs_hf": d(packed, ref), "left300_vs_hf": d(left, ref),
            "weights_read": actor.weights_read, "local_numel": local,
        }
        del actor
    results["checks"]["packing"] = rec


class _BigTensorMonitor(TorchDispatchMode):
    """Records every op output with two dimensions >= S (an S x S score or mask)."""

    def __init__(self, S):
        super().__init__()
        self.S, self.hits, self.max_numel = S, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
                if sum(d >= self.S for d in t.shape) >= 2:
                    self.hits.append((str(func), tuple(t.shape)))
        return out


def check_no_sxs():
    """A 4096-token sequence through log_probs and train_step allocates no S x S tensor; the
    stock local attention with a padding mask (the old path) does, at 1024 tokens."""
    S = 4096
    cfg = tiny_config("qwen3", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128)
    actor = MegatronActor(cfg, MegatronActorConfig(tp=1, pp=1, micro_batch_size=1, recompute=True))
    g = torch.Generator().manual_seed(5)
    batch = _batch_of([torch.randint(3, 128, (S,), generator=g)])
    mon = _BigTensorMonitor(S)
    with mon:
        lp = actor.log_probs(batch)
        data = dict(batch, old_log_probs=lp.detach(), advantages=torch.ones(1))
        actor.train_step(data, LossSpec(name="pg", group_size=1))
    rec = {"hits": mon.hits[:5], "max_numel": mon.max_numel, "S": S}
    del actor
    if RANK == 0:  # negative control: megatron's own local attention with an explicit [1,1,s,s] mask
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from openrlhf_lpo.megatron.model import transformer_config_from_hf

        s = 1024
        stock = GPTModel(transformer_config_from_hf(cfg), get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                         vocab_size=128, max_sequence_length=s, position_embedding_type="rope", rotary_base=1e6)
        toks = torch.randint(3, 128, (1, s), generator=g)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
        ctl = _BigTensorMonitor(s)
        with torch.no_grad(), ctl:
            stock(toks, torch.arange(s)[None], mask)
        rec["control_hits"] = len(ctl.hits)
    results["checks"]["no_sxs"] = rec


def check_update_magnitude():
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
    results["checks"]["update_magnitude"] = rec


def check_recompute():
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
    results["checks"]["recompute"] = rec


def check_offpolicy():
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
    results["checks"]["offpolicy"] = rec


def check_reshard():
    """Checkpoints resume in another layout: TP2 -> TP1, PP2 (distributed optimizer) -> TP2,
    TP1 -> PP2 (tied output layer); --ckpt.max_num pruning; a crash mid-save keeps 'latest'."""
    from openrlhf_lpo.megatron import checkpoint

    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs()
    full = dict(batch, old_log_probs=old,
                target=listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float())
    spec = LossSpec(name="listwise", group_size=K)

    def mk(tp, pp, distopt=False, weights=None):
        return MegatronActor(cfg, MegatronActorConfig(tp=tp, pp=pp, micro_batch_size=2, lr=LR, adam_eps=EPS,
                                                      clip_grad=CLIP, use_distributed_optimizer=distopt),
                             hf_weights=weights or hf_sd)

    def wdiff(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    rec = {}
    for name, src, dst in (("tp2_to_tp1", (2, 1, False), (1, 1, False)), ("pp2_to_tp2", (1, 2, True), (2, 1, False))):
        root = os.path.join(OUT, f"reshard_{name}")
        a = mk(*src)
        a.train_step(dp_slice(full, a), spec)
        w1 = dict(a.export_hf_weights())
        a.save_checkpoint(root, client_state={"episode": 7, "rng": torch.arange(3)})
        m2 = a.train_step(dp_slice(full, a), spec)
        w2 = dict(a.export_hf_weights())
        del a
        b = mk(*dst)
        client = b.load_checkpoint(root)
        loaded = dict(b.export_hf_weights())
        n2 = b.train_step(dp_slice(full, b), spec)
        got = dict(b.export_hf_weights())
        r = {"client_ok": client["episode"] == 7 and client["rng"].tolist() == [0, 1, 2], "step": b.step,
             "loaded_vs_saved": wdiff(loaded, w1), "step2_vs_continued": wdiff(got, w2),
             "grad_norm": [m2["grad_norm"], n2["grad_norm"]], "step2_moved": wdiff(w2, w1)}
        if name == "tp2_to_tp1":
            # negative control: the same weights without the Adam moments give another step 2
            c = mk(*dst, weights={k: v.clone() for k, v in w1.items()})
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
            p = mk(1, 2)
            p.load_checkpoint(root)
            r["tp1_to_pp2_vs_saved"] = wdiff(dict(p.export_hf_weights()), got)
            del p
        else:
            del b
        rec[name] = r
    results["checks"]["reshard"] = rec


def check_nodes():
    """TP groups must stay inside a node: the collective check over the 4-rank world."""
    from openrlhf_lpo.megatron.cluster import PlacementError, check_tp_groups_within_nodes

    rec = {}
    for name, nodes, tp in (("AABB_tp2", "AABB", 2), ("AABB_tp4", "AABB", 4), ("ABAB_tp2", "ABAB", 2)):
        os.environ["LPO_NODE_ID"] = nodes[RANK]
        try:
            check_tp_groups_within_nodes(tp)
            rec[name] = "ok"
        except PlacementError as e:
            rec[name] = str(e)
    os.environ.pop("LPO_NODE_ID", None)
    results["checks"]["nodes"] = rec



# ----------------------------------------------------------------------------- training options


def hf_logp_entropy(model, batch):
    """[B,A] response-token log-probs and entropies (float64), each sequence run unpadded."""
    seq, am, act = batch["sequences"], batch["attention_mask"], batch["action_mask"]
    Aw = act.shape[1]
    Sw = seq.shape[1]
    lps, ents = [], []
    for b in range(seq.shape[0]):
        first = int(am[b].int().argmax())
        toks = seq[b][am[b].bool()]
        logits = model(toks.unsqueeze(0)).logits[0].to(torch.float64)
        logp = torch.log_softmax(logits, -1)
        ent_all = -(logp.exp() * logp).sum(-1)
        lp_row = torch.zeros(Aw, dtype=torch.float64)
        ent_row = torch.zeros(Aw, dtype=torch.float64)
        for a in range(Aw):
            c = Sw - Aw + a  # the column whose token action a scores
            pos = c - 1 - first  # the logit predicting it, inside the unpadded sequence
            if act[b, a] and am[b, c] and pos >= 0:
                lp_row[a] = logp[pos, toks[pos + 1]]
                ent_row[a] = ent_all[pos]
        lps.append(lp_row)
        ents.append(ent_row)
    return torch.stack(lps), torch.stack(ents)


def _kl_estimate(r, estimator):
    """Schulman's k1/k2/k3 of r = log pi - log pi_ref, written from the blog post (k3 bounded as upstream)."""
    if estimator == "k1":
        v = r
    elif estimator == "k2":
        v = r ** 2 / 2
    else:
        rr = r.clamp(min=-10)
        v = torch.exp(-rr) - 1 + rr
    return v.clamp(-10, 10)


def reference_windows(hf, batch, extra, spec, windows, lr=LR, clip=CLIP):
    """Window by window in float64 from the HF weights: each window's loss at the current parameters
    (autograd), clip_grad_norm_, one AdamW step (state kept across windows). Loss: forward KL of
    w* = extra["target"] against softmax(s), s = mean over kept tokens of clip(log pi - old) + delta
    (LPO), or the PPO-clip token surrogate (pg); plus kl_coef x the token-mean KL estimator to
    extra["base_log_probs"] and minus entropy_coef x the token-mean entropy, both over the window.
    Returns (grad norms, final state dict)."""
    ref = copy.deepcopy(hf).double().train()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    norms = []
    lo, hi = spec.clip_eps if isinstance(spec.clip_eps, tuple) else (spec.clip_eps, spec.clip_eps)
    for idx in windows:
        idx = torch.as_tensor(idx)
        sub = {k: v[idx] for k, v in batch.items()}
        ex = {k: v[idx] for k, v in extra.items()}
        logp, ent = hf_logp_entropy(ref, sub)
        mask = sub["action_mask"].double()
        old = ex["old_log_probs"].double()
        if spec.name == "pg":
            ratio = torch.exp(logp - old)
            adv = ex["advantages"].double().unsqueeze(-1)
            surr = -torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
            loss = ((surr * mask).sum(-1) / mask.sum(-1)).mean()
        else:
            keep = ex.get("keep", mask).double()
            r = (logp - old).clamp(math.log(1 - lo), math.log(1 + hi))
            s = (r * keep).sum(-1) / keep.sum(-1).clamp(min=1) + ex.get("delta", torch.zeros(len(idx))).double()
            w = ex["target"].double().view(-1, K)
            log_p = torch.log_softmax(s.view(-1, K), -1)
            loss = (w * (w.log() - log_p)).sum(-1).mean()
        T = mask.sum()
        if spec.kl_coef:
            kl = _kl_estimate(logp - ex["base_log_probs"].double(), spec.kl_estimator)
            loss = loss + spec.kl_coef * (kl * mask).sum() / T
        if spec.entropy_coef:
            loss = loss - spec.entropy_coef * (ent * mask).sum() / T
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
    return norms, {k: v.detach() for k, v in ref.state_dict().items()}


def check_kl_entropy():
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
    cases = [  # tp, pp, loss, estimator, kl coef, entropy coef, micro-batch size
        (1, 1, "listwise", "k3", 0.5, 0.05, 2),
        (2, 1, "listwise", "k1", 0.5, 0.05, 2),
        (1, 2, "pg", "k2", 0.3, 0.02, 2),
    ]
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.megatron.ray_actor import loss_spec_from_args

    model_dir = os.path.join(OUT, f"kl_flags_config_rank{RANK}")
    cfg.save_pretrained(model_dir)  # what the flags' layout check reads
    for tp, pp, name, est, kl, ent, mbs in cases:
        # the reference names the estimator itself; the actor's loss settings come from the flags
        # (lpo-train's parser and the Ray actor's loss_spec_from_args), so a flag that does not reach the
        # Megatron loss (an estimator dropped or replaced on the way) shows as a gradient mismatch
        ref_spec = LossSpec(name=name, group_size=K, clip_eps=0.2, kl_coef=kl, kl_estimator=est, entropy_coef=ent)
        spec = loss_spec_from_args(build_parser_and_parse([
            "--actor.model_name_or_path", model_dir, "--reward.remote_url", "http://127.0.0.1:1/reward",
            "--backend", "megatron", "--megatron.tp", str(tp), "--megatron.pp", str(pp),
            "--actor.num_gpus_per_node", str(WORLD), "--rollout.n_samples_per_prompt", str(K),
            "--rollout.batch_size", str(G), "--train.batch_size", str(G * K), "--train.micro_batch_size", str(mbs),
            "--algo.advantage.estimator", "lpo" if name == "listwise" else "group_norm", "--actor.eps_clip", "0.2",
            "--actor.loss_agg_mode", "seq-mean-token-mean",  # the reference's PG aggregation (stock: token-mean)
            "--algo.kl.use_loss", "--algo.kl.init_coef", str(kl), "--algo.kl.estimator", est,
            "--actor.entropy_coef", str(ent), "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0"]),
            mbs, kl_ctl=kl)
        assert spec.name == name, (spec.name, name)
        ref_norms, ref_sd = reference_windows(hf, batch, extra, ref_spec, [list(range(G * K))])
        plain_norm = reference_windows(hf, batch, extra, LossSpec(name=name, group_size=K, clip_eps=0.2),
                                       [list(range(G * K))])[0][0]
        actor = MegatronActor(cfg, MegatronActorConfig(tp=tp, pp=pp, micro_batch_size=mbs, lr=LR, adam_eps=EPS,
                                                       clip_grad=CLIP), hf_weights=hf_sd)
        m = actor.train_step(dp_slice({**batch, **extra}, actor), spec)
        rec[f"tp{tp}pp{pp}/{name}/{est}"] = {
            "flags": {"kl_estimator": spec.kl_estimator, "kl_coef": spec.kl_coef, "entropy_coef": spec.entropy_coef},
            "grad_norm": m["grad_norm"], "grad_norm_ref": ref_norms[0], "grad_norm_without_terms": plain_norm,
            "weights_vs_ref": state_maxdiff(dict(actor.export_hf_weights()), ref_sd, True), "kl": m.get("kl")}
        del actor
    results["checks"]["kl_entropy"] = rec


def check_lr_schedule():
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
            lrs.append(m["lr"])
            if i == 0:
                rec["step0_moved"] = max(float((v - hf_sd[k]).abs().max()) for k, v in actor.export_hf_weights())
            if i == 2:
                actor.save_checkpoint(os.path.join(OUT, "lr_ckpt"))
        rec["lrs"] = lrs
        rec["optimizer_group_lrs"] = seen[:]
        rec["actor_lr_after"] = actor.lr_schedule.lr
        fresh = mk()
        fresh.load_checkpoint(os.path.join(OUT, "lr_ckpt"))
        rec["resumed_lrs"] = [fresh.train_step(dp_slice(data, fresh), spec)["lr"] for _ in range(3)]
        del fresh
    finally:
        type(actor.optimizer).step = orig_step
    del actor
    results["checks"]["lr_schedule"] = rec


def _policy_args(**over):
    """The Ray policy actor's namespace (the flags fit() reads), overridable per check."""
    args = NS(
        megatron=NS(tp=2, pp=1, vpp=1, params_dtype="fp32", distributed_optimizer=False),
        actor=NS(adam=NS(lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0), max_norm=CLIP, eps_clip=0.2,
                 eps_clip_low_high=(0.2, 0.2), gradient_checkpointing_enable=False, entropy_coef=0.0,
                 loss_agg_mode="seq-mean-token-mean", dual_clip=None, policy_loss_type="ppo"),
        train=NS(micro_batch_size=1, batch_size=8, max_epochs=1, dynamic_batch_enable=False, max_tokens_per_gpu=0),
        rollout=NS(temperature=1.0, n_samples_per_prompt=K),
        algo=NS(advantage=NS(estimator="lpo", is_correction_level="off", is_correction_mode="clip",
                             is_correction_gating="ratio", is_correction_threshold=(0.5, 5.0)),
                kl=NS(use_loss=False, init_coef=0.0, estimator="k1", unbiased_gradient=False)),
        lpo=NS(divergence="fwd", projection="listwise", force_two_pass=False, end_kl=False),
        ckpt=NS(path=os.path.join(OUT, "pa_ckpt"), load_enable=False, save_hf=False,
                output_dir=os.path.join(OUT, "pa_final"), max_num=3, max_mem=float("inf")),
        vllm=NS(sync_backend="gloo", sync_with_ray=False, enable_prefix_caching=False), seed=42,
    )
    for dotted, v in over.items():
        node = args
        parts = dotted.split("__")
        for part in parts[:-1]:
            node = getattr(node, part)
        setattr(node, parts[-1], v)
    return args


def _policy_actor(model_dir, **over):
    from openrlhf_lpo.megatron.ray_actor import plain_class

    cls = plain_class()
    pa = cls.__new__(cls)
    pa.init_model_from_pretrained(NS(args=_policy_args(**over)), model_dir, max_steps=8, vllm_engines=None)
    return pa


def _tiny_dir():
    from openrlhf_lpo.testing.tiny import build_tiny_model

    model_dir = os.path.join(OUT, "tiny_train")
    if RANK == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_model(model_dir, arch="qwen3", seed=0, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model_dir, hf


def _lpo_batch(n_groups, seed, vocab=64, plen=(2, 6), rlen=(1, 8)):
    """n_groups x K sequences in OpenRLHF's layout (left-padded prompts, right-padded responses; the
    action mask covers only the response), varied lengths, group g = rows g*K .. g*K+K-1."""
    g = torch.Generator().manual_seed(seed)
    Pw, Aw = plen[1], rlen[1]
    B = n_groups * K
    seq = torch.zeros(B, Pw + Aw, dtype=torch.long)
    am = torch.zeros_like(seq)
    act = torch.zeros(B, Aw, dtype=torch.bool)
    for gi in range(n_groups):
        p = int(torch.randint(plen[0], plen[1] + 1, (1,), generator=g))
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for k in range(K):
            b = gi * K + k
            r = int(torch.randint(rlen[0], rlen[1] + 1, (1,), generator=g))
            seq[b, Pw - p:Pw] = prompt
            seq[b, Pw:Pw + r] = torch.randint(3, vocab, (r,), generator=g)
            am[b, Pw - p:Pw + r] = 1
            act[b, :r] = True
    rewards = torch.rand(n_groups, K, generator=g).round(decimals=1)
    rewards[0] = torch.tensor([1.0, 0.0])
    return {"sequences": seq, "attention_mask": am, "action_mask": act}, rewards


def _append(pa, batch, rows, info, behaviour=None, advantages=None, per=2):
    """This replica's rows as OpenRLHF experiences of ``per`` samples, old log-probs from the actor."""
    if advantages is not None and advantages.dim() == 1:  # OpenRLHF's advantages are per token
        advantages = advantages.unsqueeze(1) * batch["action_mask"]
    for j in range(0, len(rows), per):
        idx = torch.as_tensor(rows[j:j + per])
        exp = NS(sequences=batch["sequences"][idx], attention_mask=batch["attention_mask"][idx],
                 action_mask=batch["action_mask"][idx], advantages=None if advantages is None else advantages[idx],
                 info={k: v[idx] for k, v in info.items()})
        exp.action_log_probs = pa.forward(exp.sequences, exp.action_mask, exp.attention_mask)
        if behaviour is not None:
            exp.rollout_log_probs = behaviour[idx]
        pa.append(exp)


def _gids_to_rows(gids):
    return [g * K + k for g in gids for k in range(K)]


def check_offpolicy_fit():
    """The listwise off-policy target through the Ray policy actor's fit (TP2 x DP2, micro-batch 1 < K,
    2 windows x 2 epochs): --algo.advantage.is_correction_level token in clip and mask modes, s_t = delta
    from the behaviour log-probs (rollout_log_probs) as the DeepSpeed trainer maps it; every step's grad
    norm and the final weights equal the window-by-window float64 reference. The first window takes c
    from s_t (no pre-pass): forwards are counted (shortcut, then pre-pass, pre-pass, pre-pass)."""
    import numpy as np

    from openrlhf_lpo.core.offpolicy import BehaviourCorrection, behaviour_log_ratio

    model_dir, hf = _tiny_dir()
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    n_groups = 4
    batch, rewards = _lpo_batch(n_groups, seed=21)
    mask = batch["action_mask"]
    rec = {}
    for mode in ("clip", "mask"):
        pa = _policy_actor(model_dir, algo__advantage__is_correction_level="token",
                           algo__advantage__is_correction_mode=mode, algo__advantage__is_correction_threshold=(0.8, 1.25),
                           train__batch_size=4, train__max_epochs=2, ckpt__path=os.path.join(OUT, f"off_{mode}"))
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
        mine = _gids_to_rows(range(r * n_groups // dp, (r + 1) * n_groups // dp))
        _append(pa, batch, mine, info, behaviour=behaviour)
        before = pa.actor.forwards
        st = pa.fit()
        forwards = pa.actor.forwards - before
        plan = pa.last_plan
        # the global groups of each step: this replica's window + the other replica's
        mine_g = [sorted({int(gid[torch.as_tensor(mine)[i]]) for i in p["samples"]}) for p in plan]
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
        ref_norms, ref_sd = reference_windows(hf, batch, extra, spec, [_gids_to_rows(w) for w in windows])
        final = dict(pa.actor.export_hf_weights())
        rec[mode] = {"modes": [p["mode"] for p in plan], "grad_norms": [p["grad_norm"] for p in plan],
                     "grad_norms_ref": ref_norms, "weights_vs_ref": state_maxdiff(final, ref_sd, hf.config.tie_word_embeddings),
                     "weights_moved": max(float((final[k] - hf_sd[k]).abs().max()) for k in final),
                     "forwards": forwards, "micro": [p["micro"] for p in plan],
                     "delta_abs_max": float(delta.abs().max()),
                     "delta_vs_ref": float((delta - torch.tensor(d_ref)).abs().max()),
                     "shortcut_windows": st["lpo/shortcut_windows"], "pre_pass_windows": st["lpo/pre_pass_windows"]}
        del pa
    results["checks"]["offpolicy_fit"] = rec


def check_dynamic_batching():
    """--train.dynamic_batch_enable --train.max_tokens_per_gpu through fit: token-budget micro-batches of
    unequal token counts, counts agreed over the replicas, in TP2 x PP2 (4 ranks, 1 replica) and PP2 x DP2
    (2 replicas holding different token totals); LPO one-pass (every group fits), LPO with groups over the
    budget (first window from s_t), and GRPO; one window each, grad norm and weights vs the float64
    reference."""
    model_dir, hf = _tiny_dir()
    n_groups = 4
    batch, rewards = _lpo_batch(n_groups, seed=33, plen=(2, 9), rlen=(1, 10))
    lengths = batch["attention_mask"].sum(1)
    tau = listwise.group_temperature(rewards, "std")
    target = listwise.gibbs_target(rewards.double(), tau.double()).reshape(-1)
    gid = torch.arange(n_groups).repeat_interleave(K)
    adv = listwise.pg_advantages(rewards, "grpo").reshape(-1).float()
    rec = {"lengths": lengths.tolist()}
    group_max = int(max(lengths.view(-1, K).sum(1)))
    for layout, tp, pp in (("tp2pp2", 2, 2), ("pp2dp2", 1, 2)):
        for name, est, budget in (("lpo_whole", "lpo", group_max + 4), ("lpo_split", "lpo", int(lengths.max()) + 2),
                                  ("grpo", "group_norm", int(lengths.max()) + 6)):
            pa = _policy_actor(model_dir, megatron__tp=tp, megatron__pp=pp, algo__advantage__estimator=est,
                               train__dynamic_batch_enable=True, train__max_tokens_per_gpu=budget,
                               train__batch_size=n_groups * K, train__micro_batch_size=1,
                               ckpt__path=os.path.join(OUT, f"dyn_{layout}_{name}"))
            dp, r = pa.actor.ps.get_data_parallel_world_size(), pa.actor.ps.get_data_parallel_rank()
            with torch.no_grad():
                old_full = pa.actor.log_probs(batch).cpu().float()
            # replica 1 gets the two longest groups: unequal token totals across replicas
            order = sorted(range(n_groups), key=lambda gi: int(lengths.view(-1, K)[gi].sum()))
            mine_groups = order[r * n_groups // dp:(r + 1) * n_groups // dp]
            mine = _gids_to_rows(mine_groups)
            info = {"lpo_target": target, "lpo_gid": gid, "lpo_prev_log_ratio": torch.zeros(n_groups * K, dtype=torch.float64)}
            _append(pa, batch, mine, info, advantages=adv if est != "lpo" else None)
            pa.fit()
            plan = pa.last_plan
            spec = LossSpec(name="listwise" if est == "lpo" else "pg", group_size=K, clip_eps=0.2)
            extra = {"old_log_probs": old_full, "target": target, "advantages": adv}
            ref_norms, ref_sd = reference_windows(hf, batch, extra, spec, [list(range(n_groups * K))])
            final = dict(pa.actor.export_hf_weights())
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, [p["micro"] for p in plan])
            rec[f"{layout}/{name}"] = {"budget": budget, "modes": [p["mode"] for p in plan],
                                       "micro": [p["micro"] for p in plan],
                                       "micro_tokens": [p["micro_tokens"] for p in plan],
                                       "counts_all_ranks": [[len(m) for m in c] for c in counts],
                                       "local_count": plan[0]["local_micro_count"],
                                       "grad_norm": plan[0]["grad_norm"], "grad_norm_ref": ref_norms[0],
                                       "weights_vs_ref": state_maxdiff(final, ref_sd, hf.config.tie_word_embeddings)}
            del pa
    results["checks"]["dynamic_batching"] = rec


def check_pg_partial_batch():
    """Cluster review F1 (520 vs 512 samples at a window of 512), scaled down: GRPO on a partial batch dealt
    66 vs 64 samples to two replicas (--train.batch_size 128: window 64 per replica). Before, replica 0 ran 2 optimizer steps and
    replica 1 one, and replica 0's second step waited in the DP all-reduce until the timeout. Now both
    run the same number of steps (TP2 x DP2); every rank finishes."""
    model_dir, hf = _tiny_dir()
    t = time.time()
    pa = _policy_actor(model_dir, algo__advantage__estimator="group_norm", train__batch_size=128,
                       train__micro_batch_size=8, ckpt__path=os.path.join(OUT, "pg_partial"))
    dp, r = pa.actor.ps.get_data_parallel_world_size(), pa.actor.ps.get_data_parallel_rank()
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
    results["checks"]["pg_partial_batch"] = {
        "samples": n, "optimizer_steps": st["optimizer_steps"], "windows": [len(p["samples"]) for p in pa.last_plan],
        "grad_norms": [p["grad_norm"] for p in pa.last_plan], "seconds": time.time() - t}
    del pa


class _SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts calls that make the host wait for the device (.item(), .tolist(), bool/int/float of a
    tensor, nonzero, boolean-mask indexing) whose caller is this project's code (openrlhf_lpo/), not
    megatron's or torch's own."""

    SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
             torch.masked_select}

    def __init__(self):
        super().__init__()
        self.hits = []
        self.others = []  # megatron's (or anyone else's) syncs inside the schedule
        self.root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                 "openrlhf_lpo")

    def _ours(self):
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if "/torch/" not in name and name != __file__:
                return name.startswith(self.root), f"{os.path.basename(name)}:{f.f_lineno}"
            f = f.f_back
        return False, ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sync = func in self.SYNCS
        if func is torch.Tensor.__getitem__ and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            sync = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if sync:
            ours, where = self._ours()
            (self.hits if ours else self.others).append(where)
        return func(*args, **kwargs)


def check_syncs_and_rows():
    """Cluster review F11, counted: host syncs made by this project's code inside megatron's schedule
    (the loss path) during a training step with 1 and with 4 micro-batches (listwise + KL + entropy, PG
    with IS correction): none. The CE / entropy inputs hold the response rows only (OpenRLHF's action
    mask spans prompt + response, 0 on the prompt). The rope-fusion switch follows the layer spec."""
    from megatron.core import pipeline_parallel, tensor_parallel

    from openrlhf_lpo.megatron import actor as actor_mod

    model_dir, hf = _tiny_dir()
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = hf.config
    # OpenRLHF 0.11.2 layout: action_mask is [B, S-1] and 0 over the prompt
    batch, rewards = _lpo_batch(4, seed=44)
    S = batch["sequences"].shape[1]
    act = torch.zeros(batch["sequences"].shape[0], S - 1, dtype=torch.bool)
    act[:, -batch["action_mask"].shape[1]:] = batch["action_mask"]
    batch = dict(batch, action_mask=act)
    rec = {"response_tokens": int(act.sum()),
           "predictable_tokens": int(sum(int(a.sum()) - 1 for a in batch["attention_mask"]))}
    ce_rows = []
    orig_ce = tensor_parallel.vocab_parallel_cross_entropy

    def counting_ce(logits, target, *a, **k):
        ce_rows.append(int(logits.shape[0]))
        return orig_ce(logits, target, *a, **k)

    orig_fb = pipeline_parallel.get_forward_backward_func
    counter = _SyncCounter()

    def counted_fb():
        fb = orig_fb()

        def run(*a, **k):
            with counter:
                return fb(*a, **k)

        return run

    tensor_parallel.vocab_parallel_cross_entropy = counting_ce
    pipeline_parallel.get_forward_backward_func = counted_fb
    try:
        actor = MegatronActor(cfg, MegatronActorConfig(tp=2, micro_batch_size=4, lr=LR, adam_eps=EPS, clip_grad=CLIP),
                              hf_weights=hf_sd)
        rec["apply_rope_fusion"] = actor.tconfig.apply_rope_fusion
        ce_rows.clear()
        lp = actor.log_probs(batch).cpu()
        rec["logp_ce_rows"] = sum(ce_rows)  # every rank of the replica scores the whole batch
        rec["logp_zero_outside_mask"] = float((lp * (~act)).abs().max())
        ce_rows.clear()
        target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
        adv = listwise.pg_advantages(rewards, "grpo").reshape(-1).float()
        data = dict(batch, old_log_probs=lp + 0.01, target=target, base_log_probs=lp - 0.02, advantages=adv,
                    rollout_log_probs=lp + 0.03)
        local = dp_slice(data, actor)
        n_local = local["sequences"].shape[0]
        for name, spec in (
            ("listwise_kl_entropy", LossSpec(name="listwise", group_size=K, kl_coef=0.1, kl_estimator="k3",
                                             entropy_coef=0.01)),
            ("pg_is_correction", LossSpec(name="pg", group_size=K, clip_eps=(0.2, 0.2),
                                          is_correction=("token", "clip", "ratio", (0.5, 5.0)))),
        ):
            for n_micro in (1, n_local // K * 2 if name.startswith("pg") else n_local // K):
                per = n_local // n_micro
                micro = [list(range(i, i + per)) for i in range(0, n_local, per)]
                counter.hits.clear()
                counter.others.clear()
                ce_rows.clear()
                actor.train_step(local, spec, micro_batches=micro)
                rec[f"{name}/micro{n_micro}"] = {"syncs": list(counter.hits), "other_syncs": list(counter.others),
                                                 "ce_rows": sum(ce_rows),
                                                 "local_response_tokens": int(local["action_mask"].sum())}
        del actor
    finally:
        tensor_parallel.vocab_parallel_cross_entropy = orig_ce
        pipeline_parallel.get_forward_backward_func = orig_fb
    rec["te_overrides"] = actor_mod.config_overrides(True)
    rec["rope"] = check_rope_equals_megatron()
    results["checks"]["syncs_and_rows"] = rec


def check_rope_equals_megatron():
    """openrlhf_lpo.megatron.rope against megatron's own THD RoPE on the same q: one sequence (the recipes'
    micro-batch 1) and three packed sequences; bit for bit, and with no host read of ours."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from openrlhf_lpo.megatron import rope

    out = {"installed": attention.apply_rotary_pos_emb is rope.apply_rotary_pos_emb}
    config = NS(apply_rope_fusion=False, multi_latent_attention=False, rotary_interleaved=False)
    g = torch.Generator().manual_seed(3)
    freqs = torch.randn(40, 1, 1, 16, generator=g, dtype=torch.float64).float()
    for name, bounds in (("one", [0, 37]), ("three", [0, 9, 30, 37])):
        t = torch.randn(37, 4, 16, generator=g)
        cu = torch.tensor(bounds, dtype=torch.int32)
        theirs = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs[:max(b - a for a, b in zip(bounds, bounds[1:]))],
                                                      cp_group=NS(size=lambda: 1, rank=lambda: 0))
        rope.attach_bounds(cu, bounds)
        counter = _SyncCounter()
        with counter:
            ours = rope.apply_rotary_pos_emb(t, freqs[:max(b - a for a, b in zip(bounds, bounds[1:]))], config,
                                             cu_seqlens=cu, cp_group=NS(size=lambda: 1, rank=lambda: 0))
        out[name] = {"equal": bool(torch.equal(ours, theirs)), "syncs": counter.hits + counter.others,
                     "moved": float((ours - t).abs().max())}
    return out


class _CollectiveRecorder:
    """Wraps torch.distributed collectives: every tensor must be on its group's device."""

    NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
             "gather")

    def __init__(self):
        from openrlhf_lpo.megatron.device import group_device

        self.calls, self.mismatches = 0, []
        for name in self.NAMES:
            fn = getattr(dist, name)

            def wrapped(*a, _fn=fn, _name=name, **k):
                group = k.get("group")
                tensors = [x for x in a if isinstance(x, torch.Tensor)]
                tensors += [t for x in (*a, *k.values()) if isinstance(x, list) for t in x if isinstance(t, torch.Tensor)]
                want = group_device(group)
                self.calls += 1
                for t in tensors:
                    if t.device != want:
                        self.mismatches.append((_name, str(t.device), str(want)))
                return _fn(*a, **k)

            setattr(dist, name, wrapped)


RECORDER = None


def main():
    global RECORDER
    RECORDER = _CollectiveRecorder()
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
            (2, 2, False, "listwise_surrogate@pointwise@fwd", 1),
            (2, 1, False, "pg", 2),
            (1, 2, False, "pg_hi", 2),
            (2, 1, False, "listwise@pointwise@fwd", 2),
            (1, 2, False, "listwise@listwise@js", 2),
        ]
        run_model("qwen3", True, q3, {"ckpt": {(1, 2, True), (2, 2, False, "listwise")},
                                      "stream": {(2, 2, False, "listwise")}, "wrong_qkv": True})
        q3u = [(1, 1, False, "listwise", 2), (2, 2, False, "listwise", 4)]
        run_model("qwen3", False, q3u, {})
        q2 = [(1, 1, False, "listwise", 2), (2, 2, False, "listwise", 4)]
        run_model("qwen2", False, q2, {})
        for arch in ("llama", "mistral"):  # the paper's model-diversity runs
            run_model(arch, False, [(2, 1, False, "listwise", 2), (1, 2, False, "listwise", 2)],
                      {"wrong_rope": True} if arch == "llama" else {})
        check_update_magnitude()
        check_packing()
        check_no_sxs()
        check_recompute()
        check_offpolicy()
        check_reshard()
        check_nodes()
        check_policy_actor()
        check_kl_entropy()
        check_lr_schedule()
        check_offpolicy_fit()
        check_dynamic_batching()
        check_pg_partial_batch()
        check_syncs_and_rows()
        results["collectives"] = {"calls": RECORDER.calls, "mismatches": RECORDER.mismatches[:10]}
        results["groups"] = process_group_census()
        results["ok"] = True
        write_record(results)  # the layout checks stand even if the parallel ones below fail or hang
        if os.environ.get("MCORE_WORKER_PARALLEL", "1") == "1":
            run_parallel_checks()
    elif which.startswith("only:"):  # development: MCORE_WORKER_SUITE=only:check_a,check_b
        for name in which[5:].split(","):
            t = time.time()
            globals()[name]()
            results.setdefault("check_seconds", {})[name] = round(time.time() - t, 1)
    results["seconds"] = time.time() - T0


def process_group_census() -> dict:
    """Live process groups vs those megatron holds now, and gloo TCP loop threads (F: leaked groups)."""
    from megatron.core import parallel_state as ps

    from openrlhf_lpo.megatron.groups import parallel_state_groups

    threads = 0
    for t in os.listdir("/proc/self/task"):
        try:
            threads += open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop"
        except OSError:
            pass
    return {"live": len(dist.distributed_c10d._world.pg_map), "held": len(parallel_state_groups(ps)),
            "gloo_loop_threads": threads}


def run_parallel_checks():
    """The sequence-parallel and virtual-pipeline checks (mcore_parallel_worker.py) in this world, after the
    layouts: one world start for both. Their results go to ``results["parallel"]`` ({ok, error, checks}); a
    failure there is reported there and ends this rank (the others would wait in a collective)."""
    sys.modules.setdefault("mcore_worker", sys.modules[__name__])  # the parallel module imports this one
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mcore_parallel_worker as PW

    part = results["parallel"] = {"ok": False, "checks": PW.results["checks"]}
    try:
        PW.main()
        part["ok"] = True
    except Exception:
        part["error"] = traceback.format_exc()
        write_record(results)
        os._exit(1)


def write_record(record):
    tmp = os.path.join(OUT, f"rank{RANK}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(OUT, f"rank{RANK}.json"))


def run_and_report(entry, record):
    """Run ``entry()``; write ``record`` (with ok / error) to OUT/rank{RANK}.json; leave the world."""
    try:
        entry()
        record["ok"] = True
    except Exception:
        record["ok"] = False
        record["error"] = traceback.format_exc()
    write_record(record)
    if record["ok"]:
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(1)


if __name__ == "__main__":
    run_and_report(main, results)
