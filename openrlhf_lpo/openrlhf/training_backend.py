"""The DeepSpeed backend's entry in the training-backend table (``--backend deepspeed``, the default): OpenRLHF's
own ``PolicyModelActor`` on DeepSpeed, extended by this package (:mod:`openrlhf_lpo.core.training_backends`).

Imports nothing but the table: a lookup of ``deepspeed`` in any process imports this module.
"""

from __future__ import annotations

from openrlhf_lpo.core.training_backends import TrainingBackend, register_training_backend

__all__ = ["DEEPSPEED"]


def _model_parallel(args):
    # one replica spans the ring-attention group x DeepSpeed's tensor-parallel group (OpenRLHF's duplicate_actors)
    return max(int(args.ds.ring_attn_size), 1) * max(int(args.ds.tensor_parallel_size), 1), 1


DEEPSPEED = register_training_backend(TrainingBackend(
    name="deepspeed",
    model_parallel=_model_parallel,
    layout_note=lambda args, dp: f"dp {dp}",
    # mp_rank_00_model_states.pt holds the module beside the ZeRO-partitioned optimizer state, except under ZeRO-3
    checkpoint_holds_weights=lambda args: int(args.ds.zero_stage) < 3,
    saves_before_pruning=False,  # OpenRLHF deletes the oldest DeepSpeed checkpoint before it writes the next
    deepspeed_optimizer=True,
    safetensors_only=False,
    reads_model_config=False,
    offload_on_cpu=False,  # DeepSpeed's sleep offloads accelerator memory: off in the CPU mode
))
