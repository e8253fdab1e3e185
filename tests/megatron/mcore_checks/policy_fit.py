"""Driving the Ray policy-actor class through ``fit`` without Ray (no checks of its own).

Its flags namespace with per-check overrides (``train__batch_size=4`` sets ``args.train.batch_size``), a
tiny Qwen3 saved once per world, batches in OpenRLHF's layout (left-padded prompts, right-padded responses,
the action mask over the response only), and a replica's rows appended as OpenRLHF experiences.
"""

import os
from types import SimpleNamespace as NS

import torch
import torch.distributed as dist

from . import world as W
from .references import CLIP, EPS, K, LR


def policy_args(**over):
    """The Ray policy actor's namespace (the flags fit() reads), overridable per check."""
    args = NS(
        backend="megatron",
        megatron=NS(tp=2, pp=1, vpp=1, params_dtype="fp32", distributed_optimizer=False),
        actor=NS(num_nodes=1, num_gpus_per_node=W.WORLD,  # dp = world / (tp x pp), as lpo-train's flags give it
                 adam=NS(lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0), max_norm=CLIP, eps_clip=0.2,
                 eps_clip_low_high=(0.2, 0.2), gradient_checkpointing_enable=False, entropy_coef=0.0,
                 loss_agg_mode="seq-mean-token-mean", dual_clip=None, policy_loss_type="ppo"),
        train=NS(micro_batch_size=1, batch_size=8, max_epochs=1, dynamic_batch_enable=False, max_tokens_per_gpu=0,
                 seed=42),
        rollout=NS(temperature=1.0, n_samples_per_prompt=K, micro_batch_size=1), data=NS(max_len=64),
        algo=NS(advantage=NS(estimator="lpo", is_correction_level="off", is_correction_mode="clip",
                             is_correction_gating="ratio", is_correction_threshold=(0.5, 5.0)),
                kl=NS(use_loss=False, init_coef=0.0, estimator="k1", unbiased_gradient=False)),
        lpo=NS(divergence="fwd", projection="listwise", force_two_pass=False, end_kl=False),
        ckpt=NS(path=os.path.join(W.OUT, "pa_ckpt"), load_enable=False, save_hf=False,
                output_dir=os.path.join(W.OUT, "pa_final"), max_num=3, max_mem=float("inf")),
        vllm=NS(sync_backend="gloo", sync_with_ray=False, enable_prefix_caching=False), seed=42,
    )
    for dotted, v in over.items():
        node = args
        parts = dotted.split("__")
        for part in parts[:-1]:
            node = getattr(node, part)
        setattr(node, parts[-1], v)
    return args


def make_policy_actor(model_dir, **over):
    from openrlhf_lpo.megatron.ray_actor import plain_class

    cls = plain_class()
    pa = cls.__new__(cls)
    pa.init_model_from_pretrained(NS(args=policy_args(**over)), model_dir, max_steps=8, vllm_engines=None)
    return pa


def tiny_dir():
    from openrlhf_lpo.testing.tiny import build_tiny_model

    model_dir = os.path.join(W.OUT, "tiny_train")
    if W.RANK == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_model(model_dir, arch="qwen3", seed=0, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128)
    dist.barrier()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model_dir, hf


def lpo_batch(n_groups, seed, vocab=64, plen=(2, 6), rlen=(1, 8)):
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


def append(pa, batch, rows, info, behaviour=None, advantages=None, per=2):
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


def gids_to_rows(gids):
    return [g * K + k for g in gids for k in range(K)]

