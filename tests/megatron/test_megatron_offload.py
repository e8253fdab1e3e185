"""HostOffload (openrlhf_lpo/megatron/offload.py) on plain torch objects: every byte comes back, views keep their
identity, the device keeps nothing in between. The megatron-core round trip (DDP buffers, the distributed
optimizer at TP2 and PP2) runs in the shared gloo world (tests/megatron/mcore_checks)."""

import torch

from openrlhf_lpo.megatron.offload import HostOffload


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
