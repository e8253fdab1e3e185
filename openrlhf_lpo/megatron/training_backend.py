"""The Megatron backend's entry in the training-backend table (``--backend megatron``): the policy trains on
megatron-core (:mod:`openrlhf_lpo.megatron.ray_actor`), the reference model stays on DeepSpeed
(:mod:`openrlhf_lpo.core.training_backends`).

Imports nothing but the table: a lookup of ``megatron`` in any process imports this module.
"""

from __future__ import annotations

from openrlhf_lpo.core.training_backends import TrainingBackend, register_training_backend

__all__ = ["MEGATRON"]

MEGATRON = register_training_backend(TrainingBackend(
    name="megatron",
    model_parallel=lambda args: (int(args.megatron.tp), int(args.megatron.pp)),  # megatron order tp-cp-ep-pp-dp
    layout_note=lambda args, dp: f"TP {args.megatron.tp} x PP {args.megatron.pp} x DP {dp}",
    checkpoint_holds_weights=lambda args: False,  # fp32 parameters and Adam moments only (megatron/checkpoint.py)
    saves_before_pruning=True,  # a checkpoint is written whole before the oldest is pruned
    deepspeed_optimizer=False,  # megatron-core's optimizer (torch AdamW, or TE's / apex's, which ship compiled)
    safetensors_only=True,  # megatron/convert.py reads model.safetensors(.index.json)
    reads_model_config=True,  # megatron/flags.py validates the layout against the HF config
    offload_on_cpu=True,  # its sleep is plain torch copies to host memory (megatron/sleep.py)
))
