"""HostOffload (openrlhf_lpo/megatron/offload.py) on plain torch objects: every byte comes back, views keep their
identity, the device keeps nothing in between; gradients dropped and zeroed on the way back; the host pool's size
is constant over sleep/wake cycles, made of power-of-two slabs, and equal to the regions' bytes rounded up to 4 KiB;
an offloaded tensor reads bit for bit from host memory. The megatron-core round trip (DDP buffers, the distributed
optimizer at TP2 and PP2, the Ray actor's sleep and its checkpoint save from host memory) runs in the shared gloo
world (tests/megatron/mcore_checks/offload.py)."""

import torch

from openrlhf_lpo.megatron.offload import HostOffload, HostPool


def _model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.register_buffer("flat", torch.randn(32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):  # Adam state exists after a step
        opt.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
    return model, opt


def _snapshot(model, opt):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
    for i, s in enumerate(opt.state.values()):
        state.update({f"opt{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return state


def test_round_trip_is_bit_exact_and_frees_the_device():
    model, opt = _model_and_adam()
    view = model[0].weight[1:3]  # a view shares its parameter's storage: tracked once, restored with it
    before, params = _snapshot(model, opt), [p for p in model.parameters()]
    off = HostOffload([model], [opt])
    total = off.tracked_bytes()
    expected = sum(t.untyped_storage().nbytes() for t in before.values())  # each cloned tensor owns its storage
    assert total == expected == off.resident_bytes()
    assert off.offload() == total and off.offloaded
    assert off.resident_bytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(v["exp_avg"].untyped_storage().nbytes() == 0 for v in opt.state.values())
    assert off.onload() == total and not off.offloaded and off.resident_bytes() == total
    after = _snapshot(model, opt)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    assert [p for p in model.parameters()] == params and torch.equal(view, model[0].weight[1:3])


def test_training_after_a_round_trip_equals_training_without_one():
    (a, opt_a), (b, opt_b) = _model_and_adam(), _model_and_adam()
    off = HostOffload([b], [opt_b])
    off.offload()
    off.onload()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_misuse_is_refused():
    import pytest

    model, opt = _model_and_adam()
    off = HostOffload([model], [opt])
    with pytest.raises(RuntimeError, match="nothing is offloaded"):
        off.onload()
    off.offload()
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    off.onload()


def test_gradients_are_dropped_and_come_back_zeroed():
    model, opt = _model_and_adam()
    before = _snapshot(model, opt)
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    off = HostOffload([model], [opt], discard=lambda where: where.endswith(".grad"))
    assert off.dropped_bytes() == grads > 0
    assert off.offload() == off.tracked_bytes() - grads and off.resident_bytes() == 0
    assert off.onload() == off.tracked_bytes() - grads
    after = _snapshot(model, opt)
    for k in before:
        assert torch.equal(after[k], torch.zeros_like(before[k]) if k.startswith("grad.") else before[k]), k


def _round_up(n, m):
    return -(-n // m) * m


def test_the_pool_is_reused_and_sized_as_planned():
    """Three sleep/wake cycles before the first optimizer step (no Adam state), three after: the pool grows once,
    when the moments appear, and is then the same slabs every cycle, each a power of two, in all the regions' bytes
    (64-byte aligned) rounded up to 4096."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 37), torch.nn.Linear(37, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pool = HostPool()

    def cycle():
        off = HostOffload([model], [opt], pool=pool)
        off.offload()
        ids = [s.data_ptr() for s in pool._slabs]
        off.onload()
        return pool.nbytes(), ids

    def planned():  # by hand, in the order the regions are made: each starts at the next multiple of 64
        params = list(model.parameters())
        end = 0
        for n in [t.untyped_storage().nbytes() for t in params + [p.grad for p in params if p.grad is not None]
                  + [v for st in opt.state.values() for v in st.values()]]:
            end = _round_up(end, 64) + n
        return _round_up(end, 4096)

    first = [cycle() for _ in range(3)]
    assert len(set(map(str, first))) == 1 and first[0][0] == planned()
    model(torch.randn(4, 100)).sum().backward()
    opt.step()  # gradients, and Adam state: two moments per parameter and a step counter
    second = [cycle() for _ in range(3)]
    assert len(set(map(str, second))) == 1 and second[0][0] == planned() > first[0][0]
    assert second[0][1][: len(first[0][1])] == first[0][1]  # the old slabs stay; new ones were added
    assert all(n & (n - 1) == 0 and n >= 4096 for n in pool.slab_sizes())
    assert HostPool.planned_bytes([100, 1, 64]) == 4096 and HostPool.planned_bytes([4096, 1]) == 8192


def test_an_offloaded_tensor_reads_from_host_memory():
    """host_view: every tensor, views and optimizer state included, reads bit for bit while offloaded, also when its
    region spans two slabs (a pool grown in two steps); a dropped gradient has nothing to read."""
    import pytest

    model, opt = _model_and_adam()
    pool = HostPool()
    pool.region(-1, 3900)  # a first region in a 4096-byte slab: the first weight's 512 bytes straddle its end
    off = HostOffload([model], [opt], discard=lambda where: where.endswith(".grad"), pool=pool)
    view = model[0].weight[1:3, ::2]
    tensors = {"view": view} | {n: p for n, p in model.named_parameters()} | {
        f"opt{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    want = {k: t.clone() for k, t in tensors.items()}
    assert off.host_view(view) is None  # not offloaded yet
    off.offload()
    bounds = pool._starts[1:]
    assert any(a < b < a + n for a, n in pool._regions.values() for b in bounds)  # a region spans two slabs
    got = {k: off.host_view(t) for k, t in tensors.items()}
    for k, g in got.items():
        assert g.device.type == "cpu" and g.stride() == tensors[k].stride() and torch.equal(g, want[k]), k
    with pytest.raises(ValueError, match="dropped on offload"):
        off.host_view(model[0].weight.grad)
    assert off.host_view(torch.zeros(3)) is None  # not tracked
    off.onload()
