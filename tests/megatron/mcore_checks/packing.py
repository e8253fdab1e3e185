"""Packed sequences and token budgets.

A sequence alone, left-padded by 300 tokens and packed with three others gives the same log-probs (and
HF float64's) in TP1 / TP2 / PP2, each rank reading only its slices of the checkpoint; a 4096-token
sequence allocates no S x S tensor (megatron's stock masked attention does: the negative control);
``--train.dynamic_batch_enable`` token-budget micro-batches through ``fit`` agree over the replicas and
give the float64 reference's step.
"""

import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron import convert
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig
from openrlhf_lpo.megatron.losses import LossSpec
from openrlhf_lpo.testing.tiny import tiny_config

from . import world as W
from .policy_fit import append, gids_to_rows, lpo_batch, make_policy_actor, tiny_dir
from .references import K, make_hf, reference_windows, state_maxdiff
from .registry import check


def seq_rows(lp, batch):
    """Per row: the log-probs of its real tokens 1..L-1 (A = S-1 layouts)."""
    out = []
    am = batch["attention_mask"]
    for i in range(am.shape[0]):
        f = int(am[i].int().argmax())
        L = int(am[i].sum())
        out.append(lp[i, f : f + L - 1].double())
    return out


def batch_of(rows, left=0):
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


@check("packing")
def packing():
    """The same sequence alone, left-padded by 300 and packed with others gives the same log-probs
    (vs HF float64 too) in TP1 / TP2 / PP2; each rank reads only its slices of the checkpoint."""
    cfg, hf = make_hf("qwen3", True)
    model_dir = os.path.join(W.OUT, "packing_model")
    if W.RANK == 0:
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
            packed = seq_rows(actor.log_probs(batch_of(rows)), batch_of(rows))
            alone = [seq_rows(actor.log_probs(batch_of([r])), batch_of([r]))[0] for r in rows]
            left = [seq_rows(actor.log_probs(batch_of([r], left=300)), batch_of([r], left=300))[0] for r in rows]
        d = lambda xs, ys: max(float((x - y).abs().max()) for x, y in zip(xs, ys))  # noqa: E731
        rec[f"tp{tp}pp{pp}"] = {
            "packed_vs_alone": d(packed, alone), "left300_vs_alone": d(left, alone),
            "packed_vs_hf": d(packed, ref), "left300_vs_hf": d(left, ref),
            "weights_read": actor.weights_read, "local_numel": local,
        }
        del actor
    return {"packing": rec}


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


@check("no_sxs")
def no_sxs():
    """A 4096-token sequence through log_probs and train_step allocates no S x S tensor; the
    stock local attention with a padding mask (the old path) does, at 1024 tokens."""
    S = 4096
    cfg = tiny_config("qwen3", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128)
    actor = MegatronActor(cfg, MegatronActorConfig(tp=1, pp=1, micro_batch_size=1, recompute=True))
    g = torch.Generator().manual_seed(5)
    batch = batch_of([torch.randint(3, 128, (S,), generator=g)])
    mon = _BigTensorMonitor(S)
    with mon:
        lp = actor.log_probs(batch)
        data = dict(batch, old_log_probs=lp.detach(), advantages=torch.ones(1))
        actor.train_step(data, LossSpec(name="pg", group_size=1))
    rec = {"hits": mon.hits[:5], "max_numel": mon.max_numel, "S": S}
    del actor
    if W.RANK == 0:  # negative control: megatron's own local attention with an explicit [1,1,s,s] mask
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
    return {"no_sxs": rec}


@check("dynamic_batching")
def dynamic_batching():
    """--train.dynamic_batch_enable --train.max_tokens_per_gpu through fit: token-budget micro-batches of
    unequal token counts, counts agreed over the replicas, in TP2 x PP2 (4 ranks, 1 replica) and PP2 x DP2
    (2 replicas holding different token totals); LPO one-pass (every group fits), LPO with groups over the
    budget (first window from s_t), and GRPO; one window each, grad norm and weights vs the float64
    reference."""
    model_dir, hf = tiny_dir()
    n_groups = 4
    batch, rewards = lpo_batch(n_groups, seed=33, plen=(2, 9), rlen=(1, 10))
    lengths = batch["attention_mask"].sum(1)
    tau = listwise.group_temperature(rewards, "std")
    target = listwise.gibbs_target(rewards.double(), tau.double()).reshape(-1)
    gid = torch.arange(n_groups).repeat_interleave(K)
    adv = listwise.pg_advantages(rewards, "grpo").reshape(-1).float()
    rec = {"lengths": lengths.tolist()}
    group_max = int(max(lengths.view(-1, K).sum(1)))
    from openrlhf_lpo.core import layout

    for layout_name, tp, pp in (("tp2pp2", 2, 2), ("pp2dp2", 1, 2)):
        for name, est, budget in (("lpo_whole", "lpo", group_max + 4), ("lpo_split", "lpo", int(lengths.max()) + 2),
                                  ("grpo", "group_norm", int(lengths.max()) + 6)):
            pa = make_policy_actor(model_dir, megatron__tp=tp, megatron__pp=pp, algo__advantage__estimator=est,
                               train__dynamic_batch_enable=True, train__max_tokens_per_gpu=budget,
                               train__batch_size=n_groups * K, train__micro_batch_size=1,
                               ckpt__path=os.path.join(W.OUT, f"dyn_{layout_name}_{name}"))
            dp, r = pa.actor.ps.get_data_parallel_world_size(), pa.actor.ps.get_data_parallel_rank()
            with torch.no_grad():
                old_full = pa.actor.log_probs(batch).cpu().float()
            # replica 1 gets the two longest groups: unequal token totals across replicas
            order = sorted(range(n_groups), key=lambda gi: int(lengths.view(-1, K)[gi].sum()))
            mine_groups = order[r * n_groups // dp:(r + 1) * n_groups // dp]
            mine = gids_to_rows(mine_groups)
            info = {"lpo_target": target, "lpo_gid": gid, "lpo_prev_log_ratio": torch.zeros(n_groups * K, dtype=torch.float64)}
            append(pa, batch, mine, info, advantages=adv if est != "lpo" else None)
            pa.fit()
            plan = pa.last_update.windows
            rows = batch["attention_mask"][torch.as_tensor(mine)].sum(1).tolist()  # the replica's merged rows
            micro_tokens = [[int(sum(rows[i] for i in mb)) for mb in p.micro_batches] for p in plan]
            local_count = layout.first_fit_count([rows[i] for i in plan[0].indices], budget)  # before agreement
            spec = LossSpec(name="listwise" if est == "lpo" else "pg", group_size=K, clip_eps=0.2)
            extra = {"old_log_probs": old_full, "target": target, "advantages": adv}
            ref_norms, ref_sd = reference_windows(hf, batch, extra, spec, [list(range(n_groups * K))])
            final = dict(pa.actor.export_hf_weights())
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, [[len(mb) for mb in p.micro_batches] for p in plan])
            rec[f"{layout_name}/{name}"] = {"budget": budget, "modes": [str(p.mode or "pg") for p in plan],
                                            "micro": [[len(mb) for mb in p.micro_batches] for p in plan],
                                            "micro_tokens": micro_tokens,
                                            "counts_all_ranks": [[len(m) for m in c] for c in counts],
                                            "local_count": local_count,
                                            "grad_norm": pa.last_update.grad_norms[0], "grad_norm_ref": ref_norms[0],
                                            "weights_vs_ref": state_maxdiff(final, ref_sd, hf.config.tie_word_embeddings)}
            del pa
    return {"dynamic_batching": rec}

