"""Weights from the Megatron policy actor to the rollout engines (a mixin of ``MegatronPolicyActor``).

``broadcast_to_vllm``: the HF-named stream of :func:`convert.export_hf_weights` in the engines' dtype
(OpenRLHF 0.11.2 builds its vLLM engines in bfloat16 and asserts the dtype of every tensor it receives),
over OpenRLHF's model-update group (NCCL, or Ray collectives with ``--vllm.sync_with_ray``), then the
engines' prefix caches are reset as upstream does. Engines that take state dicts (the CPU rollout engines)
get one dict through Ray and a parity check. Colocated (``--train.colocate_all``, not async): the same
export on every rank of every replica, handed over by IPC (:mod:`.weight_sync`).
"""

from __future__ import annotations

import torch

from openrlhf_lpo.megatron.pipeline_plan import _get

# OpenRLHF 0.11.2's create_vllm_engines builds every engine with dtype="bfloat16" and its worker
# asserts that each synced tensor has that dtype (tests/megatron check this contract upstream)
VLLM_ENGINE_DTYPE = torch.bfloat16

SYNC_IN_FLIGHT = 3  # weight-sync broadcasts rank 0 issues before waiting for the oldest


def colocated(args) -> bool:
    """``--train.colocate_all`` without ``--train.async_enable``: the rollout engines share the actor's GPUs and
    take the weights by IPC (as OpenRLHF's hybrid engine; async runs colocate the trained models only)."""
    return bool(_get(args, "train.colocate_all", False)) and not bool(_get(args, "train.async_enable", False))


class VLLMSyncMixin:
    """``broadcast_to_vllm`` and its routes; needs ``self.actor``, ``self.args``, ``self.vllm_engines``,
    ``self.tokenizer``, ``self._model_update_group`` and the sleep mixin's ``_awake``."""

    def _engines_take_state_dicts(self) -> bool:
        return bool(self.vllm_engines) and all(hasattr(e, "update_weights") for e in self.vllm_engines)

    def broadcast_to_vllm(self):
        """Stream the HF-named weights (TP gather, PP broadcast, un-fused) to the rollout engines."""
        with self._awake(state=False):  # asleep: the weights alone, offloaded again after (generation follows)
            self._broadcast_to_vllm()

    def _broadcast_to_vllm(self):
        import ray
        import torch.distributed as dist

        rank = dist.get_rank()
        first_replica = self.actor.ps.get_data_parallel_rank() == 0  # the export is collective per replica
        if colocated(self.args) and self.vllm_engines:
            self._ipc_to_vllm()
        elif self._engines_take_state_dicts():  # CPU rollout engines: one state dict via Ray, actor dtype
            state = {}
            if first_replica:  # the stream reaches rank 0 only (each tensor sent once per stage)
                for name, t in self.actor.export_hf_weights(dst=0):
                    state[name] = t.detach().cpu().clone()
            if rank == 0:
                ref = ray.put(state)
                ray.get([e.update_weights.remote(ref) for e in self.vllm_engines])
            self._check_engine_parity(len(state) if rank == 0 else 0)
        elif first_replica:
            self._stream_to_vllm(rank)
        dist.barrier()

    def _stream_to_vllm(self, rank: int) -> None:
        """Tensor by tensor, in the engines' dtype, over OpenRLHF's model-update group: each tensor reaches rank 0
        once (``export_hf_weights(dst=0)``), and up to ``SYNC_IN_FLIGHT`` broadcasts are in flight before rank 0
        waits for the engines' oldest ``update_weight``."""
        from collections import deque

        import ray

        args = self.args
        use_ray = bool(getattr(args.vllm, "sync_with_ray", False))
        engines = self.vllm_engines or []
        in_flight: deque = deque()  # (refs, tensor): a tensor stays alive until its engines took it
        for name, t in self.actor.export_hf_weights(VLLM_ENGINE_DTYPE, dst=0):
            if not engines:
                continue
            t = t.contiguous()
            refs = [e.update_weight.remote(name, dtype=t.dtype, shape=t.shape, empty_cache=False) for e in engines]
            if use_ray:
                import ray.util.collective as collective

                collective.broadcast(t, 0, group_name=self._model_update_group)
            else:
                self._model_update_group.broadcast(t, src=0)
            in_flight.append((refs, t))
            if len(in_flight) > SYNC_IN_FLIGHT:
                ray.get(in_flight.popleft()[0])
        while in_flight:
            ray.get(in_flight.popleft()[0])
        if rank == 0 and engines and getattr(args.vllm, "enable_prefix_caching", False):
            # cached KV blocks were computed with the old weights
            ray.get([e.reset_prefix_cache.remote() for e in engines])

    def _ipc_to_vllm(self) -> None:
        """Colocated engines: every rank of every replica receives each full HF tensor
        (``export_hf_weights(dst=None)``, the NCCL stream's resharding and naming) and hands its engine worker an
        IPC handle of it (:func:`.weight_sync.send_weights`); vLLM's ``load_weights`` cuts its own TP shard out of
        the full tensor. vLLM engines get bf16 (their worker asserts it); the CPU engines the actor's dtype and a
        parity check, as their state-dict sync."""
        import torch.distributed as dist

        from openrlhf_lpo.megatron import weight_sync

        cpu_engines = self._engines_take_state_dicts()
        transport = weight_sync.transport_for(self.actor.device)
        info = weight_sync.send_weights(
            self.actor.export_hf_weights(None if cpu_engines else VLLM_ENGINE_DTYPE), self.vllm_engines, transport,
            in_flight=SYNC_IN_FLIGHT, reset_prefix_cache=bool(getattr(self.args.vllm, "enable_prefix_caching", False)))
        self.last_sync = {"route": "ipc", "transport": transport.name, **info}
        if cpu_engines:
            self._check_engine_parity(info["tensors"] if dist.get_rank() == 0 else 0, route="ipc",
                                      transport=transport.name, device_ids=info["device_ids"])

    def _check_engine_parity(self, num_tensors: int, **record) -> None:
        """After a state-dict sync: engines' log-probs of a fixed probe sequence must equal the
        actor's (max |diff| <= LPO_CPU_PARITY_TOL, default 1e-4); appended to LPO_CPU_PARITY_LOG."""
        import torch.distributed as dist

        from openrlhf_lpo.runtime.parity import check_engine_parity, probe_sequence

        ids = probe_sequence(self.tokenizer)
        seq = torch.tensor([ids], dtype=torch.long)
        batch = {"sequences": seq, "attention_mask": torch.ones_like(seq),
                 "action_mask": torch.ones((1, len(ids) - 1), dtype=torch.bool)}
        actor_lp = self.actor.log_probs(batch)[0].double().cpu()  # collective
        if dist.get_rank() != 0:
            return
        check_engine_parity(self.vllm_engines, ids, actor_lp, float(self.actor.cfg.temperature),
                            backend="megatron", num_tensors=num_tensors, **record)
