"""Host memory per node of a Megatron run: what ``lpo-train --dry-run`` prints and ``--megatron.host_memory_gb``
checks (cluster review 3, G2).

Per node (ranks node-major, ``colocation_memory.node_layout``), in bytes:

* **the actor's host pool**, colocated (``--ds.enable_sleep``) only: each rank's :class:`.offload.HostPool`
  holds its bf16 weights (``2 P_s``) and its optimizer state, fp32 main params and Adam moments (``12 P_s`` over
  the DP ranks with the distributed optimizer; ``8 P_s`` with fp32 parameters, whose main copy is the weight
  itself), where ``P_s`` is a rank's parameters (``memory.rank_parameters``, its own stage). The gradient buffer is
  dropped on sleep, not copied. The pool is made of power-of-two slabs, so torch's pinned-memory allocator rounds
  nothing: it holds those bytes rounded up to 4 KiB (:meth:`.offload.HostPool.planned_bytes`; regions start on 64-byte
  multiples, megatron-core pads its DDP buffers by a few hundred elements: both far below 0.1 GB), and it does not
  grow after the first step.
* **vLLM's level-1 sleep backups**, colocated with ``--vllm.enable_sleep``: each worker copies its weights to
  pinned host memory at every sleep (vLLM 0.29 ``CuMemAllocator.sleep``: one ``torch.empty(..., pin_memory=True)``
  per allocation segment of its weight pool), which torch's pinned allocator rounds up to a power of two and keeps
  cached for the next sleep. :func:`vllm_backup_bytes` is an estimate from vLLM's tensors of one TP rank (fused
  QKV and gate-up, vocabulary padded to 64) and torch's segment sizes (tensors up to 1 MiB share 2 MiB segments,
  up to 10 MiB share 20 MiB ones, larger ones get their size rounded up to 2 MiB), each segment rounded up to a
  power of two; not a measurement.
* **checkpoint writers**: each rank of the first data-parallel replica writes safetensors files of up to 2 GiB,
  buffered in host memory, plus the unsharded fp32 tensor that fills the buffer (and a host region that spans two
  slabs is copied once to be read); rank 0 also buffers the HF export's shards (up to 4 GiB, bf16) with
  ``--ckpt.save_hf``.
* **the reference model** offloaded by DeepSpeed (``--algo.kl.init_coef > 0 --ref.offload``): its bf16 weights per
  GPU.
* **processes**: :data:`HOST_PROCESS_GB` per GPU for each process on it (the actor rank; the vLLM worker when
  colocated): Python, torch and CUDA libraries, tokenizer, Ray's worker; an allowance, not a measurement.

The check: the fullest node must fit :data:`RAY_MEMORY_THRESHOLD` of ``--megatron.host_memory_gb`` (GB = 1e9
bytes per node): Ray's memory monitor kills workers once a node uses 95 % of its memory
(``RAY_memory_usage_threshold``), and pinned pages cannot be swapped out. Default: the memory of the machine
``lpo-train`` is launched on, when that machine has an accelerator (``ray job submit`` runs the driver on the head
node, a node like the others); a dry run, or a driver without an accelerator, checks only a value given. ``0``
turns the check off. ``python -m openrlhf_lpo.megatron.host_memory MODEL --tp 4 --dp 2`` prints one node.
"""

from __future__ import annotations

from openrlhf_lpo.core.training_backends import backend_of
from openrlhf_lpo.megatron.training_backend import MEGATRON

import argparse
import math
import os
from typing import Dict, List, Optional, Tuple

from openrlhf_lpo.cli.flags import FlagError, FlagGroup, register_flag_group
from openrlhf_lpo.megatron.memory import (GB, Shape, largest_layer_tensor_elements, largest_tensor_elements,
                                          node_layout, rank_parameters)

__all__ = ["HOST_PROCESS_GB", "RAY_MEMORY_THRESHOLD", "actor_pool_bytes", "vllm_tensor_bytes", "vllm_backup_bytes",
           "node_host_memory", "host_plan_lines", "check_host_fit", "machine_memory_gb"]

