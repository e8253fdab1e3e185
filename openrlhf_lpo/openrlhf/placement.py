"""Node-major ranks for OpenRLHF's model actor groups (policy, reference, critic, reward).

OpenRLHF 0.11.2's ``RayActorGroup`` gives rank ``r`` bundle ``r`` of a ``PACK`` placement group. Ray does
not keep bundle indices node-contiguous (ray-project/ray#51117, #59547): its PACK policy sorts the bundles
with an unstable sort first, which leaves up to 16 equal bundles alone and reorders more. On four free
8-GPU nodes, 32 bundles land on nodes ``0 1 1 1 1 1 1 1 | 1 0 0 0 0 0 0 0 | 2 3 3 ...``, so every block of
8 consecutive ranks (a TP8 group) spans two nodes. Upstream already sorts bundles by node for its vLLM
engines (``get_bundle_indices``); this module does the same for the actor groups.

* :func:`node_major_bundles` -- pure: bundle indices in rank order, nodes in the order of their lowest
  bundle and each node's bundles ascending (the order upstream gives vLLM engines, so in a colocated run
  actor rank ``r`` and the engines' ``r``-th bundle are one GPU).
* :func:`blocks_across_nodes` -- pure: the rank blocks (TP groups) that still span nodes.
* :func:`node_major_initiate_actors` -- builds the ``RayActorGroup._initiate_actors`` swap (patch point
  ``actor-group-placement``) around upstream's: makes the PACK group as upstream does, reads where Ray put
  each bundle, and starts upstream's actors with rank ``r`` on the ``r``-th bundle in node-major order. A group with
  ``node_block_strict`` (the Megatron policy: ``node_block = tp``) raises :class:`PlacementError` before
  any actor starts when a block cannot sit on one node; other groups print a warning.
* :func:`planned_layout` -- pure: the rank-to-node map ``lpo-train --dry-run`` prints.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["PlacementError", "node_major_bundles", "blocks_across_nodes", "node_major_initiate_actors",
           "planned_layout", "rank_ranges"]


class PlacementError(ValueError):
    """A group's rank blocks cannot each sit on one node; the message names the nodes and counts."""


def node_major_bundles(bundle_nodes: Mapping[int, str]) -> List[int]:
    """Bundle indices in rank order: node by node (nodes ordered by their lowest bundle index)."""
    first: Dict[str, int] = {}
    for bundle in sorted(bundle_nodes):
        first.setdefault(bundle_nodes[bundle], bundle)
    return sorted(bundle_nodes, key=lambda b: (first[bundle_nodes[b]], b))


def blocks_across_nodes(rank_nodes: Sequence[str], block: int) -> List[Tuple[List[int], List[str]]]:
    """``(ranks, nodes)`` of every block of ``block`` consecutive ranks that sits on more than one node."""
    bad = []
    for start in range(0, len(rank_nodes), max(block, 1)):
        ranks = list(range(start, min(start + block, len(rank_nodes))))
        nodes = sorted({rank_nodes[r] for r in ranks})
        if len(nodes) > 1:
            bad.append((ranks, nodes))
    return bad


def rank_ranges(rank_nodes: Sequence[str]) -> List[Tuple[str, int, int]]:
    """``(node, first rank, last rank)`` runs of consecutive ranks on one node."""
    runs: List[Tuple[str, int, int]] = []
    for rank, node in enumerate(rank_nodes):
        if runs and runs[-1][0] == node and runs[-1][2] == rank - 1:
            runs[-1] = (node, runs[-1][1], rank)
        else:
            runs.append((node, rank, rank))
    return runs


def _describe(rank_nodes: Sequence[str]) -> str:
    names: Dict[str, int] = {}
    parts = []
    for node, lo, hi in rank_ranges(rank_nodes):
        label = names.setdefault(node, len(names))
        parts.append(f"node {label} ({node[:8]}): ranks {lo}-{hi}" if hi > lo else f"node {label} ({node[:8]}): rank {lo}")
    return "; ".join(parts)


def _bundle_nodes(pg) -> Dict[int, str]:
    import ray

    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return {int(b): str(n) for b, n in table.items()}


