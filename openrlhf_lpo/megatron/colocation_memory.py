"""Memory per GPU of a colocated Megatron run (``--train.colocate_all``): the phases that take turns on each GPU.

With ``--train.colocate_all --vllm.enable_sleep --ds.enable_sleep`` every GPU holds one Megatron actor rank and
(a share of) one vLLM engine, and the two take turns (OpenRLHF 0.11.2's loop: ``SamplesGenerator`` wakes the
engines to generate and puts them back to sleep; ``PPOTrainer.ppo_train`` reloads the actor, fits, offloads it;
``broadcast_to_vllm`` wakes the engines' weights only and syncs them):

* **generation** (vLLM awake, the actor offloaded). vLLM holds its budget, ``--vllm.gpu_memory_utilization`` x
  the GPU's memory: its bf16 weights (``2 P / vllm_tp``, norms replicated), its activation peak and CUDA graphs
  (vLLM 0.29 counts both inside the budget) and the KV cache, which gets the rest. Outside the budget it has its
  CUDA context (vLLM takes its start-up snapshot after the context exists): :data:`VLLM_CONTEXT_GB`. The actor's
  parameters, DDP gradient buffers and distributed-optimizer state are on the host (``megatron/offload.py``
  ``HostOffload``: 0 bytes resident, tested), so what stays of it is its CUDA context and NCCL communicator
  buffers, the same allowance ``memory.actor_memory`` adds to its peak (:data:`memory.OVERHEAD_GB`), assuming
  the actor empties torch's cache after the offload (as OpenRLHF's DeepSpeed offload does).
* **training** (vLLM asleep at sleep level 1, the actor loaded): the old-log-prob forward and the update, whose
  peak is ``memory.actor_memory``'s ``peak`` (allowance included). Level 1 moves vLLM's weights to host memory
  and frees its KV cache (both live in vLLM's sleep allocator, ``CuMemAllocator``, which empties torch's cache
  afterwards); what vLLM keeps is outside that allocator: its CUDA context, the captured CUDA graphs' memory pool
  and NCCL / custom all-reduce buffers, :data:`VLLM_ASLEEP_GB` (an allowance, context included, not a
  measurement).
* **weight sync** (vLLM's weights awake, its KV cache still asleep; printed, not checked): vLLM's weights and
  what it keeps asleep, the actor's bf16 parameters on the device to hand to vLLM, one full tensor gathered for
  resharding (the largest: embedding or output layer, bf16) and the actor's allowance. This assumes the sync
  brings back the parameters only (gradients and optimizer state stay on the host until the next training
  phase); with the whole actor state back the figure is ``static total`` instead of the bf16 weights.

* **checkpoint save** (checked): upstream saves right after the weight sync (``PPOTrainer.train_step`` then
  ``save_logs_and_checkpoints``), so vLLM's weights are awake. The actor brings nothing back for the checkpoint: it
  reads its optimizer state where it lies in host memory (``actor_checkpoints.py``, cluster review 3, G1), so its
  share is the save's transients on a writing rank, one parameter at a time: the fp32 shard of the largest tensor
  of its stage (the distributed optimizer's flat copy), that shard copied from the host, the TP gather list and the
  unsharded tensor, :func:`save_transient_bytes`, plus its allowance. With ``--ckpt.save_hf`` the HF export then
  brings the bf16 weights back as the sync does, and the rank that gathers a tensor holds its TP gather list and
  the whole tensor (bf16, two copies of the largest): the phase is the larger of the two.

A DeepSpeed reference model (``--algo.kl.init_coef > 0``) shares the GPUs in every phase: its bf16 weights,
``2 P / N`` over the N actor GPUs under ZeRO-3 (``2 P`` otherwise), 0 with ``--ref.offload``.

Several nodes (``COLOCATE=1`` of the 32B / 70B recipes): ranks sit node-major (rank r on node ``r // G`` of G GPUs
each, ``openrlhf/placement.py``) and megatron's rank order is ``tp-cp-ep-pp-dp`` (rank r in stage ``(r // tp) %
pp``), so each node holds whole TP groups of known stages; :func:`node_layout` lists them and the dry run prints
every phase per node from each stage's own parameters (the activation terms of the most loaded stage: an upper
bound). The check uses the most loaded stage, which bounds every node.

GB = 1e9 bytes. A phase fits when its total is at most ``--megatron.gpu_memory_gb`` (default 80, the recipes'
80 GB-class GPUs; an 80 GB H100 reports 85.5e9 bytes, so 80 leaves room for allocator fragmentation).
:func:`check_colocated_fit` stops a run (and its dry run) whose generation or training phase does not fit,
naming the flags to change; ``--megatron.gpu_memory_gb 0`` turns the check off. Host memory per node is
``host_memory.py``'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Dict, List, Optional

from openrlhf_lpo.cli.flags import FlagError, FlagGroup, register_flag_group
from openrlhf_lpo.megatron.memory import (GB, OVERHEAD_GB, Shape, actor_memory, largest_tensor_elements, node_layout,
                                          rank_parameters)

__all__ = ["VLLM_CONTEXT_GB", "VLLM_ASLEEP_GB", "GPU_MEMORY_GB", "vllm_weight_bytes", "kv_cache_bytes_per_token",
           "largest_tensor_elements", "save_transient_bytes", "node_layout", "colocated_memory",
           "colocated_plan_lines", "check_colocated_fit", "is_colocated"]

VLLM_CONTEXT_GB = 0.5  # vLLM's CUDA context, outside its gpu_memory_utilization budget (allowance)
VLLM_ASLEEP_GB = 2.0  # what a vLLM worker keeps at sleep level 1: context, CUDA-graph pool, NCCL buffers (allowance)
GPU_MEMORY_GB = 80.0  # the recipes' GPUs (80 GB class)

GENERATION, TRAINING, SYNC, SAVE = "generation", "training", "weight sync", "checkpoint save"
SAVE_VLLM = "vLLM bf16 weights (awake since the sync) + what it keeps asleep"
SAVE_TRANSIENTS = "save transients of a writing rank (fp32 shard, its host copy, TP gather, unsharded tensor)"
SAVE_CHECKPOINT = "checkpoint (the sum above)"
HF_EXPORT = ("HF export (--ckpt.save_hf): vLLM weights + what it keeps asleep, the actor's bf16 weights back, the "
             "largest tensor's TP gather and whole (bf16), allowance")


def vllm_weight_bytes(shape: Shape, vllm_tp: int) -> float:
    """bf16 weights of one vLLM TP rank: everything sharded over ``vllm_tp`` but the norms (replicated)."""
    return 2.0 * rank_parameters(shape, vllm_tp, 1, 0)


def kv_cache_bytes_per_token(shape: Shape, vllm_tp: int) -> float:
    """bf16 K and V of one token on one vLLM TP rank: ``2 x layers x kv_heads/tp x head_dim x 2`` bytes (a KV head
    is replicated when there are fewer KV heads than TP ranks)."""
    kv_heads = max(shape.kv_heads // vllm_tp, 1)
    return 2.0 * shape.layers * kv_heads * shape.head_dim * 2


def save_transient_bytes(shape: Shape, tp: int, pp: int = 1, stage: Optional[int] = None) -> float:
    """Device bytes a checkpoint save adds on a writing rank of ``stage`` (None: the largest over the stages),
    reading the optimizer state from host memory (``checkpoint.save``): for the stage's largest parameter, the fp32
    shard of this rank (the distributed optimizer's flat copy) and the rank's part of it copied from the host (E
    each, E = elements / tp), and with TP the gather list and the unsharded tensor (tp E each):
    ``4 (2 + 2 tp) E`` bytes, ``4 x 2 E`` at TP1."""
    stages = range(pp) if stage is None else [stage]
    e = max(largest_tensor_elements(shape, pp, s) for s in stages) / tp
    return 4.0 * e * ((2 + 2 * tp) if tp > 1 else 2)


def colocated_memory(hf_config, tp: int, pp: int, dp: int, tokens: int, action_tokens: int, *, vllm_tp: int,
                     gpu_memory_utilization: float, gpu_memory_gb: float = GPU_MEMORY_GB,
                     sequence_parallel: bool = False, recompute: bool = True, distributed_optimizer: bool = True,
                     reference_bytes: float = 0.0, overhead_gb: float = OVERHEAD_GB,
                     vllm_context_gb: float = VLLM_CONTEXT_GB, vllm_asleep_gb: float = VLLM_ASLEEP_GB,
                     save_hf: bool = True, stage: Optional[int] = None,
                     sync_bucket_mb: float = 512.0) -> Dict[str, Dict[str, float]]:
    """Bytes per GPU in each phase (module docstring): ``{phase: {row: bytes}}``, every phase ending in ``total``;
    the generation phase also gives ``KV cache tokens (at most)`` (a count, not bytes). The allowances (the actor's
    ``overhead_gb``, vLLM's context and what it keeps asleep) are in GB. ``stage``: a GPU of that pipeline stage
    (None: the most loaded one); ``save_hf``: the save phase includes the HF export (``--ckpt.save_hf``);
    ``sync_bucket_mb``: ``--megatron.sync_bucket_mb`` (the weight sync holds up to 3 buckets in flight)."""
    shape = Shape.of(hf_config)
    actor = actor_memory(hf_config, tp, pp, dp, tokens, action_tokens, sequence_parallel=sequence_parallel,
                         recompute=recompute, distributed_optimizer=distributed_optimizer, overhead_gb=overhead_gb,
                         stage=stage)
    weights = vllm_weight_bytes(shape, vllm_tp)
    budget = gpu_memory_utilization * gpu_memory_gb * GB
    graphs = (vllm_asleep_gb - vllm_context_gb) * GB  # CUDA graphs + NCCL buffers: inside the budget while awake
    kv = budget - weights - graphs
    gen = {
        "vLLM budget (--vllm.gpu_memory_utilization x GPU)": budget,
        "  of which bf16 weights": weights,
        "  of which CUDA graphs + NCCL buffers (allowance)": graphs,
        "  of which KV cache + activation peak": kv,
        "vLLM CUDA context (outside the budget, allowance)": vllm_context_gb * GB,
        "actor parameters, gradient buffers, optimizer state (on the host)": 0.0,
        "actor CUDA context + NCCL buffers (allowance)": overhead_gb * GB,
    }
    train = {
        "actor static (bf16 weights, fp32 gradient buffer, main params + Adam moments)": actor["static total"],
        "actor forward/backward peak": actor["forward/backward peak"],
        "actor optimizer step peak": actor["optimizer step peak"],
        "actor peak (with its CUDA context + NCCL allowance)": actor["peak"],
        "vLLM asleep, level 1: weights on the host, KV cache freed; context, CUDA graphs, NCCL (allowance)":
            vllm_asleep_gb * GB,
    }
    largest = 2.0 * shape.vocab * shape.hidden  # embedding / output layer, bf16, gathered whole for resharding
    sync = {
        "vLLM bf16 weights (awake) + what it keeps asleep": weights + vllm_asleep_gb * GB,
        "actor bf16 parameters (onloaded for the sync)": actor["bf16 weights"],
        "one gathered tensor (largest: embedding / output layer, bf16)": largest,
        "weight-sync buckets in flight (3 x --megatron.sync_bucket_mb, megatron/weight_sync.py)":
            3.0 * sync_bucket_mb * 2**20,
        "actor CUDA context + NCCL buffers (allowance)": overhead_gb * GB,
    }
    save = {
        SAVE_VLLM: weights + vllm_asleep_gb * GB,
        "actor parameters, gradient buffers, optimizer state (read from host memory)": 0.0,
        SAVE_TRANSIENTS: save_transient_bytes(shape, tp, pp, stage),
        "actor CUDA context + NCCL buffers (allowance)": overhead_gb * GB,
    }
    if reference_bytes:
        for rows in (gen, train, sync, save):
            rows["reference model (DeepSpeed, bf16)"] = reference_bytes
    gen["total"] = budget + vllm_context_gb * GB + overhead_gb * GB + reference_bytes
    train["total"] = actor["peak"] + vllm_asleep_gb * GB + reference_bytes
    sync["total"] = sum(sync.values())
    save[SAVE_CHECKPOINT] = sum(save.values())
    whole = 2.0 * max(largest_tensor_elements(shape, pp, s) for s in range(pp))  # the largest HF tensor, bf16
    export = weights + vllm_asleep_gb * GB + actor["bf16 weights"] + 2 * whole + overhead_gb * GB + reference_bytes
    if save_hf:  # the weights come back; the writer of the largest tensor holds its TP gather list and the whole
        save[HF_EXPORT] = export
    save["total"] = max(save[SAVE_CHECKPOINT], export if save_hf else 0.0)
    gen["KV cache tokens (at most)"] = max(kv, 0.0) / kv_cache_bytes_per_token(shape, vllm_tp)
    return {GENERATION: gen, TRAINING: train, SYNC: sync, SAVE: save}


# ----------------------------------------------------------------------------- the run's flags


def is_colocated(args: argparse.Namespace) -> bool:
    """The vLLM engines of a Megatron run share the actor's GPUs (OpenRLHF colocates them unless async); the flag
    group below is bound to ``--backend megatron``, so its checks and plan lines only see Megatron runs."""
    return (bool(getattr(args.train, "colocate_all", False)) and not getattr(args.train, "async_enable", False)
            and (args.vllm.num_engines or 0) > 0)


def _hf_config(args) -> Optional[dict]:
    path = os.path.join(str(args.actor.model_name_or_path), "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    else:  # a hub id: the Megatron flag group has just read it (cached) or the run would have stopped
        try:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(args.actor.model_name_or_path).to_dict()
        except Exception:  # noqa: BLE001 - not readable here: the plan says so
            return None
    return hf.get("text_config", hf) if "num_hidden_layers" not in hf else hf


def _reference_bytes(args, shape: Shape) -> float:
    if args.algo.kl.init_coef <= 0 or getattr(args.ref, "offload", False):
        return 0.0
    n = args.actor.num_nodes * args.actor.num_gpus_per_node
    return 2.0 * shape.parameters / (n if args.ds.zero_stage == 3 else 1)


def _run_memory(args, stage: Optional[int] = None) -> Optional[Dict[str, Dict[str, float]]]:
    from openrlhf_lpo.core.config import dp_size

    hf = _hf_config(args)
    if hf is None:
        return None
    m, micro = args.megatron, args.train.micro_batch_size
    max_len = args.data.max_len or hf.get("max_position_embeddings")
    if not max_len:
        return None
    new_tokens = min(args.rollout.max_new_tokens or max_len, max_len)
    try:
        return colocated_memory(
            hf, m.tp, m.pp, dp_size(args), micro * max_len, micro * new_tokens, vllm_tp=args.vllm.tensor_parallel_size,
            gpu_memory_utilization=args.vllm.gpu_memory_utilization,
            gpu_memory_gb=m.gpu_memory_gb or GPU_MEMORY_GB, sequence_parallel=m.sequence_parallel,
            recompute=bool(getattr(args.actor, "gradient_checkpointing_enable", False)),
            distributed_optimizer=m.distributed_optimizer, reference_bytes=_reference_bytes(args, Shape.of(hf)),
            save_hf=bool(getattr(args.ckpt, "save_hf", False)), stage=stage,
            sync_bucket_mb=float(getattr(m, "sync_bucket_mb", None) or 512.0))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a config without the dims the formula reads
        return None


def _phase_line(name: str, rows: Dict[str, float]) -> List[str]:
    out = [f"  {name}: {rows['total'] / GB:.1f} GB"]
    for k, v in rows.items():
        if k == "total":
            continue
        out.append(f"    {k}: {v:,.0f}" if k.startswith("KV cache tokens") else f"    {k}: {v / GB:.1f} GB")
    return out


def colocated_plan_lines(args: argparse.Namespace) -> List[str]:
    """What ``lpo-train --dry-run`` prints for a colocated Megatron run: each phase's memory per GPU."""
    if not is_colocated(args):
        return []
    mem = _run_memory(args)
    if mem is None:
        return [f"colocated memory per GPU: not estimated (no readable config.json with the model's dimensions for "
                f"{args.actor.model_name_or_path}, or no --data.max_len)"]
    gpu = args.megatron.gpu_memory_gb or GPU_MEMORY_GB
    m = args.megatron
    lines = [f"colocated memory per GPU (megatron/colocation_memory.py; GPU {gpu:g} GB = --megatron.gpu_memory_gb; "
             f"actor TP {m.tp} x PP {m.pp}, vLLM TP {args.vllm.tensor_parallel_size} at "
             f"--vllm.gpu_memory_utilization {args.vllm.gpu_memory_utilization:g}, sleep level 1):"]
    lines += _phase_line("generation (actor offloaded to the host, vLLM awake)", mem[GENERATION])
    lines += _phase_line("training (vLLM asleep, actor loaded: old-log-prob forward and update)", mem[TRAINING])
    lines += _phase_line("weight sync (vLLM weights awake, KV cache asleep; the actor's bf16 parameters only)",
                         mem[SYNC])
    lines += _phase_line("checkpoint save (vLLM weights awake; the actor's state read from host memory)", mem[SAVE])
    if mem[SYNC]["total"] > gpu * GB:
        lines.append(f"  WARNING: the weight sync needs {mem[SYNC]['total'] / GB:.1f} GB > {gpu:g} GB per GPU")
    nodes = node_layout(m.tp * m.pp * _dp(args), args.actor.num_gpus_per_node, m.tp, m.pp)
    if len(nodes) > 1 or m.pp > 1:
        lines.append("colocated memory per node (GB per GPU; each node's own pipeline stages):")
        for node, first, last, stages in nodes:
            per = [_run_memory(args, stage=s) for s in stages]
            top = {phase: max(p[phase]["total"] for p in per) for phase in (GENERATION, TRAINING, SYNC, SAVE)}
            lines.append(f"  node {node} (ranks {first}-{last}, stage{'s' if len(stages) > 1 else ''} "
                         f"{','.join(map(str, stages))}): " + ", ".join(f"{ph} {v / GB:.1f}" for ph, v in top.items()))
    return lines


def _dp(args) -> int:
    from openrlhf_lpo.core.config import dp_size

    return dp_size(args)


def check_colocated_fit(args: argparse.Namespace) -> None:
    """Raise :class:`FlagError` when the generation, training or checkpoint-save phase of a colocated Megatron run
    does not fit ``--megatron.gpu_memory_gb`` (0: no check), naming the flags that change it."""
    gpu = getattr(args.megatron, "gpu_memory_gb", GPU_MEMORY_GB)
    if not is_colocated(args) or not gpu:
        return
    mem = _run_memory(args)
    if mem is None:
        return
    cap = gpu * GB
    gen, train = mem[GENERATION], mem[TRAINING]
    util = args.vllm.gpu_memory_utilization
    head = (f"--train.colocate_all with --backend megatron does not fit {gpu:g} GB per GPU "
            f"(--megatron.gpu_memory_gb {gpu:g})")
    if gen["  of which KV cache + activation peak"] <= 0:
        raise FlagError(
            f"{head}: vLLM's budget, --vllm.gpu_memory_utilization {util:g} x {gpu:g} GB = "
            f"{gen['vLLM budget (--vllm.gpu_memory_utilization x GPU)'] / GB:.1f} GB, leaves no KV cache after its "
            f"{gen['  of which bf16 weights'] / GB:.1f} GB of weights and "
            f"{gen['  of which CUDA graphs + NCCL buffers (allowance)'] / GB:.1f} GB of CUDA graphs and buffers: raise "
            f"--vllm.gpu_memory_utilization or --vllm.tensor_parallel_size (fewer --vllm.num_engines)")
    if gen["total"] > cap:
        other = gen["total"] - gen["vLLM budget (--vllm.gpu_memory_utilization x GPU)"]
        raise FlagError(
            f"{head}: generation needs {gen['total'] / GB:.1f} GB per GPU (vLLM's budget "
            f"{util:g} x {gpu:g} GB plus {other / GB:.1f} GB its context, the offloaded actor's context and NCCL "
            f"buffers keep): lower --vllm.gpu_memory_utilization to at most "
            f"{math.floor(max(cap - other, 0) / cap * 100) / 100:.2f}")
    save = mem[SAVE]
    if save["total"] > cap:
        hf = HF_EXPORT in save and save[HF_EXPORT] >= save[SAVE_CHECKPOINT]
        raise FlagError(
            f"{head}: the checkpoint save needs {save['total'] / GB:.1f} GB per GPU (vLLM's weights stay awake "
            f"after the sync: {save[SAVE_VLLM] / GB:.1f} GB; "
            + ("the HF export brings the actor's bf16 weights back as the sync does" if hf else
               f"the save's transients {save[SAVE_TRANSIENTS] / GB:.1f} GB")
            + "): raise --vllm.tensor_parallel_size (fewer weights per GPU), raise --megatron.tp or --megatron.pp, "
            + ("drop --ckpt.save_hf (export at the end with --ckpt.output_dir), " if hf else "")
            + "or give the engines GPUs of their own (COLOCATE=0 in the recipes)")
    if train["total"] > cap:
        raise FlagError(
            f"{head}: training needs {train['total'] / GB:.1f} GB per GPU (the actor's peak "
            f"{train['actor peak (with its CUDA context + NCCL allowance)'] / GB:.1f} GB plus "
            f"{VLLM_ASLEEP_GB:g} GB vLLM keeps asleep): raise --megatron.tp or --megatron.pp, use "
            "--megatron.distributed_optimizer, --actor.gradient_checkpointing_enable or "
            "--megatron.sequence_parallel, lower --train.micro_batch_size or --data.max_len, or give the engines "
            "GPUs of their own (drop --train.colocate_all --vllm.enable_sleep --ds.enable_sleep; COLOCATE=0 in "
            "the recipes)")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    if any(a.dest == "megatron.gpu_memory_gb" for a in parser._actions):
        return
    g = parser.add_argument_group("Megatron colocated memory plan")
    g.add_argument("--megatron.gpu_memory_gb", type=float, default=GPU_MEMORY_GB,
                   help="memory of one GPU (GB = 1e9 bytes) for the colocated memory plan of --backend megatron "
                   "--train.colocate_all: a phase that does not fit stops the run and its --dry-run; 0 turns the "
                   "check off (default 80)")


def _validate(args: argparse.Namespace) -> None:
    if args.megatron.gpu_memory_gb < 0:
        raise FlagError(f"--megatron.gpu_memory_gb must be >= 0 (0: no check), got {args.megatron.gpu_memory_gb:g}")
    check_colocated_fit(args)


register_flag_group(FlagGroup(name="megatron-colocation-memory", add_arguments=_add_arguments, validate=_validate,
                              plan_lines=colocated_plan_lines, backend="megatron"))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m openrlhf_lpo.megatron.colocation_memory MODEL --tp 2 --dp 4``: each phase's memory per GPU (of
    the most loaded stage, then per node). ``python -m openrlhf_lpo.megatron.host_memory`` prints the host memory."""
    from openrlhf_lpo.megatron.memory import load_config, shape_parser

    ap = shape_parser(__doc__.splitlines()[0])
    ap.add_argument("--vllm-tp", type=int, default=1, help="--vllm.tensor_parallel_size")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="--vllm.gpu_memory_utilization")
    ap.add_argument("--gpu-memory-gb", type=float, default=GPU_MEMORY_GB, help="GPU memory, GB = 1e9 bytes")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="--actor.num_gpus_per_node")
    ap.add_argument("--no-save-hf", action="store_true", help="without --ckpt.save_hf")
    a = ap.parse_args(argv)
    hf = load_config(a.model)

    def phases(stage=None):
        return colocated_memory(hf, a.tp, a.pp, a.dp, a.tokens, a.actions, vllm_tp=a.vllm_tp,
                                gpu_memory_utilization=a.gpu_memory_utilization, gpu_memory_gb=a.gpu_memory_gb,
                                sequence_parallel=a.sp, recompute=not a.no_recompute, save_hf=not a.no_save_hf,
                                stage=stage)

    for name, rows in phases().items():
        print("\n".join(_phase_line(name, rows)))
    print("per node (GB per GPU of each phase):")
    for node, first, last, stages in node_layout(a.tp * a.pp * a.dp, a.gpus_per_node, a.tp, a.pp):
        per = [phases(s) for s in stages]
        print(f"  node {node} (ranks {first}-{last}, stages {','.join(map(str, stages))}): "
              + ", ".join(f"{ph} {max(p[ph]['total'] for p in per) / GB:.1f}" for ph in (GENERATION, TRAINING, SYNC,
                                                                                       SAVE)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
