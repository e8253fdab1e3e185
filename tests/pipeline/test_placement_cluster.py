"""Actor ranks are placed node-major on a multi-node Ray cluster (openrlhf_lpo/openrlhf/placement.py).

A simulated cluster (``ray.cluster_utils.Cluster``: one raylet per node, logical GPUs) runs upstream's
``RayActorGroup`` with the ``actor-group-placement`` swap active, as ``lpo-train`` does. Ray's PACK group puts
more than 16 bundles out of node order (ray-project/ray#51117), so without the swap rank ``r`` on bundle ``r``
splits TP groups across nodes. The stand-in actor class records the bundle each rank is started on; one
case starts real Ray actors and asks each where it runs. Where a bundle sits is read from Ray's own
``placement_group_table``.
"""

from __future__ import annotations

import pytest

from openrlhf_lpo.openrlhf.placement import (PlacementError, blocks_across_nodes, node_major_bundles,
                                             planned_layout, rank_ranges)

# 8 nodes of 8 GPUs tagged "grid"; the head (16 GPUs) and the first grid node also tagged "mixed" (8 + 16)
GRID_NODES, GRID_GPUS, HEAD_GPUS = 8, 8, 16


# ----------------------------------------------------------------------------------------------- pure
SCRAMBLED_32 = [2, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]


def test_node_major_order_of_rays_scrambled_32_bundles():
    """The bundle order a 32-bundle PACK group got on four free 8-GPU nodes (the review's measurement)."""
    table = {b: f"n{node}" for b, node in enumerate(SCRAMBLED_32)}
    assert len(blocks_across_nodes([table[b] for b in range(32)], 8)) == 4  # rank r on bundle r: all 4 TP8 split
    order = node_major_bundles(table)
    assert sorted(order) == list(range(32))
    nodes = [table[b] for b in order]
    assert nodes == ["n2"] * 8 + ["n3"] * 8 + ["n0"] * 8 + ["n1"] * 8  # node of bundle 0 first, then of bundle 1...
    assert [order[i] for i in (0, 1, 8, 9)] == [0, 9, 1, 2]  # within a node, ascending bundle index
    assert blocks_across_nodes(nodes, 8) == []
    assert rank_ranges(nodes) == [("n2", 0, 7), ("n3", 8, 15), ("n0", 16, 23), ("n1", 24, 31)]


def test_planned_layout_of_the_big_recipes():
    assert planned_layout(4, 8, tp=8, pp=4) == [f"node {n}: ranks {8 * n}-{8 * n + 7} = replica 0 stage {n} (TP 8 each)"
                                                for n in range(4)]
    assert planned_layout(2, 8, tp=8, pp=2)[1] == "node 1: ranks 8-15 = replica 0 stage 1 (TP 8 each)"
    assert planned_layout(1, 8, tp=4, pp=1) == ["node 0: ranks 0-7 = replica 0, replica 1 (TP 4 each)"]
    assert planned_layout(2, 4, tp=8) == ["node 0: ranks 0-3 = replica 0 (TP 8 each); a TP group SPANS nodes",
                                          "node 1: ranks 4-7 = replica 0 (TP 8 each); a TP group SPANS nodes"]
    assert planned_layout(2, 8) == ["node 0: ranks 0-7", "node 1: ranks 8-15"]


# ----------------------------------------------------------------------------------------- on a cluster
class Recorder:
    """Stand-in actor class: ``options(...).remote(world, rank, addr, port)`` records the placement group
    and bundle a rank is started on, without a process."""

    __name__ = "Recorder"

    def __init__(self):
        self.starts = {}

    def options(self, scheduling_strategy=None, **_):
        recorder = self

        class Start:
            @staticmethod
            def remote(world_size, rank, master_addr, master_port):
                recorder.starts[rank] = (scheduling_strategy.placement_group,
                                         scheduling_strategy.placement_group_bundle_index)
                return Handle()

        return Start()


class Handle:
    class get_master_addr_port:
        @staticmethod
        def remote():
            import ray

            return ray.put(("10.0.0.1", 29500))


