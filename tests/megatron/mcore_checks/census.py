"""What the whole run did to torch.distributed, taken after the other layout checks.

From the rank's start (the runner installs :class:`_CollectiveRecorder` before the first check) every
tensor handed to a collective sits on its group's device (megatron's own, the actor's stats, the
``--lpo.end_kl`` metrics, checkpoint gathers); the process groups of old layouts were released (only the
current layout's and a few others are live).
"""

import os

import torch
import torch.distributed as dist

from . import world as W
from .registry import check

RECORDER = None


def install() -> None:
    """Wrap torch.distributed's collectives for the rest of the run (the runner calls it once, first)."""
    global RECORDER
    RECORDER = _CollectiveRecorder()


@check("census")
def census():
    return {"collectives": {"calls": RECORDER.calls, "mismatches": RECORDER.mismatches[:10]},
            "groups": process_group_census()}


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
    live = [g for g in dist.distributed_c10d._world.pg_map if g is not W.BARRIER_GROUP]  # not the runner's
    return {"live": len(live), "held": len(parallel_state_groups(ps)), "gloo_loop_threads": threads}

