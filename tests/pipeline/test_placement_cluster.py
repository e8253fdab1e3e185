"""Actor ranks are placed node-major on a multi-node Ray cluster (openrlhf_lpo/openrlhf/placement.py).

A simulated cluster (``ray.cluster_utils.Cluster``: one raylet per node, logical GPUs) runs upstream's
``RayActorGroup`` with the ``actor-group-placement`` swap active, as ``lpo-train`` does. Ray's PACK group puts
more than 16 bundles out of node order (ray-project/ray#51117), so without the swap rank ``r`` on bundle ``r``
splits TP groups across nodes. The stand-in actor class records the bundle each rank is started on; one
case starts real Ray actors and asks each where it runs. Where a bundle sits is read from Ray's own
``placement_group_table``.

The same cluster runs the colocated weight sync across two nodes (issue 43 item 4, ``COLOCATE=1`` on several
nodes): three actor ranks in a gloo world and three CPU rollout engines on the same three one-GPU bundles, two on
the head node and one on a grid node; every engine must receive every tensor bit for bit, through buckets whose
handles come only from the ranks of its own node (the CPU stand-in for CUDA IPC), in sequence order even when the
calls are sent in reverse.
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

    class Group(RayActorGroup):  # MegatronPolicyGroup takes these in its constructor (megatron/actor_group.py)
        pass

    if node_block:
        Group.node_block, Group.node_block_strict = node_block, strict
    recorder = actor_type or Recorder()
    with apply_patches():
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

    from ray.util.placement_group import remove_placement_group

    group, recorder = _group(3, 8, "mixed", duplicate_actors=8, node_block=8, strict=True)
    ranks = [0, 7, 8, 15, 16, 23]
    actors = [Where.options(resources={"mixed": 1}, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=recorder.starts[r][0], placement_group_bundle_index=recorder.starts[r][1])).remote()
        for r in ranks]
    try:
        assert ray.get([a.node.remote() for a in actors]) == [group.rank_nodes[r] for r in ranks]
        assert blocks_across_nodes(group.rank_nodes, 8) == []
    finally:  # the group's 24 GPUs back to the module's cluster (the head's 16 with them)
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(recorder.starts[0][0])


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


def test_colocated_weight_sync_hands_each_node_its_own_ranks_weights(multinode, tmp_path):
    """COLOCATE=1 on two nodes (openrlhf_lpo/megatron/weight_sync.py): ranks 0 and 2 on the head node, rank 1 on a
    grid node (a node's ranks need not be consecutive, nodes may differ in size), each with a CPU rollout engine on
    its one-GPU bundle. Two syncs through ``WeightSender.send_ipc`` with the shared-memory stand-in and 6000-byte
    buckets: each node's leader (its lowest rank) calls its node's engines once per bucket with its node's handles
    and no other; each engine loads every tensor of the second sync bit for bit (its model's parameters); the calls
    are numbered on from the first sync. Then rank 0 sends a third state to its engine with the calls in reverse
    order: the engine applies them in sequence order and holds that state exactly."""
    import socket

    import torch
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from safetensors.torch import load_file

    from openrlhf_lpo.engines.cpu_engine import RemoteCPURolloutEngine
    from openrlhf_lpo.testing.tiny import build_tiny_model

    ray = multinode
    model = build_tiny_model(tmp_path / "q3", arch="qwen3", hidden_size=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=16, intermediate_size=64)
    state = load_file(f"{model}/model.safetensors")
    head, grid = {"node:__internal_head__": 0.001}, {"grid": 1}
    pg = placement_group([{"GPU": 1, "CPU": 1, **head}, {"GPU": 1, "CPU": 1, **head}, {"GPU": 1, "CPU": 1, **grid}],
                         strategy="PACK")
    try:  # fails, not waits, if an earlier test still holds the head's GPUs
        ray.get(pg.ready(), timeout=120)
    except Exception:
        remove_placement_group(pg)
        raise
    bundle_of_rank = [0, 2, 1]  # ranks 0, 2 on the head; 1 on the grid node
    on = lambda b: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b)  # noqa: E731

    @ray.remote(num_cpus=0.1, num_gpus=0.2)
    class Rank:
        def __init__(self, rank, world, port, path):
            import torch.distributed as dist
            from safetensors.torch import load_file

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
            self.state = load_file(path)

        def sync(self, engines, scale, bucket_bytes):
            from openrlhf_lpo.megatron.weight_sync import SharedMemoryIPC, WeightSender, node_route

            if not hasattr(self, "route"):
                self.route, self.sender = node_route(), WeightSender()
            named = ((n, t * scale + 0.25) for n, t in self.state.items())  # the same stream on every rank
            info = self.sender.send_ipc(named, engines, SharedMemoryIPC(), self.route, bucket_bytes)
            return dict(info, ranks=self.route.ranks)

        def reversed_sync(self, engine, scale, bucket_bytes):
            """This rank's own handles to its own engine, the calls submitted last first."""
            from openrlhf_lpo.engines.buckets import bucketize
            from openrlhf_lpo.megatron.weight_sync import SharedMemoryIPC

            ipc = SharedMemoryIPC()
            buckets = list(bucketize(((n, t * scale + 0.25) for n, t in self.state.items()), bucket_bytes))
            base, n = self.sender.seq, len(buckets)
            refs = [engine.update_weight_bucket_ipc.remote(base + i, buckets[i].wire_metas(),
                                                           ipc_handles={ipc.device_id(): ipc.export(buckets[i].buffer)},
                                                           empty_cache=i == n - 1) for i in reversed(range(n))]
            return ray.get(refs)[::-1]

    def record_sources(engine):
        """Wraps the engine's bucket receiver: the device ids of the handles each call brought."""
        orig = engine._receive_bucket_ipc
        engine.sources = []

        def receive(metas, ipc_handles, empty_cache):
            engine.sources.append(sorted(ipc_handles))
            return orig(metas, ipc_handles, empty_cache)

        engine._receive_bucket_ipc = receive

    def report(engine):
        from openrlhf_lpo.engines.ipc import standin_device_id

        params = {n: p.detach().clone() for n, p in engine.backend.model.named_parameters()}
        return standin_device_id(), engine.sources, params, engine.weight_update_stats()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engines = [RemoteCPURolloutEngine.options(num_cpus=0.1, num_gpus=0.2, scheduling_strategy=on(b)).remote(model)
               for b in range(3)]
    ranks = [Rank.options(scheduling_strategy=on(bundle_of_rank[r])).remote(r, 3, port, f"{model}/model.safetensors")
             for r in range(3)]
    try:
        ray.get([e.__ray_call__.remote(record_sources) for e in engines])
        first = ray.get([r.sync.remote(engines, 2.0, 6000) for r in ranks])
        infos = ray.get([r.sync.remote(engines, -1.5, 6000) for r in ranks])
        reports = ray.get([e.__ray_call__.remote(report) for e in engines])
        table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        expect = {n: t * -1.5 + 0.25 for n, t in state.items()}
        buckets = infos[0]["buckets"]
        assert 2 < buckets < len(state) and infos[0]["tensors"] == len(state)
        head_node, grid_node = table[0], table[2]
        assert head_node != grid_node and table[1] == head_node
        assert [i["node"] for i in infos] == [head_node, grid_node, head_node]
        assert [i["ranks"] for i in infos] == [[0, 2], [1], [0, 2]]
        assert [i["engines"] for i in infos] == [2, 1, 0]  # each leader fed its node's engines
        assert [i["calls"] for i in infos] == [2 * buckets, buckets, 0]
        assert [i["seq"] for i in infos[:2]] == [2 * buckets] * 2 and [i["seq"] for i in first[:2]] == [buckets] * 2
        node_keys = {i["node"]: sorted(i["device_ids"]) for i in infos[:2]}
        assert [len(node_keys[head_node]), len(node_keys[grid_node])] == [2, 1]
        assert all(k.startswith(node) for node, keys in node_keys.items() for k in keys)
        for b, (own, sources, params, stats) in enumerate(reports):
            node = table[b]
            assert own in node_keys[node]  # the engine's device is one of its node's ranks'
            assert len(sources) == 2 * buckets and all(keys == node_keys[node] for keys in sources), (b, sources)
            assert stats["applied"] == stats["next_seq"] == 2 * buckets, (b, stats)
            assert sorted(params) == sorted(expect)
            assert all(params[n].dtype == t.dtype and torch.equal(params[n], t) for n, t in expect.items()), b
        # a deliberate reorder: rank 0 sends its engine (bundle 0) a third state, its calls submitted last first
        counts = ray.get(ranks[0].reversed_sync.remote(engines[0], 0.5, 6000))
        _, _, params, stats = ray.get(engines[0].__ray_call__.remote(report))
        assert counts[-1] == len(state) and counts == sorted(counts)  # taken in sequence order
        assert stats["applied"] == stats["next_seq"] == 3 * buckets and stats["out_of_order"] >= 1
        assert all(torch.equal(params[n], t * 0.5 + 0.25) for n, t in state.items())
    finally:
        for actor in ranks + engines:
            ray.kill(actor)
        remove_placement_group(pg)