@pytest.fixture(scope="module")
def multinode():
    import ray
    from ray.cluster_utils import Cluster

    from shared_ray import private_ray_tmpdir, remove_ray_tmpdir

    if ray.is_initialized():
        ray.shutdown()
    quiet = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
    with private_ray_tmpdir() as tmp:  # not recorded where other runs' plain ray.init() would join it
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": HEAD_GPUS, "num_gpus": HEAD_GPUS, "resources": {"mixed": HEAD_GPUS},
            "include_dashboard": False, "_system_config": quiet})
    for i in range(GRID_NODES):
        tags = {"grid": GRID_GPUS, **({"mixed": GRID_GPUS} if i == 0 else {})}
        cluster.add_node(num_cpus=GRID_GPUS, num_gpus=GRID_GPUS, resources=tags, wait=False)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield ray
    finally:
        ray.shutdown()
        with private_ray_tmpdir(tmp):
            cluster.shutdown()
        remove_ray_tmpdir(tmp)


def _group(num_nodes, gpus_per_node, tag, duplicate_actors=1, node_block=None, strict=False, actor_type=None):
    """Upstream's RayActorGroup with the patch points active (as lpo-train runs it)."""
    from openrlhf.trainer.ray.launcher import RayActorGroup

    from openrlhf_lpo.openrlhf.patches import apply_patches

    class Group(RayActorGroup):  # the Megatron policy group sets these in megatron/flags.py
        pass

    if node_block:
        Group.node_block, Group.node_block_strict = node_block, strict
    recorder = actor_type or Recorder()
    with apply_patches(lpo=True):
        group = Group(num_nodes, gpus_per_node, recorder, duplicate_actors=duplicate_actors,
                      resources={tag: 1}, num_resources_per_node=1)
    return group, recorder


def _rank_nodes(ray, recorder, world):
    """Each rank's node, from Ray's own table of the bundle it was started on."""
    assert sorted(recorder.starts) == list(range(world))
    pgs = {id(pg): pg for pg, _ in recorder.starts.values()}
    assert len(pgs) == 1
    table = ray.util.placement_group_table(next(iter(pgs.values())))["bundles_to_node_id"]
    bundles = [recorder.starts[r][1] for r in range(world)]
    assert sorted(bundles) == list(range(world))
    return [table[b] for b in bundles], [table[b] for b in range(world)]


# (name, nodes, GPUs per node, tag, TP block, PP, Megatron)
LAYOUTS = [
    ("DeepSpeed 2x8", 2, 8, "grid", 1, 1, False),
    ("DeepSpeed 4x8", 4, 8, "grid", 1, 1, False),
    ("DeepSpeed 8x8", 8, 8, "grid", 1, 1, False),
    ("DeepSpeed AutoTP4 8+16", 3, 8, "mixed", 4, 1, False),
    ("14B Megatron TP4 DP4 2x8", 2, 8, "grid", 4, 1, True),
    ("32B Megatron TP8 PP2 2x8", 2, 8, "grid", 8, 2, True),
    ("32B Megatron TP8 PP2 DP2 4x8", 4, 8, "grid", 8, 2, True),
    ("70B Megatron TP8 PP4 4x8", 4, 8, "grid", 8, 4, True),
    ("70B Megatron TP8 PP4 DP2 8x8", 8, 8, "grid", 8, 4, True),
    ("Megatron TP8 PP3 8+16", 3, 8, "mixed", 8, 3, True),
]


