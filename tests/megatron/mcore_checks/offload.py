"""Offloading the Megatron actor between phases (openrlhf_lpo/megatron/offload.py, sleep.py, actor_checkpoints.py):
at TP2 and at PP2, both with the distributed optimizer and bf16 parameters, after a training step (Adam state, main
fp32 shards and gradient buffers exist):

* the Ray actor's sleep (``SleepMixin``, driven on the actor as the Ray actor drives it): weights and optimizer
  state copied to one host pool, the gradient buffers dropped and zeroed on wake; three sleep/wake cycles and a
  weights-only wake leave the pool the same size, equal to its regions' bytes rounded up as planned; the copied
  bytes against the plan's formula (``host_memory.actor_pool_bytes``: parameters per rank, DDP padding and step
  counters counted);
* the checkpoint saved asleep (``CheckpointMixin.save_checkpoint``) reads the optimizer state from host memory: no
  tracked byte comes back to the device during the save, and its files equal the files of a save made awake;
* every tracked byte of a full offload comes back bit for bit, nothing stays resident in between;
* the next step, after the sleeps (gradients zeroed, not restored) and the round trip, equals the step of an actor
  that never offloaded, bit for bit.
"""

import dataclasses
import os

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron.actor import MegatronActor
from openrlhf_lpo.megatron.losses import LossSpec
from openrlhf_lpo.megatron.memory import Shape, rank_parameters
from openrlhf_lpo.megatron.offload import HostOffload, tensors_of
from openrlhf_lpo.checks.sleeping_actor import SleepingActor

from . import world as W
from .layouts import Layout
from .references import K, dp_slice, reference_inputs
from .registry import check


def _sleep_cycles(a, cfg, name):
    """Sleep / wake as the Ray actor does, with checkpoints awake and asleep (module docstring)."""
    import torch.distributed as dist

    s = SleepingActor(a, cfg, os.path.join(W.OUT, f"offload_{name}_awake"))
    ps = a.ps
    grads = sum(buf.grad_data.untyped_storage().nbytes() for buf in a.model.buffers)
    param_buffers = sum(buf.param_data.untyped_storage().nbytes() for buf in a.model.buffers)
    steps = sum(v.untyped_storage().nbytes() for o in getattr(a.optimizer, "chained_optimizers", [a.optimizer])
                for st in o.optimizer.state.values() for k, v in st.items() if k == "step" and torch.is_tensor(v))
    stage = ps.get_pipeline_model_parallel_rank()
    out = {"stage": stage, "rank_params": sum(p.numel() for p in a.model.parameters()),
           "plan_rank_params": rank_parameters(Shape.of(cfg), ps.get_tensor_model_parallel_world_size(),
                                               ps.get_pipeline_model_parallel_world_size(), stage),
           "grad_buffer_bytes": grads, "param_buffer_bytes": param_buffers, "step_bytes": steps,
           "dp_rank": ps.get_data_parallel_rank(), "dp": ps.get_data_parallel_world_size(),
           "tp_rank": ps.get_tensor_model_parallel_rank()}
    s.save_checkpoint("global_step1")  # awake: every read is the live tensor
    s.offload_states()
    out["first_sleep"] = dict(s.sleep_log[-1])
    s.args.ckpt.path = os.path.join(W.OUT, f"offload_{name}_asleep")
    s.save_checkpoint("global_step1")  # asleep: from host memory
    out["saves"] = [dict(e) for e in s.save_log]
    out["asleep_after_save"] = s.resident_state_bytes()
    dist.barrier()
    asleep = s.checkpoint_files()
    s.args.ckpt.path = os.path.join(W.OUT, f"offload_{name}_awake")
    awake = s.checkpoint_files()
    out["save_files_equal"] = awake.keys() == asleep.keys() and all(torch.equal(awake[k], asleep[k]) for k in awake)
    out["save_tensors"] = len(awake)
    pools, zeroed = [], []
    for i in range(3):  # the trainer's reload before fit and offload after it
        s.reload_states()
        zeroed.append(all(not bool(buf.grad_data.any()) for buf in a.model.buffers))
        s.offload_states()
        pools.append(s._host_pool.nbytes())
    s._onload(state=False)  # what the old-log-prob forward and the weight sync bring back
    out["weights_only"] = {"param_bytes": sum(p.untyped_storage().nbytes() for p in a.model.parameters()),
                           "state_resident": s._state_off.resident_bytes()}
    s.offload_states()
    pools.append(s._host_pool.nbytes())
    out["pool_bytes"] = pools
    out["grads_zeroed_on_wake"] = zeroed
    out["sleeps"] = [dict(e) for e in s.sleep_log]
    out["regions"] = [n for _, n in sorted(s._host_pool._regions.values())]
    out["slabs"] = s._host_pool.slab_sizes()
    s.reload_states()
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
        actor_cfg = dataclasses.replace(lay.actor_config(), params_dtype="bf16")
        a = MegatronActor(cfg, actor_cfg, hf_weights=hf_sd)
        a.train_step(dp_slice(full, a), spec)
        before = [(w, t.clone()) for w, t in tensors_of([a.model], [a.optimizer])]
        sleeps = _sleep_cycles(a, cfg, name)  # the Ray actor's sleep: gradients come back zeroed
        before = [(w, torch.zeros_like(t) if w.endswith((".grad", ".main_grad", ".grad_data")) else t)
                  for w, t in before]
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
        b = MegatronActor(cfg, actor_cfg, hf_weights=hf_sd)
        for _ in range(2):
            b.train_step(dp_slice(full, b), spec)
        wa, wb = dict(a.export_hf_weights()), dict(b.export_hf_weights())
        sa = [t for _, t in tensors_of([], [a.optimizer])]
        sb = [t for _, t in tensors_of([], [b.optimizer])]
        rec[name] = {"tracked_bytes": tracked, "moved_bytes": moved, "resident_after_offload": resident,
                     "param_bytes_after_offload": param_bytes, "optimizer_bytes_after_offload": opt_bytes,
                     "tensors": len(before), "bit_exact": same,
                     "optimizer_state": sum(w.endswith(".state") for w, _ in before),
                     "main_shards": sum("shard_fp32" in w for w, _ in before),
                     "main_grads": sum(w.endswith(".main_grad") for w, _ in before),
                     "ddp_buffers": sum(".ddp_buffer" in w for w, _ in before),
                     "step2_equal": wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa),
                     "step2_optimizer_equal": len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb)),
                     "sleep": sleeps}
        del a, b
    return {"offload": rec}
