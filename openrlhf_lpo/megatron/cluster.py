"""Cluster checks of a Megatron run: does the layout fit the Ray cluster, do TP groups stay in a node?

* :func:`plan_placement` -- pure: the GPU blocks a run needs (each Megatron tensor-parallel group
  on one node, each vLLM engine's ``--vllm.tensor_parallel_size`` GPUs on one node, single GPUs for
  the DeepSpeed reference model) packed first-fit-decreasing onto the nodes' GPU counts; raises
  :class:`PlacementError` naming what is needed and what is there when they do not fit.
* :func:`check_ray_cluster` -- the same against the live cluster (``ray.nodes()`` /
  ``ray.cluster_resources()``); ``lpo-train --backend megatron`` runs it before any actor starts,
  so a layout that cannot be placed fails in seconds instead of waiting on a placement group.
* :func:`check_tp_groups_within_nodes` -- at actor start-up, collective: every rank reports its
  node and each group of ``tp`` consecutive ranks (megatron order ``tp-cp-ep-pp-dp``) must share
  one node, since tensor parallelism all-reduces every layer over NVLink, not the network.

``python -m openrlhf_lpo.megatron.cluster <lpo-train flags>`` prints the plan against the running
cluster (exit status 2 when it does not fit).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


class PlacementError(ValueError):
    """The layout cannot be placed on the cluster; the message names the numbers."""


@dataclass(frozen=True)
class Demand:
    role: str  # e.g. "megatron actor TP group"
    gpus: int  # GPUs that must share one node
    count: int  # how many such blocks


def demands_from_args(args) -> List[Demand]:
    """GPU blocks of a parsed ``lpo-train --backend megatron`` run (hierarchised namespace)."""
    import math

    m, actor = args.megatron, args.actor
    world = actor.num_nodes * actor.num_gpus_per_node
    vllm = getattr(args, "vllm", None)
    engines = (vllm.num_engines or 0) if vllm is not None else 0
    train = getattr(args, "train", None)
    if engines and getattr(train, "colocate_all", False) and not getattr(train, "async_enable", False):
        # colocated: the engines run on the actor's GPUs (OpenRLHF's shared placement group, engine i on its
        # bundles i*vllm_tp..., node-ordered), so the blocks that must share a node are the actor's TP groups and
        # the engines' GPUs together: lcm(tp, vllm_tp) consecutive GPUs
        block = math.lcm(m.tp, vllm.tensor_parallel_size)
        out = [Demand("Megatron actor TP group with its colocated vLLM engine(s)", block, world // block)]
    else:
        out = [Demand("Megatron actor TP group", m.tp, world // m.tp)]
        if engines:
            out.append(Demand("vLLM engine", vllm.tensor_parallel_size, engines))
    kl = getattr(getattr(args, "algo", None), "kl", None)
    shared = getattr(train, "colocate_actor_ref", False) or getattr(train, "colocate_all", False)
    if kl is not None and kl.init_coef > 0 and not shared:  # colocated: the reference sits on the actor's GPUs
        out.append(Demand("DeepSpeed reference model GPU", 1, args.ref.num_nodes * args.ref.num_gpus_per_node))
    return out


def plan_placement(node_gpus: Sequence[float], demands: Sequence[Demand]) -> List[List[Tuple[str, int]]]:
    """Place every block on a node with enough free GPUs (largest blocks first).

    Returns, per node, the ``(role, gpus)`` blocks placed there; raises :class:`PlacementError`."""
    free = [int(g) for g in node_gpus]
    placed: List[List[Tuple[str, int]]] = [[] for _ in free]
    blocks = sorted(((d.gpus, d.role) for d in demands for _ in range(d.count)), key=lambda b: -b[0])
    need = sum(g for g, _ in blocks)
    for gpus, role in blocks:
        fits = [i for i, f in enumerate(free) if f >= gpus]
        if not fits:
            summary = ", ".join(f"{d.count} x {d.role} of {d.gpus} GPU(s)" for d in demands)
            raise PlacementError(
                f"cannot place the run on this Ray cluster: it needs {need} GPUs ({summary}), each block on one "
                f"node, and the cluster's nodes have {[int(g) for g in node_gpus]} GPUs "
                f"(no node has {gpus} free GPUs left for a {role}). Use a smaller --megatron.tp or "
                "--vllm.tensor_parallel_size, fewer --vllm.num_engines, or a larger cluster."
            )
        best = min(fits, key=lambda i: free[i])  # tightest fit keeps big gaps for big blocks
        free[best] -= gpus
        placed[best].append((role, gpus))
    return placed


def _alive_node_gpus(nodes: Sequence[dict]) -> List[float]:
    return [float(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", n.get("alive", True))]


def check_ray_cluster(args, nodes: Optional[Sequence[dict]] = None) -> List[List[Tuple[str, int]]]:
    """:func:`plan_placement` against the running Ray cluster (``ray`` must be initialised)."""
    import ray

    if nodes is None:
        nodes = ray.nodes()
    node_gpus = _alive_node_gpus(nodes)
    total = float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else sum(node_gpus)
    if total < sum(node_gpus):  # a node listed but not offering its GPUs to the cluster
        node_gpus = [min(g, total) for g in node_gpus]
    return plan_placement(node_gpus, demands_from_args(args))


def node_identity() -> str:
    """This process's node: ``LPO_NODE_ID``, else the Ray node id, else the hostname."""
    env = os.environ.get("LPO_NODE_ID")
    if env:
        return env
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - no Ray here: the hostname names the node
        pass
    return socket.gethostname()


