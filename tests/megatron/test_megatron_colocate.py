"""``--backend megatron`` colocated with the rollout engines (issue 32): the flags are accepted (and the flags that
still mean nothing are refused naming themselves), the dry run passes, and the shared-memory stand-in for CUDA
IPC crosses processes: a handle made in another process is rebuilt bit for bit, and the CPU rollout engine's
``update_weight_bucket_ipc`` loads the sender's weights from bucket handles keyed by its device, in sequence order
whatever order the calls come in (issue 43 item 5: buckets, :mod:`openrlhf_lpo.engines.buckets`; order,
:mod:`openrlhf_lpo.engines.weight_updates`).

The Megatron side of the route (TP2 / PP2 export through IPC vs the NCCL route) runs in the shared gloo world
(``mcore_checks/weight_ipc.py``); the real trainer loop with sleep and the IPC sync in the CPU pipeline e2e
(``test_megatron_pipeline_e2e.py``)."""

import asyncio
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from openrlhf_lpo.megatron.weight_sync import SharedMemoryIPC, standin_device_id, transport_for

from .flag_args import flag_argv


def _argv(d, *extra):
    return flag_argv(d, "--backend", "megatron", *extra)


COLOCATED = ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"]


def _parse(argv):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    return build_parser_and_parse(argv)


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("layout", [["--vllm.num_engines", "4"],
                                    ["--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "2",
                                     "--megatron.tp", "2"],
                                    ["--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "4",
                                     "--megatron.pp", "2"]])
