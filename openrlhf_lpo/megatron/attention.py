"""Core attention for packed (THD) sequences in megatron-core's local layer spec.

megatron-core 0.16.1's local ``DotProductAttention`` refuses ``PackedSeqParams``
(``dot_product_attention.py:153``) and materialises ``[b, heads, S, S]`` scores; only the
Transformer Engine attention takes packed sequences, and TE needs an accelerator. This subclass
runs the same GPTModel / ``Attention`` / RoPE-THD code and, for ``qkv_format == "thd"``, computes
each sequence's causal attention with ``torch.nn.functional.scaled_dot_product_attention``
(``is_causal=True``, no mask tensor): a fused kernel (flash on CPU and accelerators) that never
holds an ``S x S`` score matrix. It is used whenever the TE spec is not (CPU tests, the CPU mode,
accelerators without TE). Grouped-query heads follow megatron's layout (the query heads of KV
group ``g`` are consecutive), as in the local attention.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from openrlhf_lpo.megatron.patch_points import BOUNDS_ATTR


def attach_bounds(packed_seq_params, bounds: Sequence[int]) -> None:
    """Remember the host copy of the padded cumulative lengths on megatron's ``PackedSeqParams`` (patch point
    ``megatron-packed-seq-bounds``): :func:`segment_bounds` then reads no device tensor."""
    setattr(packed_seq_params, BOUNDS_ATTR, [int(b) for b in bounds])


def segment_bounds(packed_seq_params) -> List[int]:
    """Python list of the padded cumulative lengths (one host read per forward, cached)."""
    cached = getattr(packed_seq_params, BOUNDS_ATTR, None)
    if cached is not None:
        return cached
    p = packed_seq_params
    cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
    bounds = [int(x) for x in cu.tolist()]
    try:
        setattr(packed_seq_params, BOUNDS_ATTR, bounds)
    except AttributeError:  # a frozen/slotted params object: recompute next time
        pass
    return bounds


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also accepts ``PackedSeqParams(qkv_format="thd")``."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        p = packed_seq_params
        if p is None or p.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported with packed sequences")
        # query [t, heads, dim]; key/value [t, groups, dim] (this TP rank's share)
        heads, groups = query.shape[1], key.shape[1]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale = scale * self.layer_number  # the local path multiplies scores back by it
        dropout = self.attention_dropout.p if self.training else 0.0
        bounds = segment_bounds(p)
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e <= s:
                continue
            q, k, v = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
            outs.append(o[0].transpose(0, 1))
        out = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
        return out.reshape(out.shape[0], -1)  # [t, heads*dim]; Attention reshapes to [t, 1, h]
