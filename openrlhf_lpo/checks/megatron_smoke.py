"""Smoke run of the Megatron actor: a few LPO steps on a tiny offline Qwen3, checked against HF.

Meant for a machine with an accelerator (``examples/scripts/gpu_smoke_megatron.sh`` runs it
under ``torchrun``; Transformer Engine's layer spec is used when installed); on a CPU-only
machine run it through the CPU redirection, ``python -m openrlhf_lpo.cpu.megatron_redirect
openrlhf_lpo.checks.megatron_smoke``, and the same checks run with gloo.

Checks (non-zero exit status on failure): action log-probs vs the HF model on the same
weights (fp32: 1e-4, bf16: 0.1 max abs), finite gradient norms, the weights move, and the
exported HF weights load back into HF and reproduce the Megatron log-probs.
Prints one JSON line per dtype with the measured numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _hf_logp(model, batch, device):
    seq, am, act = batch["sequences"], batch["attention_mask"], batch["action_mask"]
    S, A = seq.shape[1], act.shape[1]
    out = torch.zeros(act.shape, dtype=torch.float32)
    with torch.no_grad():
        for b in range(seq.shape[0]):
            valid = am[b].bool()
            toks = seq[b][valid].unsqueeze(0).to(device)
            logits = model(toks).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            start = int(valid[: S - A].sum())  # real prompt tokens
            n = int(act[b].sum())
            idx = torch.arange(start - 1, start - 1 + n, device=device)
            out[b, :n] = lp[idx, toks[0, start : start + n]].cpu()
    return out


def _batch(G, K, P, A, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = G * K
    seq = torch.zeros(B, P + A, dtype=torch.long)
    am = torch.zeros(B, P + A, dtype=torch.long)
    act = torch.zeros(B, A, dtype=torch.bool)
    for i in range(B):
        plen = int(torch.randint(2, P + 1, (1,), generator=g))
        rlen = int(torch.randint(1, A + 1, (1,), generator=g))
        seq[i, P - plen : P + rlen] = torch.randint(3, vocab, (plen + rlen,), generator=g)
        am[i, P - plen : P + rlen] = 1
        act[i, :rlen] = True
    rewards = torch.randint(0, 2, (G, K), generator=g).float()
    rewards[:, 0] = 1.0
    rewards[:, 1] = 0.0
    return {"sequences": seq, "attention_mask": am, "action_mask": act}, rewards


def run(dtype: str, steps: int, tp: int, pp: int, model_dir: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from openrlhf_lpo import listwise
    from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig
    from openrlhf_lpo.megatron.losses import LossSpec

    cfg = AutoConfig.from_pretrained(model_dir)
    actor = MegatronActor(
        cfg,
        MegatronActorConfig(tp=tp, pp=pp, params_dtype=dtype, micro_batch_size=4, lr=1e-3, clip_grad=1.0),
        hf_weights=model_dir,
    )
    G, K = 4, 4
    batch, rewards = _batch(G, K, 16, 24, min(cfg.vocab_size, 100))
    device = actor.device
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    rec = {"dtype": dtype, "tp": tp, "pp": pp, "device": str(device), "te_spec": actor.uses_te}
    t = time.time()
    lp = actor.log_probs(batch).cpu()
    rec["logprob_s"] = time.time() - t
    mask = batch["action_mask"].float()
    rec["logp_vs_hf"] = float(((lp - _hf_logp(hf, batch, device)).abs() * mask).max())
    target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1)
    data = dict(batch, old_log_probs=lp, target=target.float())
    norms, times = [], []
    for _ in range(steps):
        t = time.time()
        m = actor.train_step(data, LossSpec(name="listwise", group_size=K, divergence="fwd"))
        times.append(time.time() - t)
        norms.append(m["grad_norm"])
    rec["grad_norms"] = norms
    rec["step_s"] = times
    lp2 = actor.log_probs(batch).cpu()
    rec["logp_moved"] = float(((lp2 - lp).abs() * mask).max())
    state = {k: v.float() for k, v in actor.export_hf_weights()}
    if torch.distributed.get_rank() == 0:
        hf.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False)
        rec["export_vs_actor"] = float(((_hf_logp(hf, batch, device) - lp2).abs() * mask).max())
    tol = 1e-4 if dtype == "fp32" else 0.1
    ok = rec["logp_vs_hf"] < tol and all(n == n and n < 1e6 for n in norms) and rec["logp_moved"] > 0
    ok = ok and rec.get("export_vs_actor", 0.0) < tol
    rec["ok"] = bool(ok)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--work_dir", default=os.environ.get("TMPDIR", "/tmp") + "/lpo_megatron_smoke")
    a = p.parse_args(argv)
    import torch.distributed as dist

    from openrlhf_lpo.megatron.device import init_default_group, set_local_device
    from openrlhf_lpo.testing.tiny import build_tiny_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_default_group()
    model_dir = os.path.join(a.work_dir, "tiny_qwen3")
    if dist.get_rank() == 0:
        build_tiny_model(model_dir, arch="qwen3", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         head_dim=64, intermediate_size=768, vocab_size=128)
    dist.barrier()
    ok = True
    for dtype in a.dtypes.split(","):
        rec = run(dtype, a.steps, a.tp, a.pp, model_dir)
        ok &= rec["ok"]
        if dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
