"""Rotary embeddings of packed (THD) micro-batches without host syncs, for megatron's local layer spec.

Without Transformer Engine, megatron-core 0.16.1's ``Attention`` rotates q and k with
``rope_utils._apply_rotary_pos_emb_thd``, which reads ``cu_seqlens`` on the host for every call: the lengths'
``.tolist()``, the ``freqs.size(0) == cu_seqlens[-1]`` test and, when it holds (one sequence per micro-batch,
every recipe), one ``.item()`` per sequence: 6 drains of the device per layer per micro-batch (12 with
recompute). The actor already holds each micro-batch's bounds on the host (``PackedMicroBatch`` builds
them), so it hangs them on the ``cu_seqlens`` tensor it hands megatron (``attach_bounds``), and
:func:`apply_rotary_pos_emb` builds the same per-token frequencies from them: sequence i of length n_i takes
``freqs[0:n_i]`` (positions restart at 0 in every sequence, which is what megatron computes in both of its
cases for our packing: one sequence spans the whole row, or ``max_seqlen < T``), then the same
``_apply_rotary_pos_emb_bshd``. The result is the same tensor, bit for bit; only the host reads are gone.
Calls it does not cover (fused RoPE, no bounds, context parallelism, MLA) go to megatron's own function.

:func:`install` puts it in place of ``megatron.core.transformer.attention.apply_rotary_pos_emb`` (the name
``Attention.forward`` calls); the actor installs it when it builds the local spec. Both are patch points with a
contract (megatron/patch_points.py): ``megatron-rope`` (the swap) and ``megatron-cu-seqlens-bounds`` (the bounds
on the tensor); ``install`` checks the first before it swaps.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from openrlhf_lpo.megatron.patch_points import BOUNDS_ATTR

_ORIGINAL = None


def attach_bounds(cu_seqlens: torch.Tensor, bounds: Sequence[int]) -> None:
    """Remember the host copy of ``cu_seqlens`` (``[0, n_0, n_0 + n_1, ...]``) on the tensor itself."""
    setattr(cu_seqlens, BOUNDS_ATTR, [int(b) for b in bounds])  # patch point megatron-cu-seqlens-bounds


def host_bounds(cu_seqlens: Optional[torch.Tensor]) -> Optional[List[int]]:
    return getattr(cu_seqlens, BOUNDS_ATTR, None) if cu_seqlens is not None else None


def packed_freqs(freqs: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """Per-token frequencies of a packed row: ``freqs[0:n_i]`` for each sequence, concatenated."""
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    parts = [freqs[:n] for n in lengths if n > 0]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """megatron's ``apply_rotary_pos_emb`` for a THD ``t`` [T, heads, dim] whose ``cu_seqlens`` carries host bounds."""
    from megatron.core.models.common.embeddings import rope_utils

    bounds = host_bounds(cu_seqlens)
    simple = (bounds is not None and not config.apply_rope_fusion and not config.multi_latent_attention
              and (cp_group is None or cp_group.size() == 1) and bounds[-1] == t.shape[0])
    if not simple:
        return _ORIGINAL(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed_freqs(freqs, bounds),
                                                 rotary_interleaved=config.rotary_interleaved,
                                                 multi_latent_attention=False, mscale=mscale).squeeze(1)


def install() -> None:
    """Put :func:`apply_rotary_pos_emb` where megatron's ``Attention.forward`` looks it up (idempotent), after the
    contract of patch point ``megatron-rope`` (RuntimeError naming the point if megatron-core changed)."""
    global _ORIGINAL
    from megatron.core.transformer import attention

    from openrlhf_lpo import upstream

    if attention.apply_rotary_pos_emb is apply_rotary_pos_emb:
        return
    upstream.check_point(upstream.registered("megatron-rope"))
    _ORIGINAL = attention.apply_rotary_pos_emb
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
