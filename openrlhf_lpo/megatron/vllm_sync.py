"""Weights from the Megatron policy actor to the rollout engines (a mixin of ``MegatronPolicyActor``).

``broadcast_to_vllm``: the HF-named stream of :func:`convert.export_hf_weights` in the engines' dtype
(OpenRLHF 0.11.2 builds its vLLM engines in bfloat16 and asserts the dtype of every tensor it receives),
over OpenRLHF's model-update group (NCCL, or Ray collectives with ``--vllm.sync_with_ray``), then the
engines' prefix caches are reset as upstream does. Engines that take state dicts (the CPU rollout engines)
get one dict through Ray and a parity check. Colocated (``--train.colocate_all``, not async): the same
export on every rank of every replica, handed over by IPC, node by node. Both routes send flat buckets of
``--megatron.sync_bucket_mb`` with sequence numbers the engines apply in order (:mod:`.weight_sync`).
"""

from __future__ import annotations

import torch

from openrlhf_lpo.megatron import weight_sync
from openrlhf_lpo.megatron.pipeline_plan import _get

# OpenRLHF 0.11.2's create_vllm_engines builds every engine with dtype="bfloat16" and its worker
# asserts that each synced tensor has that dtype (tests/megatron check this contract upstream)
VLLM_ENGINE_DTYPE = torch.bfloat16

SYNC_IN_FLIGHT = weight_sync.IN_FLIGHT  # buckets with the engines before the sender waits for the oldest


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

    def _weight_sender(self) -> "weight_sync.WeightSender":
        """This process's sender: its sequence numbers run on over the whole run."""
        sender = self.__dict__.get("_sync_sender")
        if sender is None:
            sender = self.__dict__["_sync_sender"] = weight_sync.WeightSender()
        return sender

    def _stream_to_vllm(self, rank: int) -> None:
        """Bucket by bucket, in the engines' dtype, over OpenRLHF's model-update group: each tensor reaches rank 0
        once (``export_hf_weights(dst=0)``); rank 0 announces each bucket to every engine with its sequence number
        and broadcasts its buffer, up to ``SYNC_IN_FLIGHT`` buckets ahead of the engines' loads."""
        import ray

        args = self.args
        engines = self.vllm_engines or []
        if bool(getattr(args.vllm, "sync_with_ray", False)):
            import ray.util.collective as collective

            def broadcast(buffer):
                collective.broadcast(buffer, 0, group_name=self._model_update_group)
        else:
            def broadcast(buffer):
                self._model_update_group.broadcast(buffer, src=0)

        info = self._weight_sender().stream(self.actor.export_hf_weights(VLLM_ENGINE_DTYPE, dst=0),
                                            engines if rank == 0 else [], broadcast,
                                            weight_sync.bucket_bytes_of(args))
        self.last_sync = {"route": "broadcast", **info}
        if rank == 0 and engines and getattr(args.vllm, "enable_prefix_caching", False):
            # cached KV blocks were computed with the old weights
            ray.get([e.reset_prefix_cache.remote() for e in engines])

    def _ipc_to_vllm(self) -> None:
        """Colocated engines: every rank of every replica receives each full HF tensor
        (``export_hf_weights(dst=None)``, the broadcast route's resharding and naming) and, bucket by bucket, its
        node's leader hands the node's engines the handles of the node's ranks
        (:meth:`.weight_sync.WeightSender.send_ipc`); vLLM's ``load_weights`` cuts its own TP shard out of each full
        tensor. vLLM engines get bf16 (their worker asserts it); the CPU engines the actor's dtype and a parity
        check, as their state-dict sync."""
        import torch.distributed as dist

        cpu_engines = self._engines_take_state_dicts()
        transport = weight_sync.transport_for(self.actor.device)
        route = self.__dict__.get("_sync_route")
        if route is None:  # collective: every rank builds every node's group once
            route = self.__dict__["_sync_route"] = weight_sync.node_route()
        info = self._weight_sender().send_ipc(
            self.actor.export_hf_weights(None if cpu_engines else VLLM_ENGINE_DTYPE), self.vllm_engines, transport,
            route, weight_sync.bucket_bytes_of(self.args),
            reset_prefix_cache=bool(getattr(self.args.vllm, "enable_prefix_caching", False)))
        self.last_sync = {"route": "ipc", "transport": transport.name, **info}
        if cpu_engines:
            self._check_engine_parity(info["tensors"] if dist.get_rank() == 0 else 0, route="ipc",
                                      transport=transport.name, device_ids=info["device_ids"],
                                      buckets=info["buckets"], calls=info["calls"], seq=info["seq"],
                                      node_engines=info["engines"])

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
