"""Offloading the Megatron actor between phases (openrlhf_lpo/megatron/offload.py): at TP2 and at PP2, both with
the distributed optimizer, after a training step (Adam state, main fp32 shards and gradient buffers exist):
every tracked byte comes back bit for bit, nothing stays resident on the device in between, and the next
step equals the step of an actor that never offloaded."""

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron.actor import MegatronActor
from openrlhf_lpo.megatron.losses import LossSpec
from openrlhf_lpo.megatron.offload import HostOffload, tensors_of

from .layouts import Layout
from .references import K, dp_slice, reference_inputs
from .registry import check


def _split_round_trip(a, before):
    """The Megatron Ray actor's sleep (ray_actor.MegatronPolicyActor._offload): the weights and the training state
    as two disjoint HostOffloads covering every tracked storage; the weights alone come back for a forward while the
    gradients and optimizer state stay on the host; then everything is back bit for bit."""
    from openrlhf_lpo.megatron.ray_actor import _is_weight

    def param_bytes():
        return sum(p.untyped_storage().nbytes() for p in a.model.parameters())

    weights = HostOffload([a.model], where=_is_weight)
    state = HostOffload([a.model], [a.optimizer], exclude=[weights])
    every = HostOffload([a.model], [a.optimizer])
    out = {"disjoint": not set(weights.where) & set(state.where),
           "covers_all": set(weights.where) | set(state.where) == set(every.where),
           "weight_bytes": weights.tracked_bytes(), "state_bytes": state.tracked_bytes(),
           "all_bytes": every.tracked_bytes()}
    state.offload()
    weights.offload()
    out["asleep_resident"] = weights.resident_bytes() + state.resident_bytes()
    out["asleep_param_bytes"] = param_bytes()
    weights.onload()  # what forward / the weight sync bring back
    out["weights_only_param_bytes"] = param_bytes()
    out["weights_only_state_resident"] = state.resident_bytes()
    state.onload()
    after = list(tensors_of([a.model], [a.optimizer]))
    out["bit_exact"] = len(after) == len(before) and all(w == v and torch.equal(t, u)
                                                         for (w, t), (v, u) in zip(before, after))
    return out


@check("offload")
def offload():
    cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs()
    full = dict(batch, old_log_probs=old,
                target=listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float())
    spec = LossSpec(name="listwise", group_size=K)
    rec = {}
    for name, lay in (("tp2_distopt", Layout(tp=2, pp=1, distributed_optimizer=True)),
                      ("pp2_distopt", Layout(tp=1, pp=2, distributed_optimizer=True))):
        a = MegatronActor(cfg, lay.actor_config(), hf_weights=hf_sd)
        a.train_step(dp_slice(full, a), spec)
        before = [(w, t.clone()) for w, t in tensors_of([a.model], [a.optimizer])]
        split = _split_round_trip(a, before)  # the Ray actor's two parts: weights, then training state
        off = HostOffload([a.model], [a.optimizer])
        tracked = off.tracked_bytes()
        moved = off.offload()
        resident = off.resident_bytes()
        param_bytes = sum(p.untyped_storage().nbytes() for p in a.model.parameters())
        opt_bytes = sum(t.untyped_storage().nbytes() for w, t in tensors_of([], [a.optimizer]))
        off.onload()
        after = list(tensors_of([a.model], [a.optimizer]))
        same = len(after) == len(before) and all(w == v and torch.equal(t, u)
                                                 for (w, t), (v, u) in zip(before, after))
        a.train_step(dp_slice(full, a), spec)
        b = MegatronActor(cfg, lay.actor_config(), hf_weights=hf_sd)
        for _ in range(2):
            b.train_step(dp_slice(full, b), spec)
        wa, wb = dict(a.export_hf_weights()), dict(b.export_hf_weights())
        rec[name] = {"tracked_bytes": tracked, "moved_bytes": moved, "resident_after_offload": resident,
                     "param_bytes_after_offload": param_bytes, "optimizer_bytes_after_offload": opt_bytes,
                     "tensors": len(before), "bit_exact": same,
                     "optimizer_state": sum(w.endswith(".state") for w, _ in before),
                     "main_shards": sum("shard_fp32" in w for w, _ in before),
                     "main_grads": sum(w.endswith(".main_grad") for w, _ in before),
                     "ddp_buffers": sum(".ddp_buffer" in w for w, _ in before),
                     "step2_equal": wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa),
                     "split": split}
        del a, b
    return {"offload": rec}
