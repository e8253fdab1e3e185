"""The Ray policy-actor class driven directly (no Ray cluster), TP2 x DP2 on the 4-rank world.

``fit`` twice with a weight sync into an HF stand-in for the rollout engine after each (the engine then
scores with the actor's weights), ``--lpo.end_kl`` / ``lpo/*`` metrics vs brute force over the DP group,
a checkpoint with its HF copy, a resume that repeats iteration 2, the divergence schedule's switch, GRPO's
``fit``; then the weight stream towards vLLM engines (bf16, one update per tensor, one prefix-cache reset)
and through Ray collectives.
"""

import math
import os
from types import SimpleNamespace as NS

import torch
import torch.distributed as dist

from openrlhf_lpo import listwise

from . import world as W
from .policy_fit import policy_args
from .references import G, K, hf_logp, make_batch, masked_maxdiff
from .registry import check


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


@check("policy_actor")
def policy_actor():
    """The Ray policy-actor class driven directly (no Ray cluster): forward / append / fit /
    broadcast_to_vllm / save_checkpoint / resume, TP=2 x DP=2 on the 4-rank world."""
    import ray

    from openrlhf_lpo.megatron.ray_actor import plain_class
    from openrlhf_lpo.testing.tiny import build_tiny_model

    ray.put = lambda x: x  # no Ray cluster in this test: the object store is the identity
    ray.get = lambda x: x
    model_dir = os.path.join(W.OUT, "tiny_qwen3")
    if W.RANK == 0:
        build_tiny_model(model_dir, arch="qwen3", seed=0, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128)
    dist.barrier()

    def make_args(load):  # the policy actor's flags (policy_fit.policy_args: every flag fit() reads)
        return policy_args(actor__adam=NS(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0), actor__max_norm=1.0,
                           train__micro_batch_size=2, lpo__end_kl=True,
                           ckpt__path=os.path.join(W.OUT, "policy_ckpt"), ckpt__load_enable=load, ckpt__save_hf=True,
                           ckpt__output_dir=os.path.join(W.OUT, "policy_final"))

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
    if W.RANK == 0:
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
    rec["iter2_divergence"] = pa.last_update.divergence
    after2 = dict(pa.actor.export_hf_weights())
    # resume from the checkpoint in a fresh actor, replay iteration 2
    pa2 = cls.__new__(cls)
    pa2.init_model_from_pretrained(NS(args=make_args(True)), model_dir, max_steps=2, vllm_engines=[engine])
    rec["resume_states"] = pa2.get_checkpoint_states()
    got = dict(pa2.actor.export_hf_weights())
    rec["resume_vs_saved"] = max(float((got[k] - saved[k]).abs().max()) for k in saved)
    from safetensors.torch import load_file

    hf_saved = load_file(os.path.join(W.OUT, "policy_ckpt", "global_step1_hf", "model-00001.safetensors"))
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
    pg_args.ckpt.path = os.path.join(W.OUT, "policy_ckpt_pg")
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
    if W.RANK == 0:
        with torch.no_grad():
            pg_lp = hf_logp(engine.hf.double(), batch)
            engine.hf.float()
        rec["pg_end_kl"] = [st3["lpo/kl_end"], ref_kl(pg_lp)]
        rec["pg_moved"] = abs(st3["lpo/kl_end"] - st3["lpo/kl_start"])
    rec.update(vllm_stream(pa3))
    return {"policy_actor": rec}


class _FakeUpdateGroup:
    """Stands in for OpenRLHF's model-update group (vLLM's PyNccl communicator) on rank 0."""

    def __init__(self):
        self.sent = []

    def broadcast(self, t, src=0, stream=None):
        self.sent.append((t.dtype, tuple(t.shape), t.detach().clone()))


def vllm_stream(pa):
    """broadcast_to_vllm towards vLLM engines (no state-dict method) with --megatron.sync_bucket_mb 0.0125 (12.8 KiB):
    every tensor in the engines' bf16, one update_weight_bucket per bucket with consecutive sequence numbers that
    run on over the next sync, each bucket's broadcast buffer unpacking to the exported tensors bit for bit, prefix
    caches reset after the last one, and the Ray collective path with --vllm.sync_with_ray."""
    import ray.util.collective as collective

    from openrlhf_lpo.engines.buckets import unpack
    from openrlhf_lpo.megatron.ray_actor import VLLM_ENGINE_DTYPE

    events = []
    engine = NS(update_weight_bucket=_Remote(lambda seq, metas, empty_cache=False:
                                             events.append(("b", seq, metas, empty_cache))),
                reset_prefix_cache=_Remote(lambda: events.append(("reset",))))
    group = _FakeUpdateGroup()
    saved = (pa.vllm_engines, pa._model_update_group, pa.args.vllm, getattr(pa.args, "megatron", None))
    pa.vllm_engines, pa._model_update_group = [engine], group
    pa.args.vllm = NS(sync_backend="nccl", sync_with_ray=False, enable_prefix_caching=True)
    pa.args.megatron = NS(**{**vars(saved[3] or NS()), "sync_bucket_mb": 0.0125})
    expect = {k: v.to(VLLM_ENGINE_DTYPE) for k, v in pa.actor.export_hf_weights()}
    pa.broadcast_to_vllm()
    out = {}
    if W.RANK == 0:
        calls = [e for e in events if e[0] == "b"]
        got = [(n, t) for (_, _, metas, _), (_, _, buf) in zip(calls, group.sent) for n, t in unpack(buf, metas)]
        out["vllm_names_ok"] = [n for n, _ in got] == list(expect)
        out["vllm_dtypes"] = sorted({str(t.dtype) for _, t in got} | {str(m[1]) for c in calls for m in c[2]})
        out["vllm_buffers"] = sorted({str(d) for d, _, _ in group.sent})
        out["vllm_values_ok"] = len(got) == len(expect) and all(torch.equal(t, expect[n]) for n, t in got)
        out["vllm_seqs"] = [c[1] for c in calls]
        out["vllm_buckets"] = [[len(c[2]), int(buf.numel())] for c, (_, _, buf) in zip(calls, group.sent)]
        out["vllm_empty_cache"] = [i for i, c in enumerate(calls) if c[3]]
        out["vllm_reset_last"] = events[-1] == ("reset",) and sum(e[0] == "reset" for e in events) == 1
        out["vllm_last_sync"] = dict(pa.last_sync)
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
    if W.RANK == 0:
        out["ray_sync_count"] = [len(ray_sent), len(out["vllm_seqs"])]
        out["ray_sync_seqs"] = [e[1] for e in events if e[0] == "b"]
        out["ray_sync_ok"] = all(d == torch.uint8 and g == "openrlhf" for d, g in ray_sent)
        out["ray_sync_no_reset"] = ("reset",) not in events
    pa.vllm_engines, pa._model_update_group, pa.args.vllm, pa.args.megatron = saved
    return out
