"""Pipeline efficiency of the Megatron actor's passes, and the padding of virtual pipeline stages,
from the flags alone (pure: no process group, no model). ``lpo-train --dry-run`` prints
:func:`pipeline_plan_lines` for ``--backend megatron`` with ``--megatron.pp > 1``.

Efficiency of one pipeline schedule of ``M`` micro-batches over ``pp`` stages, counted in slots (one
micro-batch through one stage: a forward, or a forward and its backward):

* megatron's forward-only schedule and 1F1B: every stage is busy ``M`` of ``M + pp - 1`` slots (pp - 1
  slots of fill and drain), so the efficiency is ``M / (M + pp - 1)``;
* interleaved 1F1B (``--megatron.vpp V``, V model chunks per stage): a slot is V chunk slots and fill and
  drain take ``pp - 1`` chunk slots, i.e. a bubble of ``(pp - 1) / (V M)`` of the busy time. The schedule
  needs ``M % pp == 0``: the actor appends ``M' - M`` loss-free micro-batches (``M'`` = M rounded up to a
  multiple of pp), and pads them, like every packed row of the pass, to the pass's longest row
  (``MegatronActor._micro_batches``, ``packing.pad_to_tokens``); efficiency ``M / (M' + (pp - 1) / V)``,
  which is ``M / (M + pp - 1)`` at V = 1.

The passes (``openrlhf_lpo/megatron/ray_actor.py``, ``actor.py``):

* **old-log-prob forward**: OpenRLHF calls the actor once per experience chunk of
  ``--rollout.micro_batch_size`` samples, and each call is one forward-only schedule over micro-batches of
  ``--train.micro_batch_size`` samples: ``M = ceil(rollout / train micro-batch)``. Under
  ``--train.dynamic_batch_enable`` a chunk holds up to ``--rollout.max_tokens_per_gpu`` tokens, cut under
  ``--train.max_tokens_per_gpu``: ``M ~ ceil(rollout budget / train budget)`` for a full chunk.
* **training**: one 1F1B schedule per optimizer window of ``--train.batch_size / dp`` samples, ``M = window
  / --train.micro_batch_size`` (a two-pass LPO window's no-grad pre-pass runs the same micro-batches);
  under dynamic batching about ``window x --data.max_len / --train.max_tokens_per_gpu`` (shorter samples
  pack into fewer).

Below :data:`EFFICIENCY_WARN` (80%) the plan prints a warning naming the flag; ``4 x pp`` micro-batches per
schedule always clear it (``4pp / (5pp - 1)``: 88.9% at PP2, 84.2% at PP4), hence
:data:`MICRO_BATCHES_PER_STAGE` in ``configs/backends/megatron.sh``.

Virtual pipeline padding: the interleaved schedule sends fixed shapes, so every packed row of a pass is
padded to the pass's longest. :func:`vpp_padding_factor` is the tokens computed per real token, ``max /
mean`` of the packed rows' lengths (times ``M'/M``): with one sample per row it is the max / mean of the
sequence lengths, 1.7-4x for long-tail responses (cluster review 2, N5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

__all__ = ["EFFICIENCY_WARN", "MICRO_BATCHES_PER_STAGE", "PassPlan", "pipeline_efficiency", "pipeline_passes",
           "pipeline_plan_lines", "pipeline_warnings", "packed_row_tokens", "vpp_padded_tokens",
           "vpp_padding_factor", "vpp_padding_warning"]

EFFICIENCY_WARN = 0.8
MICRO_BATCHES_PER_STAGE = 4  # micro-batches per schedule per pipeline stage the recipes aim for


@dataclass(frozen=True)
class PassPlan:
    name: str
    micro_batches: int  # M: micro-batches carrying samples in one schedule
    efficiency: float
    approximate: bool = False  # M from token budgets (dynamic batching): depends on the lengths
    note: str = ""


def _padded_count(m: int, pp: int, vpp: int) -> int:
    """Micro-batches the schedule runs: M, rounded up to a multiple of pp under interleaving."""
    return -(-m // pp) * pp if vpp > 1 else m


def pipeline_efficiency(micro_batches: int, pp: int, vpp: int = 1) -> float:
    """Busy fraction of every stage in one schedule: ``M / (M' + (pp - 1) / vpp)`` (``M' = M`` at vpp 1,
    i.e. ``M / (M + pp - 1)``; see the module docstring)."""
    if micro_batches < 1 or pp < 1 or vpp < 1:
        raise ValueError(f"micro_batches, pp and vpp must be >= 1, got {micro_batches}, {pp}, {vpp}")
    return micro_batches / (_padded_count(micro_batches, pp, vpp) + (pp - 1) / vpp)


def _get(args, dotted: str, default=None):
    """``args.a.b`` for ``"a.b"``, or ``default`` where a part is missing or None."""
    node = args
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return default
    return node


def pipeline_passes(args) -> List[PassPlan]:
    """The schedules of one rollout batch (old-log-prob forward, training window) with their efficiency."""
    from openrlhf_lpo.core.config import dp_size

    pp, vpp = int(args.megatron.pp), int(_get(args, "megatron.vpp", 1) or 1)
    micro = int(args.train.micro_batch_size)
    dynamic = bool(_get(args, "train.dynamic_batch_enable", False))
    train_budget = int(_get(args, "train.max_tokens_per_gpu", 0) or 0)
    window = max(int(args.train.batch_size) // max(dp_size(args), 1), 1)
    if dynamic and train_budget > 0:
        rollout_budget = int(_get(args, "rollout.max_tokens_per_gpu", 0) or train_budget)
        m_old = max(math.ceil(rollout_budget / train_budget), 1)
        old_note = (f"chunks of <= {rollout_budget} tokens cut under {train_budget} "
                    "(--rollout.max_tokens_per_gpu / --train.max_tokens_per_gpu)")
        m_train = max(math.ceil(window * int(args.data.max_len) / train_budget), 1)
        train_note = (f"{window} samples per train_step window of up to {args.data.max_len} tokens "
                      f"under {train_budget} tokens per micro-batch")
    else:
        rollout = int(args.rollout.micro_batch_size)
        m_old = max(math.ceil(rollout / micro), 1)
        old_note = (f"--rollout.micro_batch_size {rollout} / --train.micro_batch_size {micro} per call, "
                    "one schedule per call")
        m_train = max(math.ceil(window / micro), 1)
        train_note = f"{window} samples per train_step window / --train.micro_batch_size {micro}"
    return [PassPlan("old-log-prob forward", m_old, pipeline_efficiency(m_old, pp, vpp), dynamic, old_note),
            PassPlan("training (each train_step window; a pre-pass runs the same micro-batches)", m_train,
                     pipeline_efficiency(m_train, pp, vpp), dynamic, train_note)]


def pipeline_warnings(args) -> List[str]:
    """Warning lines (without prefix) for a Megatron run with PP > 1: a pass below :data:`EFFICIENCY_WARN`,
    and virtual pipeline stages with one sample per micro-batch (every row padded to the pass's longest)."""
    if int(args.megatron.pp) < 2:
        return []
    pp, vpp = int(args.megatron.pp), int(_get(args, "megatron.vpp", 1) or 1)
    micro = int(args.train.micro_batch_size)
    out = []
    for p in pipeline_passes(args):
        if p.efficiency >= EFFICIENCY_WARN:
            continue
        if p.name.startswith("old-log-prob"):
            if p.approximate:
                fix = (f"raise --rollout.max_tokens_per_gpu to >= {MICRO_BATCHES_PER_STAGE * pp} x "
                       "--train.max_tokens_per_gpu")
            else:
                fix = (f"raise --rollout.micro_batch_size to >= {MICRO_BATCHES_PER_STAGE} x pp x --train.micro_batch_size"
                       f" = {MICRO_BATCHES_PER_STAGE * pp * micro} (ROLLOUT_MICRO_BATCH_SIZE in "
                       "configs/backends/megatron.sh)")
        else:
            fix = "raise --train.batch_size or lower --train.micro_batch_size (more micro-batches per window)"
        out.append(f"{p.name}: pipeline efficiency {p.efficiency:.1%} < {EFFICIENCY_WARN:.0%} with "
                   f"{p.micro_batches} micro-batch(es) per schedule over --megatron.pp {pp}; {fix}")
    if vpp > 1 and micro == 1 and not _get(args, "train.dynamic_batch_enable", False):
        train = pipeline_passes(args)[1].micro_batches
        gain = (pp - 1) / train - (pp - 1) / (vpp * train)
        out.append(f"--megatron.vpp {vpp} with --train.micro_batch_size 1: the interleaved schedule sends fixed "
                   "shapes, so every packed row (one sample each) is padded to the pass's longest sequence: "
                   "compute x max/mean of the lengths (1.7-4x for long-tail responses), while the bubble it "
                   f"removes is {gain:.2%} of a window of {train} micro-batches. Leave --megatron.vpp at 1 "
                   "(MEGATRON_VPP unset) unless the passes hold few micro-batches of even length")
    return out


def pipeline_plan_lines(args) -> List[str]:
    """What ``lpo-train --dry-run`` prints for ``--backend megatron`` (the Megatron flag group's plan lines) with
    PP > 1 (nothing otherwise)."""
    if int(args.megatron.pp) < 2:
        return []
    pp, vpp = int(args.megatron.pp), int(_get(args, "megatron.vpp", 1) or 1)
    formula = "M/(M+pp-1)" if vpp == 1 else f"interleaved 1F1B, bubble (pp-1)/(vpp*M), vpp {vpp}"
    lines = [f"pipeline efficiency per schedule (PP {pp}, {formula}):"]
    for p in pipeline_passes(args):
        about = "about " if p.approximate else ""
        lines.append(f"  {p.name}: {about}{p.micro_batches} micro-batch(es) -> {p.efficiency:.1%} ({p.note})")
    lines += [f"  WARNING: {w}" for w in pipeline_warnings(args)]
    return lines


# ----------------------------------------------------------------------------- virtual pipeline padding


def packed_row_tokens(lengths: Sequence[int], micro_batch_size: int, pad_multiple: int = 1) -> List[int]:
    """Tokens of each packed row when consecutive samples of ``lengths`` (real tokens) form micro-batches
    of ``micro_batch_size`` (``MegatronActor.fixed_micro_batches``), each sequence rounded up to
    ``pad_multiple`` (TP under sequence parallelism, ``packing.pack_micro_batch``)."""
    rounded = [-(-int(n) // pad_multiple) * pad_multiple for n in lengths]
    return [sum(rounded[i:i + micro_batch_size]) for i in range(0, len(rounded), micro_batch_size)]


def vpp_padded_tokens(row_tokens: Sequence[int], pp: int) -> int:
    """Tokens the interleaved schedule computes for a pass of packed rows ``row_tokens``: every row, plus
    the loss-free rows that make the count a multiple of ``pp``, padded to the longest row."""
    if not row_tokens:
        raise ValueError("a pass holds at least one micro-batch")
    return max(row_tokens) * (-(-len(row_tokens) // pp) * pp)


def vpp_padding_factor(row_tokens: Sequence[int], pp: int = 1) -> float:
    """Computed tokens / real tokens of a VPP pass: ``max / mean`` of the packed rows (times ``M'/M`` when
    ``M % pp != 0``)."""
    return vpp_padded_tokens(row_tokens, pp) / float(sum(row_tokens))


def vpp_padding_warning(factor: float, rows: int) -> Optional[str]:
    """The run-time line the actor prints once when a VPP pass computes >= 1.5x its real tokens."""
    if factor < 1.5:
        return None
    return (f"--megatron.vpp: a pass of {rows} packed rows computes {factor:.2f}x its real tokens (every row is "
            "padded to the pass's longest; the interleaved schedule sends fixed shapes). Leave --megatron.vpp at 1 "
            "for long-tail lengths (docs/megatron.md, virtual pipeline stages)")
