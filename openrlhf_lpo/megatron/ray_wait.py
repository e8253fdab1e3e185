"""Wait on every rank of a Megatron model replica, failing at the first error (cluster review F8).

OpenRLHF's experience maker and trainer ``ray.get`` the refs a ``RayActorGroup`` returns. The Megatron
group returns one result per replica (its first rank's), so on its own a failure of another TP/PP rank
would never be awaited: the first rank blocks in a collective and the run hangs until the NCCL timeout
(``--megatron.timeout_minutes``, 60 by default). :func:`await_all_refs` gives refs that resolve only when
every rank has finished and fail as soon as any rank fails. A tiny Ray task does the waiting, so the
caller keeps its asynchrony (the actor's and the reference model's forwards still overlap). This module
imports nothing heavy: the waiting task starts in a plain Ray worker in milliseconds.

Public names: await_all_refs(refs, picked) -> list of refs (one per index in ``picked``)
"""

from __future__ import annotations

__all__ = ["await_all_refs"]


def _await_all(refs, picked):
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # re-raises that rank's exception at once
    out = ray.get([refs[i] for i in picked])
    return out[0] if len(picked) == 1 else tuple(out)


_REMOTE = None


def await_all_refs(refs, picked):
    """One ref per index in ``picked`` (the results of ``refs[i]``), resolved when *every* ref in
    ``refs`` is; if any of them fails, all returned refs fail with its error at once."""
    import ray

    global _REMOTE
    if _REMOTE is None:
        _REMOTE = ray.remote(num_cpus=0, max_retries=0)(_await_all)
    picked = list(picked)
    out = _REMOTE.options(num_returns=len(picked)).remote(list(refs), picked)
    return [out] if len(picked) == 1 else list(out)