HOST_PROCESS_GB = 6.0  # per process on a GPU (actor rank, vLLM worker): an allowance
RAY_MEMORY_THRESHOLD = 0.95  # Ray's memory monitor kills workers above this share of a node's memory
CKPT_FILE_BYTES = 2 * 1024**3  # checkpoint.py's _MAX_FILE_BYTES
HF_SHARD_BYTES = 4 * 1024**3  # convert.save_hf_checkpoint's max_shard_bytes
MiB = 1024**2


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 1 else int(n)


def actor_pool_bytes(shape: Shape, tp: int, pp: int, dp: int, stage: int = 0, params_dtype: str = "bf16",
                     distributed_optimizer: bool = True) -> int:
    """One rank's host pool (module docstring): weights + main params + Adam moments, rounded up to 4 KiB."""
    from openrlhf_lpo.megatron.offload import HostPool

    p = rank_parameters(shape, tp, pp, stage)
    shards = dp if distributed_optimizer else 1
    half = params_dtype != "fp32"
    weights = (2 if half else 4) * p
    main = 4 * p / shards if half else 0  # fp32 parameters are their own main copy
    moments = 8 * p / shards
    return HostPool.planned_bytes([int(math.ceil(weights + main + moments))])


def vllm_tensor_bytes(shape: Shape, vllm_tp: int) -> List[int]:
    """bf16 bytes of every weight tensor of one vLLM TP rank (fused QKV and gate-up, vocabulary padded to 64; a KV
    head is replicated when there are fewer KV heads than ranks)."""
    h, t = shape.hidden, vllm_tp
    k = max(shape.kv_heads // t, 1) * shape.head_dim
    layer = [(shape.q // t + 2 * k) * h, h * shape.q // t, 2 * shape.ffn // t * h, h * shape.ffn // t, h, h]
    if shape.qkv_bias:
        layer.append(shape.q // t + 2 * k)
    if shape.qk_norm:
        layer += [shape.head_dim, shape.head_dim]
    vocab = -(-shape.vocab // 64) * 64 // t
    out = [2 * n for n in layer] * shape.layers + [2 * vocab * h, 2 * h]
    if not shape.tied:
        out.append(2 * vocab * h)
    return out


def vllm_backup_bytes(shape: Shape, vllm_tp: int) -> int:
    """Pinned host bytes one vLLM worker keeps for its level-1 sleep backups (an estimate: module docstring)."""
    sizes = vllm_tensor_bytes(shape, vllm_tp)
    small = sum(n for n in sizes if n <= MiB)
    mid = sum(n for n in sizes if MiB < n < 10 * MiB)
    large = [n for n in sizes if n >= 10 * MiB]
    return (-(-small // (2 * MiB))) * 2 * MiB + (-(-mid // (20 * MiB))) * _pow2(20 * MiB) \
        + sum(_pow2(-(-n // (2 * MiB)) * 2 * MiB) for n in large)


def node_host_memory(hf_config, *, tp: int, pp: int, dp: int, gpus_per_node: int, colocated: bool,
                     vllm_tp: int = 1, vllm_sleep: bool = True, params_dtype: str = "bf16",
                     distributed_optimizer: bool = True, save_hf: bool = True, reference_bytes_per_gpu: float = 0.0,
                     process_gb: float = HOST_PROCESS_GB) -> List[Tuple[int, int, int, Dict[str, float]]]:
    """(node, first rank, last rank, {row: bytes, ..., "total"}) for every node of the actor (module docstring)."""
    shape = Shape.of(hf_config)
    world = tp * pp * dp
    out = []
    for node, first, last, _ in node_layout(world, gpus_per_node, tp, pp):
        ranks = range(first, last + 1)
        gpus = len(ranks)
        stage = [(r // tp) % pp for r in ranks]
        rows: Dict[str, float] = {}
        if colocated:
            rows["actor host pools: bf16 weights + fp32 main params + Adam moments (gradients dropped)"] = float(
                sum(actor_pool_bytes(shape, tp, pp, dp, s, params_dtype, distributed_optimizer) for s in stage))
            if vllm_sleep:
                rows["vLLM level-1 sleep: weight backups, pinned, power-of-two segments (estimate)"] = \
                    float(gpus * vllm_backup_bytes(shape, vllm_tp))
        writers = [r for r in ranks if r < tp * pp]  # the first data-parallel replica writes the checkpoint
        if writers:  # each: its file buffer and the tensor that fills it; one writer per stage has the largest
            layer = largest_layer_tensor_elements(shape)
            most = sum(largest_tensor_elements(shape, pp, s) - layer for s in {(r // tp) % pp for r in writers})
            rows["checkpoint writers: 2 GiB file buffer + one unsharded fp32 tensor (+ its shard) each"] = float(
                len(writers) * (CKPT_FILE_BYTES + 4 * layer * (1 + 1 / tp)) + 4 * most * (1 + 1 / tp))
        if save_hf and first == 0:
            rows["HF export on rank 0 (--ckpt.save_hf): 4 GiB shard buffer + one bf16 tensor"] = float(
                HF_SHARD_BYTES + 2 * shape.vocab * shape.hidden)
        if reference_bytes_per_gpu:
            rows["reference model offloaded by DeepSpeed (--ref.offload), bf16"] = gpus * reference_bytes_per_gpu
        rows["processes: actor rank" + (" + vLLM worker" if colocated else "") + f" per GPU, {process_gb:g} GB each "
             "(allowance)"] = gpus * (2 if colocated else 1) * process_gb * GB
        rows["total"] = sum(rows.values())
        out.append((node, first, last, rows))
    return out


# ----------------------------------------------------------------------------- the run's flags


def machine_memory_gb() -> float:
    """Physical memory of this machine, GB = 1e9 bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def _plan(args) -> Optional[List[Tuple[int, int, int, Dict[str, float]]]]:
    from openrlhf_lpo.core.config import dp_size
    from openrlhf_lpo.megatron.colocation_memory import _hf_config, is_colocated

    if backend_of(args) is not MEGATRON:
        return None
    hf = _hf_config(args)
    if hf is None:
        return None
    m = args.megatron
    colocated = is_colocated(args) and bool(getattr(args.ds, "enable_sleep", False))
    ref = 0.0
    if args.algo.kl.init_coef > 0 and getattr(args.ref, "offload", False):
        n = args.actor.num_nodes * args.actor.num_gpus_per_node
        ref = 2.0 * Shape.of(hf).parameters / (n if args.ds.zero_stage == 3 else 1)
    try:
        return node_host_memory(hf, tp=m.tp, pp=m.pp, dp=dp_size(args), gpus_per_node=args.actor.num_gpus_per_node,
                                colocated=colocated, vllm_tp=args.vllm.tensor_parallel_size,
                                vllm_sleep=bool(getattr(args.vllm, "enable_sleep", False)),
                                params_dtype=m.params_dtype, distributed_optimizer=m.distributed_optimizer,
                                save_hf=bool(getattr(args.ckpt, "save_hf", False)), reference_bytes_per_gpu=ref)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a config without the dims the formula reads
        return None


def _limit(args) -> Tuple[Optional[float], str]:
    """(GB the check uses or None, where it comes from)."""
    given = getattr(args.megatron, "host_memory_gb", None)
    if given is not None:
        return (given or None), f"--megatron.host_memory_gb {given:g}"
    from openrlhf_lpo.megatron.device import accelerator_available

    if not getattr(args, "dry_run", False) and accelerator_available():
        gb = machine_memory_gb()
        return gb, f"this machine's {gb:.0f} GB (--megatron.host_memory_gb unset)"
    return None, "not checked: pass --megatron.host_memory_gb <GB per node> (a launch on a GPU machine checks " \
                 "against its own memory)"


def host_plan_lines(args: argparse.Namespace) -> List[str]:
    """What ``lpo-train --dry-run`` prints: host memory per node of a Megatron run."""
    if backend_of(args) is not MEGATRON:
        return []
    plan = _plan(args)
    if plan is None:
        return [f"host memory per node: not estimated (no readable config.json for {args.actor.model_name_or_path})"]
    limit, source = _limit(args)
    fits = f"fits {RAY_MEMORY_THRESHOLD:.0%} of {limit:.0f} GB ({source})" if limit else source
    lines = [f"host memory per node (megatron/host_memory.py; {fits}):"]
    for node, first, last, rows in plan:
        lines.append(f"  node {node} (ranks {first}-{last}): {rows['total'] / GB:.1f} GB")
        lines += [f"    {k}: {v / GB:.1f} GB" for k, v in rows.items() if k != "total"]
    return lines


def check_host_fit(args: argparse.Namespace) -> None:
    """Raise :class:`FlagError` when the fullest node's host memory exceeds the limit (module docstring)."""
    limit, source = _limit(args)
    plan = _plan(args) if limit else None
    if not plan:
        return
    node, first, last, rows = max(plan, key=lambda x: x[3]["total"])
    if rows["total"] <= RAY_MEMORY_THRESHOLD * limit * GB:
        return
    biggest = max((k for k in rows if k != "total"), key=lambda k: rows[k])
    raise FlagError(
        f"--backend megatron needs {rows['total'] / GB:.1f} GB of host memory on node {node} (ranks {first}-{last}; "
        f"the largest part: {biggest} {rows[biggest] / GB:.1f} GB), above {RAY_MEMORY_THRESHOLD:.0%} of "
        f"{source}: set --megatron.host_memory_gb to the nodes' memory if they have more, spread the actor over more "
        "nodes (--actor.num_nodes: smaller optimizer shards per node), raise --vllm.tensor_parallel_size (fewer vLLM "
        "weight backups per node) or --megatron.tp / --megatron.pp, use --megatron.distributed_optimizer, or give the "
        "engines GPUs of their own (drop --train.colocate_all --vllm.enable_sleep --ds.enable_sleep; COLOCATE=0 in "
        "the recipes)")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    if any(a.dest == "megatron.host_memory_gb" for a in parser._actions):
        return
    g = parser.add_argument_group("Megatron host memory plan")
    g.add_argument("--megatron.host_memory_gb", type=float, default=None,
                   help="host memory of one node (GB = 1e9 bytes) the Megatron host-memory plan checks against: a node "
                   "needing more than 95%% of it stops the run and its --dry-run; default: this machine's memory for a "
                   "launch on a machine with an accelerator, unchecked otherwise; 0 turns the check off")


def _validate(args: argparse.Namespace) -> None:
    if backend_of(args) is not MEGATRON:
        return
    given = getattr(args.megatron, "host_memory_gb", None)
    if given is not None and given < 0:
        raise FlagError(f"--megatron.host_memory_gb must be >= 0 (0: no check), got {given:g}")
    check_host_fit(args)


register_flag_group(FlagGroup(name="megatron-host-memory", add_arguments=_add_arguments, validate=_validate,
                              plan_lines=host_plan_lines))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m openrlhf_lpo.megatron.host_memory MODEL --tp 4 --dp 2``: host memory per node, colocated."""
    from openrlhf_lpo.megatron.memory import load_config, shape_parser

    ap = shape_parser(__doc__.splitlines()[0])
    ap.add_argument("--vllm-tp", type=int, default=1, help="--vllm.tensor_parallel_size")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="--actor.num_gpus_per_node")
    ap.add_argument("--split", action="store_true", help="not colocated (no host pools, no vLLM backups)")
    ap.add_argument("--no-save-hf", action="store_true", help="without --ckpt.save_hf")
    a = ap.parse_args(argv)
    for node, first, last, rows in node_host_memory(load_config(a.model), tp=a.tp, pp=a.pp, dp=a.dp,
                                                    gpus_per_node=a.gpus_per_node, colocated=not a.split,
                                                    vllm_tp=a.vllm_tp, save_hf=not a.no_save_hf):
        print(f"node {node} (ranks {first}-{last}): {rows['total'] / GB:.1f} GB")
        print("\n".join(f"  {k}: {v / GB:.1f} GB" for k, v in rows.items() if k != "total"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
