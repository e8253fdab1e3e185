"""One gloo rank (world 1) of the Megatron actor training with divergences given by parametric names.

Usage: python divergence_family_worker.py PORT OUT_JSON

For each LossSpec (alpha:<a>, hellinger, tv; whole-group loss and two-pass surrogate) one train_step
of the real MegatronActor with Adam's first step made an SGD step (lr = eps = 1e5, no clipping: the
update is g / (1 + |g|/1e5) ~ g), compared element by element with minus the gradient of the listwise
loss computed here in plain torch float64 on the HF model, the divergence written from its definition.
"""

import copy
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
PORT, OUT = sys.argv[1], sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK="0", WORLD_SIZE="1")

from openrlhf_lpo.cpu import megatron_redirect as cpu_megatron  # noqa: E402

cpu_megatron.apply()
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", rank=0, world_size=1)

from openrlhf_lpo import listwise  # noqa: E402
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig  # noqa: E402
from openrlhf_lpo.megatron.losses import LossSpec  # noqa: E402
from dataclasses import replace  # noqa: E402

from openrlhf_lpo.core.loss import log_ratio  # noqa: E402
from openrlhf_lpo.core.update import WindowMode, window_coefficients  # noqa: E402
from openrlhf_lpo.megatron.ray_actor import loss_spec_from_args  # noqa: E402
from openrlhf_lpo.testing.tiny import tiny_config  # noqa: E402

K, G, P, A = 2, 3, 5, 5


def definition(name, w, log_p):
    p = log_p.exp()
    if name == "hellinger":
        return ((w.sqrt() - p.sqrt()) ** 2).sum(-1)
    if name == "tv":
        return 0.5 * (w - p).abs().sum(-1)
    a = float(name.split(":")[1])
    return ((w ** a * p ** (1 - a)).sum(-1) - 1) / (a * (a - 1))


def main():
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen3", vocab_size=96, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      intermediate_size=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():  # non-trivial norms so every tensor matters
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    seq = torch.zeros(G * K, P + A, dtype=torch.long)
    am = torch.zeros_like(seq)
    act = torch.zeros(G * K, A, dtype=torch.bool)
    for b in range(G * K):
        rlen = int(torch.randint(2, A + 1, (1,), generator=g))
        seq[b, :P] = torch.randint(3, 96, (P,), generator=g)
        seq[b, P:P + rlen] = torch.randint(3, 96, (rlen,), generator=g)
        am[b, :P + rlen] = 1
        act[b, :rlen] = True
    batch = {"sequences": seq, "attention_mask": am, "action_mask": act}

    def hf_logp(model):
        logits = model(seq, attention_mask=am).logits.double()
        lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, seq[:, P:, None])[..., 0]
        return lp * act

    with torch.no_grad():
        lp0 = hf_logp(copy.deepcopy(hf).double())
    old = (lp0 + 0.1 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)).float() * act
    rewards = torch.tensor([[1.0, 0.0], [0.2, 0.9], [0.5, 0.4]])
    target = listwise.gibbs_target(rewards, "std").reshape(-1).float()

    results = {}
    args = type("A", (), {})()
    for name, spec_name, mbs in (("alpha:0.5", "listwise", 2), ("alpha:-0.5", "listwise_surrogate", 1),
                                 ("alpha:2", "listwise", 2), ("hellinger", "listwise_surrogate", 1),
                                 ("tv", "listwise", 2)):
        # the spec lpo-train builds from --lpo.divergence; the update plan takes one pass when micro % K == 0, else the
        # surrogate with c from a no-grad pass (core/update.py)
        args.algo = type("X", (), {"advantage": type("Y", (), {"estimator": "lpo"})()})()
        args.rollout = type("R", (), {"n_samples_per_prompt": K})()
        args.actor = type("C", (), {"eps_clip_low_high": (0.2, 0.2), "eps_clip": 0.2})()
        args.lpo = type("L", (), {"divergence": name, "projection": "listwise", "force_two_pass": False})()
        spec = replace(loss_spec_from_args(args), name=spec_name)
        assert spec.divergence == name, spec.divergence
        ref = copy.deepcopy(hf).double().train()
        s = listwise.sequence_log_ratio(hf_logp(ref), old.double(), act, 0.2)
        loss = definition(name, target.double().view(G, K), torch.log_softmax(s.view(G, K), -1)).mean()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        actor = MegatronActor(cfg, MegatronActorConfig(tp=1, pp=1, micro_batch_size=mbs, lr=1e5, adam_eps=1e5,
                                                       clip_grad=1e9, params_dtype="fp32"),
                              hf_weights=hf_sd.__getitem__)
        coefficients = None
        if spec_name == "listwise_surrogate":  # the pre-pass at the same parameters
            s_now = log_ratio(actor.log_probs(batch).double(), old.double(), act, None, None, 0.2, None)
            coefficients = window_coefficients(WindowMode.PRE_PASS, target.double(), name, "listwise", K, s=s_now)
        actor.train_step({**batch, "old_log_probs": old, "target": target}, spec, coefficients=coefficients)
        after = dict(actor.export_hf_weights())
        keys = [k for k in after if k in grads]
        scale = max(float(grads[k].abs().max()) for k in keys)
        err = max(float(((after[k].double() - hf_sd[k].double()) + grads[k]).abs().max()) for k in keys)
        results[name] = {"spec": spec.name, "rel": err / scale, "scale": scale, "n_tensors": len(keys)}
        del actor
    with open(OUT + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(OUT + ".tmp", OUT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
