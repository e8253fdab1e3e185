"""Packed (THD) micro-batches for the Megatron actor: no padding between sequences, no S x S mask.

A micro-batch in OpenRLHF's layout (``sequences [B,S]``, ``attention_mask [B,S]`` whose ones are
one contiguous run per row -- 0.11.2 right-pads, our merge may also left-pad -- and
``action_mask [B,A]`` for the last ``A`` columns) becomes one row of ``T = sum_b L_b`` tokens
(``L_b`` = real tokens of row ``b``, rounded up to ``pad_multiple``) plus the cumulative lengths
``cu_seqlens = [0, L_0, L_0+L_1, ...]`` that megatron-core's ``PackedSeqParams(qkv_format="thd")``
carries to the attention kernel and to RoPE (positions restart at 0 in every sequence).

Token log-probs keep OpenRLHF's ``Actor.forward`` contract: action column ``a`` is the
log-probability of ``sequences[b, S-A+a]`` given the tokens before it, read from the logit at
packed position ``cu[b] + (S-A+a-1-first_b)`` (``first_b`` = first real column of row ``b``).
Columns whose token is padding, or that have no real token before them, give 0.

So a sequence's log-probs depend only on its own tokens: alone, left-padded by any amount, or
packed with others they are the same computation (tests/megatron checks 1e-5 in TP1/TP2/PP2).
Padding at a sequence's tail (``pad_multiple > 1``, e.g. for sequence parallelism) is seen only
by later positions of the same sequence under causal attention, and their logits are discarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch


@dataclass
class PackedMicroBatch:
    """One micro-batch in THD layout (all tensors on one device)."""

    tokens: torch.Tensor  # [1, T] token ids (0 at tail padding)
    position_ids: torch.Tensor  # [1, T] position inside the sequence
    cu_seqlens: torch.Tensor  # [n+1] int32 cumulative (padded) sequence lengths
    max_seqlen: int  # longest (padded) sequence, a Python int (RoPE table rows, kernel launch)
    action_index: torch.Tensor  # [B, A] packed position of the logit predicting action (b, a)
    action_valid: torch.Tensor  # [B, A] bool: the action column holds a real, predictable token
    action_tokens: torch.Tensor  # [B, A] token ids of the action columns
    seq_lens: List[int]  # real tokens per sequence

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def packed_seq_params(self):
        """megatron-core ``PackedSeqParams`` for this micro-batch (padded == real boundaries, so
        flash kernels stay eligible on TE and each sequence's tail padding is its own)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def real_token_spans(attention_mask: torch.Tensor):
    """(first column, length) of every row's real tokens; raises if a row's ones are not contiguous."""
    am = attention_mask.bool()
    B, S = am.shape
    lens = am.sum(1)
    first = torch.where(lens > 0, am.int().argmax(1), torch.zeros_like(lens))
    cols = torch.arange(S, device=am.device)
    span = (cols >= first[:, None]) & (cols < (first + lens)[:, None])
    if not torch.equal(span, am):
        bad = int((span != am).any(1).nonzero()[0])
        raise ValueError(
            f"attention_mask row {bad} is not one contiguous run of ones; the Megatron actor packs each "
            "sample's real tokens as one sequence (OpenRLHF pads on the right only)"
        )
    return first, lens


def pack_micro_batch(
    sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, pad_multiple: int = 1
) -> PackedMicroBatch:
    """Pack ``sequences [B,S]`` (real tokens marked by ``attention_mask``) into one THD row."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    B, S = sequences.shape
    A = int(num_actions)
    if not 0 < A < S + 1:
        raise ValueError(f"action width {A} does not fit sequences of width {S}")
    dev = sequences.device
    first, lens = real_token_spans(attention_mask)
    padded = (lens + pad_multiple - 1) // pad_multiple * pad_multiple
    cu = torch.zeros(B + 1, dtype=torch.long, device=dev)
    cu[1:] = torch.cumsum(padded, 0)
    T = int(cu[-1])
    if T == 0:
        raise ValueError("micro-batch holds no tokens (every attention_mask row is zero)")
    am = attention_mask.bool()
    cols = torch.arange(S, device=dev)
    offset = cols[None, :] - first[:, None]  # position inside the sequence
    dest = cu[:-1, None] + offset  # packed position of column (b, c)
    tokens = torch.zeros(T, dtype=sequences.dtype, device=dev)
    tokens[dest[am]] = sequences[am]
    seg = torch.repeat_interleave(torch.arange(B, device=dev), padded)
    position_ids = torch.arange(T, device=dev) - cu[:-1][seg]
    c = S - A + torch.arange(A, device=dev)  # action columns
    valid = (c[None, :] > first[:, None]) & (c[None, :] < (first + lens)[:, None])
    index = torch.where(valid, cu[:-1, None] + (c[None, :] - 1 - first[:, None]), torch.zeros_like(valid, dtype=torch.long))
    return PackedMicroBatch(
        tokens=tokens.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=int(padded.max()),
        action_index=index,
        action_valid=valid,
        action_tokens=sequences[:, S - A :],
        seq_lens=[int(x) for x in lens.tolist()],
    )


def pad_to_tokens(pk: PackedMicroBatch, total: int) -> PackedMicroBatch:
    """``pk`` with a trailing segment of pad tokens so the row holds ``total`` tokens (one packed
    length for every micro-batch of a pass: the interleaved pipeline schedule sends fixed shapes).
    The segment is a sequence of its own in ``cu_seqlens``; no action position points into it."""
    extra = int(total) - pk.num_tokens
    if extra < 0:
        raise ValueError(f"cannot pad a packed row of {pk.num_tokens} tokens to {total}")
    if extra == 0:
        return pk
    dev = pk.tokens.device
    tokens = torch.cat([pk.tokens, torch.zeros(1, extra, dtype=pk.tokens.dtype, device=dev)], 1)
    positions = torch.cat([pk.position_ids, torch.arange(extra, device=dev, dtype=pk.position_ids.dtype)[None]], 1)
    cu = torch.cat([pk.cu_seqlens, torch.tensor([int(total)], dtype=pk.cu_seqlens.dtype, device=dev)])
    return PackedMicroBatch(tokens=tokens, position_ids=positions, cu_seqlens=cu, max_seqlen=max(pk.max_seqlen, extra),
                            action_index=pk.action_index, action_valid=pk.action_valid,
                            action_tokens=pk.action_tokens, seq_lens=pk.seq_lens)
