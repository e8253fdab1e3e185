"""Host syncs in the loss path, the CE / entropy rows, and our THD RoPE against megatron's.

During training steps of 1 and of several micro-batches (listwise + KL + entropy, PG with the IS
correction) this project's code makes no host sync inside megatron's schedule; the CE / entropy inputs
hold the response rows only (OpenRLHF's action mask spans prompt + response, 0 on the prompt); the
rope-fusion switch follows the layer spec; ``openrlhf_lpo.megatron.rope`` equals megatron's THD RoPE bit
for bit without a host read.
"""

import os
import sys
from types import SimpleNamespace as NS

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig
from openrlhf_lpo.megatron.losses import LossSpec

from .policy_fit import lpo_batch, tiny_dir
from .references import CLIP, EPS, K, LR, dp_slice
from .registry import check

HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the checks' own code (mcore_checks/)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE.rstrip(os.sep))))


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
        self.root = os.path.join(REPO, "openrlhf_lpo")

    def _ours(self):
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if "/torch/" not in name and not name.startswith(HERE):  # this package's frames: the caller's
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


@check("syncs_and_rows")
def syncs_and_rows():
    """Cluster review F11, counted: host syncs made by this project's code inside megatron's schedule
    (the loss path) during a training step with 1 and with 4 micro-batches (listwise + KL + entropy, PG
    with IS correction): none. The CE / entropy inputs hold the response rows only (OpenRLHF's action
    mask spans prompt + response, 0 on the prompt). The rope-fusion switch follows the layer spec."""
    from megatron.core import pipeline_parallel, tensor_parallel

    from openrlhf_lpo.megatron import actor as actor_mod

    model_dir, hf = tiny_dir()
    hf_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = hf.config
    # OpenRLHF 0.11.2 layout: action_mask is [B, S-1] and 0 over the prompt
    batch, rewards = lpo_batch(4, seed=44)
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
    rec["rope"] = rope_equals_megatron()
    return {"syncs_and_rows": rec}


def rope_equals_megatron():
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

