"""A failure on a non-first rank of a Megatron model replica is an error in seconds.

A real local Ray cluster and two real OpenRLHF ``BaseModelActor`` ranks of one replica (tp*pp = 2) in a
gloo group. Rank 1 raises inside the batched ``forward`` while rank 0 waits in a gloo all-reduce for it
(as TP rank 0 waits for TP rank 3 after an OOM). ``MegatronActorGroup`` hands the experience maker one
ref per replica; before, that was rank 0's alone, so ``ray.get`` waited for the collective's timeout
(120 s here, 60 minutes in a run). Now the ref fails with rank 1's error within seconds. Unbatched calls
(``async_run_method``: ``fit``, ``broadcast_to_vllm``) return every rank's ref and ``ray.get`` of the list
raises at the first failure already; the second case guards that.
"""

import time
from datetime import timedelta

import pytest

pytestmark = pytest.mark.e2e  # a Ray cluster with a 2-rank Megatron group

GLOO_TIMEOUT_S = 120  # also the rendezvous limit: a Ray actor can take a minute to start on a loaded 2-core host


@pytest.fixture(scope="module")
def cluster():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _group(ray):
    from openrlhf.trainer.ray.launcher import BaseModelActor

    from openrlhf_lpo.megatron.ray_actor import MegatronActorGroup

    class Rank(BaseModelActor):
        def init_model_from_pretrained(self, fail_rank):
            import torch.distributed as dist

            from types import SimpleNamespace as NS

            dist.init_process_group("gloo", rank=self._rank, world_size=self._world_size,
                                    timeout=timedelta(seconds=GLOO_TIMEOUT_S))
            self.strategy = NS(is_rank_0=lambda: False)
            self.fail_rank = fail_rank

        def arm(self, fail_rank):
            self.fail_rank = fail_rank

        def forward(self, x):
            import torch
            import torch.distributed as dist

            if self._rank == self.fail_rank:
                raise RuntimeError(f"simulated CUDA out of memory on rank {self._rank}")
            t = torch.tensor([float(x)])
            dist.all_reduce(t)  # the TP/PP collective the failed rank never joins
            return float(t)

        def fit(self):
            return self.forward(1)

        def release(self):  # joins the collective a failed call left its peer waiting in
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1))

    remote = ray.remote(num_cpus=0)(Rank)
    first = remote.remote(2, 0, None, None)
    addr, port = ray.get(first.get_master_addr_port.remote())
    actors = [first, remote.remote(2, 1, addr, port)]
    group = MegatronActorGroup.__new__(MegatronActorGroup)
    group._actor_handlers = actors
    group.duplicate_actors = 2
    return group, actors


@pytest.fixture(scope="module")
def replica(cluster):
    """One replica's two ranks for both cases: after a case, the failed rank joins the collective its peer
    waits in (``release``), so the group is whole again."""
    group, actors = _group(cluster)
    cluster.get([a.init_model_from_pretrained.remote(fail_rank=-1) for a in actors])
    yield group, actors
    for a in actors:
        cluster.kill(a)


@pytest.mark.parametrize("call", ["batch", "all"])
def test_a_failure_on_rank_1_is_an_error_in_seconds(cluster, replica, call):
    """First (batched calls) the results of a healthy replica: rank 0's, after both ranks ran; then rank 1
    fails and the returned ref fails at once with its error."""
    import ray

    group, actors = replica
    cluster.get([a.arm.remote(-1) for a in actors], timeout=60)
    if call == "batch":
        refs = group.async_run_method_batch("forward", x=[1, 2])
        assert len(refs) == 1  # one replica, one result list (OpenRLHF's experience maker flattens it)
        assert cluster.get(refs, timeout=60) == [[2.0, 4.0]]
    else:
        assert cluster.get(group.async_run_method("fit"), timeout=60) == [2.0, 2.0]
    cluster.get([a.arm.remote(1) for a in actors])
    t = time.time()
    refs = group.async_run_method_batch("forward", x=[3]) if call == "batch" else group.async_run_method("fit")
    with pytest.raises(ray.exceptions.RayTaskError, match="simulated CUDA out of memory on rank 1"):
        cluster.get(refs, timeout=GLOO_TIMEOUT_S / 3)  # a timeout here (GetTimeoutError) is the old hang
    assert time.time() - t < GLOO_TIMEOUT_S / 3
    cluster.get(actors[1].release.remote(), timeout=60)  # rank 0's all-reduce completes: the group is whole