def tp_groups_spanning_nodes(node_of_rank: Sequence[str], tp: int) -> List[Tuple[List[int], List[str]]]:
    """Groups of ``tp`` consecutive ranks that sit on more than one node (pure)."""
    bad = []
    for start in range(0, len(node_of_rank), tp):
        ranks = list(range(start, min(start + tp, len(node_of_rank))))
        nodes = sorted({node_of_rank[r] for r in ranks})
        if len(nodes) > 1:
            bad.append((ranks, nodes))
    return bad


def check_tp_groups_within_nodes(tp: int, group=None) -> None:
    """Collective over ``group`` (default: world): raise if a TP group spans nodes."""
    import torch.distributed as dist

    if tp <= 1:
        return
    nodes: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, node_identity(), group=group)
    bad = tp_groups_spanning_nodes(nodes, tp)
    if bad:
        ranks, where = bad[0]
        raise PlacementError(
            f"--megatron.tp {tp}: the tensor-parallel group of ranks {ranks} spans nodes {where} "
            f"({len(bad)} such group(s)); TP groups must stay inside one node. Use --megatron.tp <= "
            "--actor.num_gpus_per_node with num_gpus_per_node % tp == 0, and a cluster whose nodes hold whole "
            "actor bundles (Ray placed the actor's GPUs across nodes)."
        )


def main(argv: Optional[List[str]] = None) -> int:
    """Check ``lpo-train`` flags against the running Ray cluster (``RAY_ADDRESS`` or a local one)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m openrlhf_lpo.megatron.cluster <lpo-train flags>  (checks the placement)")
        return 0
    p = argparse.ArgumentParser(add_help=False)
    for flag, typ, default in (("--actor.num_nodes", int, 1), ("--actor.num_gpus_per_node", int, 8),
                               ("--ref.num_nodes", int, 1), ("--ref.num_gpus_per_node", int, 8),
                               ("--vllm.num_engines", int, 0), ("--vllm.tensor_parallel_size", int, 1),
                               ("--megatron.tp", int, 1), ("--megatron.pp", int, 1), ("--algo.kl.init_coef", float, 0.0)):
        p.add_argument(flag, type=typ, default=default)
    p.add_argument("--train.colocate_actor_ref", action="store_true")
    flat, _ = p.parse_known_args(argv)
    args = _hierarchise(vars(flat))
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR")
    try:
        placed = check_ray_cluster(args)
    except PlacementError as e:
        print(f"[cluster] {e}", file=sys.stderr)
        return 2
    finally:
        if started:
            ray.shutdown()
    for i, blocks in enumerate(placed):
        print(f"[cluster] node {i}: " + (", ".join(f"{r} ({g} GPU)" for r, g in blocks) or "unused"))
    return 0


def _hierarchise(flat: Dict[str, object]):
    from types import SimpleNamespace

    root = SimpleNamespace()
    for key, value in flat.items():
        node = root
        parts = key.split(".")
        for part in parts[:-1]:
            if not hasattr(node, part):
                setattr(node, part, SimpleNamespace())
            node = getattr(node, part)
        setattr(node, parts[-1], value)
    return root


if __name__ == "__main__":
    raise SystemExit(main())