def test_every_layout_places_each_tp_group_on_one_node(multinode):
    """Every layout: ranks node-major, each TP group on one node, each node a run of consecutive ranks; the
    layouts over 16 GPUs would have split TP groups with upstream's rank r on bundle r."""
    from ray.util.placement_group import remove_placement_group

    upstream_split = {}
    for name, nodes, gpn, tag, tp, pp, megatron in LAYOUTS:
        world = nodes * gpn
        group, recorder = _group(nodes, gpn, tag, duplicate_actors=tp * pp if megatron else tp,
                                 node_block=tp if megatron else None, strict=megatron)
        rank_nodes, bundle_order_nodes = _rank_nodes(multinode, recorder, world)
        assert group.rank_nodes == rank_nodes, name
        runs = rank_ranges(rank_nodes)
        assert len(runs) == len(set(rank_nodes)), (name, runs)  # node-major: one run of ranks per node
        assert blocks_across_nodes(rank_nodes, tp) == [], (name, runs)
        if tag == "mixed":
            assert sorted(hi - lo + 1 for _, lo, hi in runs) == [8, 16], (name, runs)
        else:
            assert [hi - lo + 1 for _, lo, hi in runs] == [gpn] * nodes, (name, runs)
        if megatron:  # a replica's pipeline stages: its TP groups, each on one node
            for replica in range(world // (tp * pp)):
                for stage in range(pp):
                    first = replica * tp * pp + stage * tp
                    assert len(set(rank_nodes[first:first + tp])) == 1
        upstream_split[name] = len(blocks_across_nodes(bundle_order_nodes, max(tp, 8)))
        remove_placement_group(next(iter(recorder.starts.values()))[0])
    # the measured failure: Ray's order splits every TP8 group of the 70B layout; at 16 bundles it holds
    assert upstream_split["70B Megatron TP8 PP4 4x8"] == 4
    assert upstream_split["32B Megatron TP8 PP2 2x8"] == 0


def test_a_fragmented_cluster_stops_a_megatron_group_before_any_actor_starts(multinode):
    """Half of every grid node is taken: a 16-rank TP8 group can only get 4 GPUs per node. The Megatron group
    raises naming the block and the nodes before any actor starts, and gives its bundles back; a DeepSpeed
    group with the same blocks warns and starts."""
    from ray.util.placement_group import placement_group, remove_placement_group

    squatter = placement_group([{"GPU": 4, "CPU": 4, "grid": 4}] * GRID_NODES, strategy="STRICT_SPREAD")
    multinode.get(squatter.ready())
    try:
        recorder = Recorder()
        with pytest.raises(PlacementError, match=r"8-rank block 0-7 on nodes .*GPUs per node a multiple of the TP"):
            _group(2, 8, "grid", duplicate_actors=8, node_block=8, strict=True, actor_type=recorder)
        assert recorder.starts == {}
        live = [t for t in multinode.util.placement_group_table().values() if t["state"] != "REMOVED"]
        assert len(live) == 1 and live[0]["placement_group_id"] == squatter.id.hex()
        group, recorder = _group(2, 8, "grid", duplicate_actors=8)
        rank_nodes, _ = _rank_nodes(multinode, recorder, 16)
        assert len(blocks_across_nodes(rank_nodes, 8)) == 2  # started, with the warning
        assert [hi - lo + 1 for _, lo, hi in rank_ranges(rank_nodes)] == [4, 4, 4, 4]
        remove_placement_group(next(iter(recorder.starts.values()))[0])
    finally:
        remove_placement_group(squatter)


def test_real_actors_run_on_the_node_their_rank_was_given(multinode):
    """A 24-rank group on 8 + 16 GPUs: real Ray actors started as ``RayActorGroup`` starts rank r (its placement
    group, the bundle the swap gave r) report the node the group planned, at the ends of every TP8 block."""
    ray = multinode
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1, num_gpus=1)
    class Where:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    group, recorder = _group(3, 8, "mixed", duplicate_actors=8, node_block=8, strict=True)
    ranks = [0, 7, 8, 15, 16, 23]
    actors = [Where.options(resources={"mixed": 1}, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=recorder.starts[r][0], placement_group_bundle_index=recorder.starts[r][1])).remote()
        for r in ranks]
    assert ray.get([a.node.remote() for a in actors]) == [group.rank_nodes[r] for r in ranks]
    assert blocks_across_nodes(group.rank_nodes, 8) == []
    for actor in actors:
        ray.kill(actor)


def test_the_optimizer_build_check_asks_every_gpu_node(multinode):
    """lpo-train's start-up check of DeepSpeed's optimizer build (cli/gpu_build.py) runs one task on each of the
    9 nodes and hears from every one; each reports what this process sees of the same machine."""
    from openrlhf_lpo.cli import gpu_build

    facts, missing = gpu_build.gather_cluster(timeout_s=120)
    assert missing == [] and len(facts) == GRID_NODES + 1
    here = gpu_build.gather_facts()
    fields = ("host", "nvidia_gpus", "which", "nvcc_text", "torch_version", "torch_cuda", "ds_version", "ds_built")
    for node, f in facts.items():
        assert {k: getattr(f, k) for k in fields} == {k: getattr(here, k) for k in fields}, node