def test_colocation_with_sleep_is_accepted(tiny_dir, layout):
    """The DeepSpeed hybrid-engine flags work on megatron unchanged (vLLM TP may differ from Megatron TP)."""
    from openrlhf_lpo.megatron.ray_actor import colocated

    from openrlhf_lpo.megatron.weight_sync import bucket_bytes_of

    a = _parse(_argv(tiny_dir, *layout, *COLOCATED))
    assert a.train.colocate_all and a.vllm.enable_sleep and a.ds.enable_sleep and colocated(a)
    assert bucket_bytes_of(a) == 512 << 20  # --megatron.sync_bucket_mb's default
    a.megatron.sync_bucket_mb = 0.5
    assert bucket_bytes_of(a) == 1 << 19
    # async runs colocate the trained models only (OpenRLHF): the engines keep the NCCL stream
    b = _parse(_argv(tiny_dir, *layout, "--train.colocate_all", "--train.async_enable"))
    assert b.train.colocate_all and not colocated(b)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--vllm.num_engines", "1", "--ds.enable_sleep"],
         "--ds.enable_sleep without --train.colocate_all: with --backend megatron it offloads the actor"),
        (["--vllm.num_engines", "2", *COLOCATED],
         "--vllm.num_engines 2 x --vllm.tensor_parallel_size 1 = 2 must equal the actor's 4 GPUs"),
        (["--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "8", "--actor.num_nodes", "2",
          "--actor.num_gpus_per_node", "4", *COLOCATED],
         "--vllm.tensor_parallel_size 8 must divide --actor.num_gpus_per_node 4"),
    ],
)
def test_what_colocation_cannot_mean_is_refused_naming_the_flag(tiny_dir, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        _parse(_argv(tiny_dir, *extra))
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_dry_run_of_a_colocated_sleeping_run_passes(tiny_dir, tmp_path, capsys):
    from openrlhf_lpo.cli.train_ppo_ray import main

    data = tmp_path / "math.jsonl"
    data.write_text("".join('{"prompt": "p", "label": "1"}\n' for _ in range(16)))
    argv = _argv(tiny_dir, "--vllm.num_engines", "4", *COLOCATED, "--data.prompt_dataset", str(data),
                 "--data.input_key", "prompt", "--data.label_key", "label", "--data.max_len", "256",
                 "--rollout.max_new_tokens", "128", "--dry-run")
    main(argv)
    out = capsys.readouterr().out
    assert "megatron actor, TP 1 x PP 1 x DP 4" in out


# ----------------------------------------------------------------------------- buckets and their order


def test_buckets_pack_small_tensors_in_stream_order_and_send_large_ones_alone():
    """The greedy rule by hand: a 300-byte bucket, offsets aligned to 256 bytes. 40 + 24 bytes share one bucket
    (the second at 256); 400 bytes go alone as their own bytes (no copy); a 40-byte int tensor and a transposed
    (non-contiguous) 16-byte view share the next; 280 bytes do not fit after them and close it. Unpacked, every
    tensor equals the original bit for bit with its dtype and shape; planning without data gives the same buckets."""
    from openrlhf_lpo.engines.buckets import ALIGN, bucketize, plan_buckets, unpack

    g = torch.Generator().manual_seed(0)
    big = torch.randn(100, generator=g)
    stream = [("a", torch.randn(10, generator=g)), ("b", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
              ("big", big), ("c", torch.arange(5)), ("d", torch.randn(2, 2, generator=g).t()),
              ("e", torch.randn(70, generator=g))]
    buckets = list(bucketize(stream, 300))
    assert ALIGN == 256
    assert [[(m.name, m.offset) for m in b.metas] for b in buckets] == \
        [[("a", 0), ("b", 256)], [("big", 0)], [("c", 0), ("d", 256)], [("e", 0)]]
    assert [b.alone for b in buckets] == [False, True, False, False]
    assert [b.buffer.numel() for b in buckets] == [256 + 24, 400, 256 + 16, 280]
    assert buckets[1].buffer.data_ptr() == big.data_ptr()  # alone: the tensor's own bytes
    got = [item for b in buckets for item in unpack(b.buffer, b.wire_metas())]
    assert [n for n, _ in got] == [n for n, _ in stream]
    for (_, t), (_, ref) in zip(got, stream):
        assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref)
    assert plan_buckets([(n, t.dtype, t.shape) for n, t in stream], 300) == [(list(b.metas), b.alone) for b in buckets]
    with pytest.raises(ValueError, match="shorter than its tensors"):
        unpack(buckets[0].buffer[:100], buckets[0].wire_metas())


def test_engine_update_order_runs_calls_by_sequence_number():
    """UpdateOrder (the engines' gate): calls that arrive as 3, 1, 0, 2, 5, 4 run as 0..5; a number already applied
    is refused; a call whose predecessor never comes fails after the wait naming the missing number; after a failed
    update the next ones fail too instead of loading half a sync."""
    from openrlhf_lpo.engines.weight_updates import UpdateOrder

    order, ran = UpdateOrder(wait_s=0.5), []

    async def call(seq, fail=False):
        async with order.turn(seq):
            await asyncio.sleep(0.001 * (6 - seq))  # later numbers finish sooner if let through
            if fail:
                raise OSError("disk")
            ran.append(seq)

    async def main():
        await asyncio.gather(*[call(s) for s in (3, 1, 0, 2, 5, 4)])
        with pytest.raises(ValueError, match=r"#2 arrived after #5 was applied"):
            await call(2)
        with pytest.raises(TimeoutError, match=r"#8 waited 0.5 s for #6, which never arrived"):
            await call(8)
        with pytest.raises(OSError):
            await call(6, fail=True)
        with pytest.raises(RuntimeError, match=r"#7 not applied: an earlier update failed \(#6: OSError: disk\)"):
            await call(7)

    asyncio.run(main())
    assert ran == [0, 1, 2, 3, 4, 5] and order.applied == 7 and order.out_of_order == 6


# ----------------------------------------------------------------------------- the shared-memory stand-in

_SENDER = textwrap.dedent("""
    import pickle, sys
    import torch
    from openrlhf_lpo.megatron.weight_sync import SharedMemoryIPC

    from openrlhf_lpo.engines.buckets import bucketize

    key, path, bucket_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state = torch.load(path)
    ipc = SharedMemoryIPC(device_id="sender-side")
    kept, out, buckets = [], [], []
    for name, t in state.items():
        kept.append(t)
        out.append((name, t.dtype, tuple(t.shape), {key: ipc.export(t), "other:gpu9": ipc.export(t.clone())}))
    for b in bucketize(state.items(), bucket_bytes):
        kept.append(b.buffer)
        buckets.append((b.wire_metas(), {key: ipc.export(b.buffer)}))
    sys.stdout.buffer.write(pickle.dumps((out, buckets)))
    sys.stdout.flush()
    sys.stdin.readline()  # the tensors live until the receiver has rebuilt them
""")


class _Sender:
    """A process that exports ``state`` through :class:`SharedMemoryIPC` and keeps it alive until closed."""

    def __init__(self, state, key, tmp_path, bucket_bytes=1 << 20):
        path = tmp_path / "state.pt"
        torch.save(state, path)
        self.proc = subprocess.Popen([sys.executable, "-c", _SENDER, key, str(path), str(bucket_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.handles, self.buckets = pickle.load(self.proc.stdout)

    def close(self):
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()
        assert self.proc.wait(timeout=60) == 0


def test_shared_memory_handle_from_another_process_is_rebuilt_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    state = {"fp32": base, "bf16": base.to(torch.bfloat16), "view": base[2:5, 3:],  # an offset, strided view
             "int": torch.arange(7)}
    sender = _Sender(state, "me", tmp_path)
    try:
        ipc = SharedMemoryIPC()
        for name, dtype, shape, handles in sender.handles:
            t = ipc.rebuild(handles["me"])
            ref = state[name]
            assert t.dtype == dtype == ref.dtype and tuple(t.shape) == shape == tuple(ref.shape), name
            assert torch.equal(t, ref), name
    finally:
        sender.close()


def test_transport_choice_and_device_ids(monkeypatch):
    assert isinstance(transport_for(torch.device("cpu")), SharedMemoryIPC)
    assert transport_for(torch.device("meta")).name == "device-ipc"  # any non-CPU device: accelerator IPC
    monkeypatch.setenv("RANK", "3")
    assert standin_device_id().endswith(":rank3")  # no Ray worker here: host and rank
    assert SharedMemoryIPC(device_id="x").device_id() == "x"
    with pytest.raises(ValueError, match="SharedMemoryIPC exports CPU tensors"):
        SharedMemoryIPC().export(torch.empty(2, device="meta"))


def test_cpu_engine_takes_colocated_weights_from_another_process(tiny_dir, tmp_path, monkeypatch):
    """The CPU rollout engine's bucket API (``update_weight_bucket_ipc``): each call rebuilds the bucket handle keyed by
    the engine's own (stand-in) device from a sender process and unpacks it; the calls arrive in reverse order and
    are applied in sequence order; the last bucket (``empty_cache=True``) loads them all and the engine then scores
    with the sent weights (its log-probs equal a model loaded with them). OpenRLHF's per-tensor
    ``update_weight_cuda_ipc`` refuses a missing device key or a wrong announced dtype."""
    from transformers import AutoModelForCausalLM

    from openrlhf_lpo.engines.cpu_engine import CPURolloutEngine

    monkeypatch.setenv("LPO_CPU_ENGINE", "hf")
    engine = CPURolloutEngine(tiny_dir, seed=0)
    key = SharedMemoryIPC().device_id()  # this process's stand-in device: the engine looks its handle up by it
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    state = {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=g)).contiguous()
             for n, p in ref.named_parameters()}
    ids = list(range(3, 20))
    before = engine.log_probs_of(ids)
    sender = _Sender(state, key, tmp_path, bucket_bytes=20_000)
    try:
        items = sender.handles
        with pytest.raises(ValueError, match="no handle for this engine's device"):
            engine.update_weight_cuda_ipc(items[0][0], items[0][1], items[0][2], {"other:gpu9": items[0][3]["other:gpu9"]})
        with pytest.raises(ValueError, match="announced torch.bfloat16"):
            engine.update_weight_cuda_ipc(items[0][0], torch.bfloat16, items[0][2], items[0][3])
        assert asyncio.run(engine.weight_sync_device_ids()) == [key]
        buckets = sender.buckets
        assert 2 < len(buckets) < len(items)

        async def deliver():  # the calls arrive last first; the engine applies them in sequence order
            return await asyncio.gather(*[
                engine.update_weight_bucket_ipc(seq, metas, ipc_handles=handles, empty_cache=seq == len(buckets) - 1)
                for seq, (metas, handles) in reversed(list(enumerate(buckets)))])

        counts = asyncio.run(deliver())[::-1]
    finally:
        sender.close()
    sizes = [len(metas) for metas, _ in buckets]
    assert counts == [sum(sizes[:i + 1]) for i in range(len(sizes))] and counts[-1] == len(state)
    assert engine.num_weight_updates == 1
    stats = engine.weight_update_stats()
    assert stats["applied"] == stats["next_seq"] == len(buckets) and stats["out_of_order"] == len(buckets) - 1
    got = dict(engine.backend.model.named_parameters())
    assert all(torch.equal(got[n], state[n]) for n in state)
    ref.load_state_dict(state, strict=False)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0, :-1].float(), -1)
        expect = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    after = torch.tensor(engine.log_probs_of(ids))
    assert (after - expect).abs().max() < 1e-5 and (after - torch.tensor(before)).abs().max() > 1e-3