def _pack_group(world: int, resources: Optional[dict], per_node: Optional[int]):
    """A PACK group of ``world`` single-GPU bundles, as ``RayActorGroup`` makes it when given none."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"GPU": 1, "CPU": 1}
    if resources:
        bundle[next(iter(resources))] = per_node
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    ray.get(pg.ready())
    return pg


@contextlib.contextmanager
def _bundles_in_rank_order(launcher, pg, order: Sequence[int]):
    """Inside, ``launcher.PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r)``
    means bundle ``order[r]``."""
    strategy = launcher.PlacementGroupSchedulingStrategy

    def remapped(*args, **kwargs):
        if kwargs.get("placement_group") is pg and kwargs.get("placement_group_bundle_index", -1) >= 0:
            kwargs["placement_group_bundle_index"] = order[kwargs["placement_group_bundle_index"]]
        return strategy(*args, **kwargs)

    launcher.PlacementGroupSchedulingStrategy = remapped
    try:
        yield
    finally:
        launcher.PlacementGroupSchedulingStrategy = strategy


def node_major_initiate_actors(original):
    """``RayActorGroup._initiate_actors`` around upstream's ``original``: rank ``r`` on the ``r``-th bundle in
    node-major order (see :func:`initiate_actors`)."""

    def _initiate_actors(self, pg, num_gpus_per_actor):
        return initiate_actors(self, pg, num_gpus_per_actor, original)

    _initiate_actors.__wrapped__ = original
    _initiate_actors.__qualname__ = "RayActorGroup._initiate_actors"
    return _initiate_actors


def initiate_actors(self, pg, num_gpus_per_actor, original):
    """Start the group's actors through upstream's ``original(self, pg, num_gpus_per_actor)`` with rank ``r`` on the
    ``r``-th bundle of ``pg`` in node-major order.

    Sets ``self.rank_bundles`` and ``self.rank_nodes``. A group class may declare ``node_block``, the rank block
    that must share a node (default ``duplicate_actors``), and ``node_block_strict``, which makes a split block an
    error before any actor starts (the Megatron policy group takes both from its layout in its constructor:
    megatron/actor_group.py ``MegatronPolicyGroup``; upstream's groups have neither)."""
    from openrlhf.trainer.ray import launcher

    world = self._num_nodes * self._num_gpus_per_node
    own = pg is None and self._num_gpus_per_node > 1
    if own:
        pg = _pack_group(world, self._resources, self._num_resources_per_node)
    if pg is None:  # one GPU per node: every actor is its own block
        self.rank_bundles, self.rank_nodes = None, None
        return original(self, pg, num_gpus_per_actor)
    bundle_nodes = _bundle_nodes(pg)
    order = node_major_bundles(bundle_nodes)[:world]
    self.rank_bundles = order
    self.rank_nodes = [bundle_nodes[b] for b in order]
    block = int(getattr(self, "node_block", 0) or self.duplicate_actors or 1)
    meta = getattr(self.ray_actor_type, "__ray_metadata__", None)
    name = getattr(meta, "class_name", None) or getattr(self.ray_actor_type, "__name__", "actor group")
    bad = blocks_across_nodes(self.rank_nodes, block)
    if bad:
        ranks, nodes = bad[0]
        message = (f"{name}: the placement group put the {block}-rank block {ranks[0]}-{ranks[-1]} on nodes "
                   f"{[n[:8] for n in nodes]} ({len(bad)} such block(s)); Ray placed the group as "
                   f"{_describe(self.rank_nodes)}. Give every node a multiple of {block} free GPUs for this "
                   "group (GPUs per node a multiple of the TP size; no other actors holding part of a node)")
        if getattr(self, "node_block_strict", False):
            if own:  # its GPUs go back to the cluster
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            raise PlacementError(message)
        print(f"[placement] warning: {message}", file=sys.stderr, flush=True)
    print(f"[placement] {name}: {_describe(self.rank_nodes)}", file=sys.stderr, flush=True)
    with _bundles_in_rank_order(launcher, pg, order):
        return original(self, pg, num_gpus_per_actor)


def planned_layout(num_nodes: int, gpus_per_node: int, tp: int = 1, pp: int = 1) -> List[str]:
    """The node-major rank map of one actor group, a line per node: the ranks, and for a model-parallel
    layout (megatron order ``tp-cp-ep-pp-dp``) the (replica, pipeline stage) of each TP group on it."""
    lines = []
    mp = tp * pp
    for node in range(num_nodes):
        lo, hi = node * gpus_per_node, (node + 1) * gpus_per_node - 1
        text = f"node {node}: ranks {lo}-{hi}" if hi > lo else f"node {node}: rank {lo}"
        if mp > 1:
            groups = range(lo // tp, hi // tp + 1)
            split = lo % tp or (hi + 1) % tp
            text += " = " + ", ".join(f"replica {g // pp}" + (f" stage {g % pp}" if pp > 1 else "") for g in groups) \
                + f" (TP {tp} each)" + ("; a TP group SPANS nodes" if split else "")
        lines.append(text)
    return lines
