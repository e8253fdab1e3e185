"""The references every check compares against, independent of megatron.

A tiny HF model with non-trivial norms and biases, the shared batch (G groups of K responses, left-padded
prompts of up to P tokens, responses of up to A), response log-probs from HF in float64 with each sequence
run unpadded (no mask involved), and plain-torch float64 steps (autograd, ``clip_grad_norm_``, AdamW),
whole-batch (:func:`reference_step`) or window by window with the KL and entropy terms
(:func:`reference_windows`).
"""

import copy
import math

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.testing.tiny import tiny_config

K, G, P, A = 2, 4, 6, 6
LR, EPS, CLIP = 1e-3, 1e-4, 0.5

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

