"""Release megatron's process groups before its parallel state is initialised again.

``parallel_state.destroy_model_parallel`` only forgets its groups. Each gloo group keeps a TCP loop
thread, and those of forgotten groups keep polling: after a dozen layout changes in one process
(the gloo test world, a layout-changing resume) they took two thirds of the CPU. :func:`release`
shuts down every group megatron's parallel state holds (not WORLD, not groups made elsewhere),
lets megatron forget them and collects the old models that still reference them.
"""

from __future__ import annotations

import gc
from typing import Iterator

import torch.distributed as dist


def _groups_in(value) -> Iterator[dist.ProcessGroup]:
    if isinstance(value, dist.ProcessGroup):
        yield value
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _groups_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _groups_in(v)


def parallel_state_groups(ps) -> list[dist.ProcessGroup]:
    """The distinct live process groups held by the module globals of ``ps`` (megatron's parallel_state)."""
    world = dist.group.WORLD
    live = dist.distributed_c10d._world.pg_map  # torch's private registry (patch point megatron-process-groups)
    seen: dict[int, dist.ProcessGroup] = {}
    for name, value in vars(ps).items():
        if name.startswith("__"):
            continue
        for g in _groups_in(value):
            if g is not world and g in live:
                seen.setdefault(id(g), g)
    return list(seen.values())


def release(ps) -> int:
    """Shut down megatron's groups, then ``ps.destroy_model_parallel()``; returns how many were shut down."""
    groups = parallel_state_groups(ps)
    for g in groups:
        dist.destroy_process_group(g)
    ps.destroy_model_parallel()
    n = len(groups)
    del groups
    gc.collect()  # a group's loop thread ends with its last reference: old models in reference cycles hold them
    return n
