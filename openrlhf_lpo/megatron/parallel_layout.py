"""Validation of a Megatron parallel layout (TP x PP x DP) against the world size and the model.

Every inconsistency raises ``ValueError`` naming the flag and the numbers, so a user sees e.g.
``--megatron.tp 3 does not divide num_key_value_heads=8`` before any process group is created.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """A validated layout: ``world_size = tp * pp * dp``."""

    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int = 1


def _get(cfg, name, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def validate_layout(world_size: int, tp: int, pp: int, hf_config=None, vpp: int = 1) -> ParallelLayout:
    """Check that ``world_size``, ``--megatron.tp``, ``--megatron.pp`` (and ``--megatron.vpp``)
    fit together and fit the model in ``hf_config`` (an HF config object or dict).

    Rules: tp, pp, vpp >= 1; ``world_size % (tp*pp) == 0``; num_key_value_heads % tp == 0
    (the fused QKV is sharded by whole KV groups); num_attention_heads % tp == 0;
    intermediate_size % tp == 0; vocab_size % tp == 0 (vocab-parallel embedding and output layer,
    no padding); num_hidden_layers % (pp*vpp) == 0 (uniform stages).
    """
    for flag, v in (("--megatron.tp", tp), ("--megatron.pp", pp), ("--megatron.vpp", vpp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} (actor nodes x GPUs per node) is not divisible by "
            f"--megatron.tp {tp} x --megatron.pp {pp} = {tp * pp}; choose tp*pp dividing {world_size}"
        )
    if vpp > 1 and pp == 1:
        raise ValueError(f"--megatron.vpp {vpp} needs --megatron.pp > 1 (got pp=1)")
    if hf_config is not None:
        heads = _get(hf_config, "num_attention_heads")
        kv = _get(hf_config, "num_key_value_heads", heads) or heads
        layers = _get(hf_config, "num_hidden_layers")
        inter = _get(hf_config, "intermediate_size")
        vocab = _get(hf_config, "vocab_size")
        if kv % tp != 0:
            raise ValueError(
                f"--megatron.tp {tp} does not divide num_key_value_heads={kv}; "
                f"use a tp that divides {kv}"
            )
        if heads % tp != 0:
            raise ValueError(f"--megatron.tp {tp} does not divide num_attention_heads={heads}")
        if inter % tp != 0:
            raise ValueError(f"--megatron.tp {tp} does not divide intermediate_size={inter}")
        if vocab % tp != 0:
            raise ValueError(
                f"--megatron.tp {tp} does not divide vocab_size={vocab} (vocab padding is not supported)"
            )
        if layers % (pp * vpp) != 0:
            raise ValueError(
                f"num_hidden_layers={layers} is not divisible by --megatron.pp {pp} x --megatron.vpp {vpp}"
                f" = {pp * vpp}; stages must hold equal numbers of layers"
            )
    return ParallelLayout(world_size=world_size, tp=tp, pp=pp, dp=world_size // (tp * pp), vpp=vpp)
