"""The engine side of the ordered, bucketed weight sync (issue 43, item 5; the sender:
:mod:`openrlhf_lpo.megatron.weight_sync`).

**Order.** The sender keeps a few update calls in flight; the rollout engines are asyncio Ray actors, for which
Ray guarantees no execution order ("Asynchronous or threaded actors do not guarantee the task execution order",
Ray's docs, actor task execution order). On the broadcast route two engines that ran bucket i and i+1 in
different orders would post broadcasts of different sizes (a hang, or wrong weights). Every update call therefore
carries a sequence number, one counter per sender for the whole run, and :class:`UpdateOrder` runs the calls of
an engine strictly in that order: a call that arrives early waits for its predecessors (``wait_s`` at most, then
it fails naming the missing number), a number that was already applied (a second sender, a repeated call) is
refused, and after a failed update every later one fails too (an engine never loads half a sync silently).

**Buckets.** :class:`BucketUpdates` is the engine API both routes call, one call per bucket
(:mod:`openrlhf_lpo.engines.buckets`): ``update_weight_bucket(seq, metas, empty_cache)`` (the broadcast route:
the buffer arrives over the model-update group) and ``update_weight_bucket_ipc(seq, metas, ipc_handles,
empty_cache)`` (colocated: the handle of this engine's device), plus ``weight_sync_device_ids()``, the keys its
workers look their handles up by (the sender picks its node's engines with them). The engine classes say how a
bucket is received and loaded: the CPU rollout engine (:mod:`.cpu_engine`) and vLLM's actor with the worker
extension of :mod:`.vllm_worker` (``openrlhf/seeded_vllm.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Optional

__all__ = ["UpdateOrder", "BucketUpdates", "WAIT_S"]

WAIT_S = 600.0  # how long an update that arrived early waits for its predecessors


class UpdateOrder:
    """Runs an engine's weight updates strictly in sequence-number order (see the module docstring)."""

    def __init__(self, wait_s: float = WAIT_S):
        self.wait_s = float(wait_s)
        self.next_seq = 0
        self.applied = 0  # updates run so far
        self.failed: Optional[str] = None
        self.out_of_order = 0  # calls that arrived before a predecessor (and waited for it)
        self._cond: Optional[asyncio.Condition] = None

    @contextlib.asynccontextmanager
    async def turn(self, seq: int, what: str = "weight update"):
        """``async with order.turn(seq):`` the body runs once every update before ``seq`` has run."""
        seq = int(seq)
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            if seq < self.next_seq:
                raise ValueError(f"{what} #{seq} arrived after #{self.next_seq - 1} was applied: each engine takes "
                                 "one sender's numbers once, in order (a second sender or a repeated call)")
            if seq > self.next_seq:
                self.out_of_order += 1
                try:
                    await asyncio.wait_for(self._cond.wait_for(lambda: self.next_seq >= seq), self.wait_s)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"{what} #{seq} waited {self.wait_s:g} s for #{self.next_seq}, which never "
                                       "arrived: the sender's calls were lost or numbered with a gap") from None
            if self.failed:  # its successors fail at once too
                self.next_seq = seq + 1
                self._cond.notify_all()
                raise RuntimeError(f"{what} #{seq} not applied: an earlier update failed ({self.failed})")
        try:
            yield
        except BaseException as e:
            self.failed = f"#{seq}: {type(e).__name__}: {e}"[:300]
            raise
        finally:
            async with self._cond:
                self.next_seq = seq + 1
                self.applied += 1
                self._cond.notify_all()


class BucketUpdates:
    """Engine methods of the bucketed weight sync, in sequence order (see the module docstring). Subclasses
    implement ``_receive_bucket(metas, empty_cache)`` (broadcast route), ``_receive_bucket_ipc(metas,
    ipc_handles, empty_cache)`` (IPC route) and ``_device_ids()``; each returns what the call returns."""

    def _update_order(self) -> UpdateOrder:
        order = self.__dict__.get("_weight_update_order")
        if order is None:
            order = self.__dict__["_weight_update_order"] = UpdateOrder()
        return order

    async def update_weight_bucket(self, seq, metas, empty_cache=False):
        """One bucket over the model-update group (``metas``: ``(name, dtype, shape, offset)`` tuples)."""
        async with self._update_order().turn(seq, "update_weight_bucket"):
            return await self._maybe_await(self._receive_bucket(metas, empty_cache))

    async def update_weight_bucket_ipc(self, seq, metas, ipc_handles=None, empty_cache=False):
        """One bucket by IPC: ``ipc_handles`` maps each device id of the sender's node to its handle."""
        async with self._update_order().turn(seq, "update_weight_bucket_ipc"):
            return await self._maybe_await(self._receive_bucket_ipc(metas, ipc_handles, empty_cache))

    async def weight_sync_device_ids(self):
        """The device ids this engine's workers look their IPC handles up by."""
        return list(await self._maybe_await(self._device_ids()))

    def weight_update_stats(self) -> dict:
        order = self._update_order()
        return {"applied": order.applied, "next_seq": order.next_seq, "out_of_order": order.out_of_order}

    @staticmethod
    async def _maybe_await(value):
        return await value if asyncio.iscoroutine(value) else value

    def _receive_bucket(self, metas, empty_cache):
        raise NotImplementedError(f"{type(self).__name__} takes no weights over a model-update group")

    def _receive_bucket_ipc(self, metas, ipc_handles, empty_cache):
        raise NotImplementedError(f"{type(self).__name__} takes no weights by IPC")

    def _device_ids(self):
        raise NotImplementedError
