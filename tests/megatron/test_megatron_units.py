"""Pure parts of the Megatron backend (no process group): packing indices, hub ids, checkpoint
pruning and safe loading, cluster placement, device mapping, the upstream vLLM dtype contract,
and the one-way dependency between the CPU mode and the Megatron room."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from openrlhf_lpo.megatron import checkpoint, cluster, device, packing

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- packing


def test_pack_indices_follow_openrlhf_log_prob_contract():
    """Action column a of row b reads the logit predicting sequences[b, S-A+a] (OpenRLHF's
    Actor.forward(...)[:, -A:]); an independent loop gives the same positions."""
    seq = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [9, 10, 11, 0, 0, 0, 0], [0, 12, 13, 14, 15, 16, 17]])
    am = (seq != 0).long()
    A = 4
    pk = packing.pack_micro_batch(seq, am, A)
    assert pk.tokens[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert pk.cu_seqlens.tolist() == [0, 4, 7, 13] and pk.cu_seqlens.dtype == torch.int32
    assert pk.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5] and pk.max_seqlen == 6
    S = seq.shape[1]
    for b in range(3):
        first = int(am[b].argmax())
        for a in range(A):
            c = S - A + a
            ok = bool(am[b, c]) and c - 1 >= first
            assert bool(pk.action_valid[b, a]) == ok
            if ok:
                pos = int(pk.cu_seqlens[b]) + c - 1 - first
                assert int(pk.tokens[0, pos]) == int(seq[b, c - 1])  # the logit at the previous token
                assert int(pk.action_tokens[b, a]) == int(seq[b, c])


def test_pack_pads_each_sequence_at_its_tail():
    seq = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    pk = packing.pack_micro_batch(seq, (seq != 0).long(), 3, pad_multiple=4)
    assert pk.cu_seqlens.tolist() == [0, 4, 8]
    assert pk.tokens[0].tolist() == [1, 2, 3, 0, 4, 5, 0, 0]
    assert pk.seq_lens == [3, 2]


def test_pack_rejects_holes_in_the_attention_mask():
    seq = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="attention_mask row 0 is not one contiguous run"):
        packing.pack_micro_batch(seq, torch.tensor([[1, 0, 1, 1]]), 2)


def test_sliding_window_longer_sequences_are_refused():
    from openrlhf_lpo.megatron.actor import MegatronActor

    pk = packing.pack_micro_batch(torch.ones(1, 10, dtype=torch.long), torch.ones(1, 10), 3)
    MegatronActor._check_span(NS(attention_span=10), pk)
    MegatronActor._check_span(NS(attention_span=None), pk)
    with pytest.raises(ValueError, match="sliding window of 8"):
        MegatronActor._check_span(NS(attention_span=8), pk)


# ----------------------------------------------------------------------------- hub ids


def _fake_cache(cache: Path, repo: str, src: Path, files):
    snap = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in files:
        (snap / f).write_bytes((src / f).read_bytes())
    (cache / ("models--" + repo.replace("/", "--")) / "refs").mkdir()
    (cache / ("models--" + repo.replace("/", "--")) / "refs" / "main").write_text("a" * 40)
    return snap


def test_hub_ids_resolve_offline_from_the_cache(tmp_path, monkeypatch):
    from openrlhf_lpo.megatron.hub import resolve_pretrained
    from openrlhf_lpo.testing.tiny import build_tiny_model

    src = Path(build_tiny_model(tmp_path / "src", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                head_dim=16, intermediate_size=32))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    snap = _fake_cache(cache, "acme/tiny", src, ["config.json", "model.safetensors", "tokenizer.json"])
    assert resolve_pretrained("acme/tiny", cache_dir=str(cache)) == str(snap)
    assert resolve_pretrained(str(src)) == str(src)  # a local folder is used as is
    with pytest.raises(ValueError, match="--actor.model_name_or_path 'Qwen/Qwen3-8B-Base'.*offline.*huggingface-cli"):
        resolve_pretrained("Qwen/Qwen3-8B-Base", cache_dir=str(cache))
    _fake_cache(cache, "acme/noweights", src, ["config.json"])
    with pytest.raises(ValueError, match="lacks config.json or safetensors"):
        resolve_pretrained("acme/noweights", cache_dir=str(cache))
    with pytest.raises(ValueError, match="no such directory"):
        resolve_pretrained(str(tmp_path / "missing" / "dir"))


# ----------------------------------------------------------------------------- checkpoints


def _step_dir(root: Path, n: int, mb: int = 0):
    d = root / f"global_step{n}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text("{}")
    if mb:
        (d / "blob").write_bytes(b"\0" * (mb * 1024 * 1024))


def test_prune_keeps_the_newest(tmp_path):
    for n in (3, 10, 7, 20):
        _step_dir(tmp_path, n)
    (tmp_path / "global_step30.partial").mkdir()  # incomplete: never listed, never counted
    assert [n for _, n in checkpoint.step_dirs(str(tmp_path))] == [f"global_step{n}" for n in (3, 7, 10, 20)]
    assert checkpoint.prune(str(tmp_path), keep="global_step20", max_num=2) == ["global_step3", "global_step7"]
    assert [n for _, n in checkpoint.step_dirs(str(tmp_path))] == ["global_step10", "global_step20"]


def test_prune_by_size(tmp_path):
    for n in (1, 2, 3):
        _step_dir(tmp_path, n, mb=1)
    removed = checkpoint.prune(str(tmp_path), keep="global_step3", max_num=10, max_mem_gb=2.5 / 1024)
    assert removed == ["global_step1"]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_client_state_is_loaded_without_unpickling_objects(tmp_path):
    """A tampered client_state.pt (an object whose unpickling runs a shell command) is refused and
    the command never runs; tensors and plain containers load."""
    good = tmp_path / "good.pt"
    torch.save({"episode": 3, "rng": torch.arange(4), "nested": [1.5, "x", None]}, good)
    assert checkpoint.load_client_state(str(good))["rng"].tolist() == [0, 1, 2, 3]
    marker = tmp_path / "pwned"
    evil = tmp_path / "client_state.pt"
    torch.save({"episode": _Evil(marker)}, evil)
    with pytest.raises(ValueError, match="refused without unpickling"):
        checkpoint.load_client_state(str(evil))
    assert not marker.exists()


def test_checkpoint_tags_must_be_global_steps(tmp_path):
    with pytest.raises(ValueError, match="global_step<N>"):
        checkpoint.save(None, str(tmp_path), "best", {})


# ----------------------------------------------------------------------------- clusters


def _args(tp=2, nodes=1, gpn=8, engines=4, vtp=1, kl=0.0):
    return NS(megatron=NS(tp=tp, pp=1), actor=NS(num_nodes=nodes, num_gpus_per_node=gpn),
              vllm=NS(num_engines=engines, tensor_parallel_size=vtp), algo=NS(kl=NS(init_coef=kl)),
              ref=NS(num_nodes=1, num_gpus_per_node=gpn), train=NS(colocate_actor_ref=False))


def test_placement_of_the_recipes():
    # 8B: actor TP2 x DP2 (4 GPUs) + 4 engines TP1 on one 8-GPU node
    placed = cluster.plan_placement([8], cluster.demands_from_args(_args(tp=2, gpn=4, engines=4)))
    assert sum(g for _, g in placed[0]) == 8
    # 14B: actor TP4 x DP2 (8 GPUs) + 4 engines TP2: two 8-GPU nodes, not one
    a14 = _args(tp=4, gpn=8, engines=4, vtp=2)
    assert [sum(g for _, g in n) for n in cluster.plan_placement([8, 8], cluster.demands_from_args(a14))] == [8, 8]
    with pytest.raises(cluster.PlacementError, match=r"needs 16 GPUs .*nodes have \[8\] GPUs"):
        cluster.plan_placement([8], cluster.demands_from_args(a14))


def test_placement_keeps_blocks_on_one_node():
    # 8 GPUs in total but spread 4+4: a TP8 group cannot be placed
    with pytest.raises(cluster.PlacementError, match="no node has 8 free GPUs left for a Megatron actor TP group"):
        cluster.plan_placement([4, 4], cluster.demands_from_args(_args(tp=8, gpn=8, engines=0)))
    # the reference model adds single GPUs when --algo.kl.init_coef > 0
    d = cluster.demands_from_args(_args(tp=2, gpn=2, engines=0, kl=0.01))
    assert ("DeepSpeed reference model GPU", 1, 2) in [(x.role, x.gpus, x.count) for x in d]


def test_check_ray_cluster_reads_ray_nodes():
    nodes = [{"Alive": True, "Resources": {"GPU": 8.0}}, {"Alive": False, "Resources": {"GPU": 8.0}}]
    with pytest.raises(cluster.PlacementError):
        cluster.check_ray_cluster(_args(tp=4, gpn=8, engines=4, vtp=2), nodes=nodes)  # the dead node does not count
    assert cluster.tp_groups_spanning_nodes(list("AABB"), 2) == []
    assert cluster.tp_groups_spanning_nodes(list("ABAB"), 2) == [([0, 1], ["A", "B"]), ([2, 3], ["A", "B"])]


# ----------------------------------------------------------------------------- devices


def test_backend_device_mapping(monkeypatch):
    assert device.backend_device("gloo") == torch.device("cpu")
    if not device.accelerator_available():
        with pytest.raises(ValueError, match="'nccl' needs an accelerator"):
            device.backend_device("nccl")
    # with an accelerator, an NCCL group's tensors go to the current accelerator device
    monkeypatch.setattr(device, "accelerator_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    assert device.backend_device("nccl") == torch.device("cuda", 3)
    assert device.backend_device("gloo") == torch.device("cpu")


# ----------------------------------------------------------------------------- upstream contracts


def test_openrlhf_vllm_engines_are_bf16_and_check_the_dtype(monkeypatch):
    """The Megatron sync sends VLLM_ENGINE_DTYPE because OpenRLHF 0.11.2 builds every engine in
    bfloat16 and its worker asserts the dtype of each tensor it receives."""
    import inspect

    from openrlhf.trainer.ray import vllm_engine, vllm_worker_wrap

    from openrlhf_lpo.megatron.ray_actor import VLLM_ENGINE_DTYPE

    seen = {}

    class FakeActor:
        @staticmethod
        def options(**_):
            return NS(remote=lambda **kw: seen.update(kw))

    monkeypatch.setattr(vllm_engine, "RolloutRayActor", FakeActor)
    monkeypatch.setattr(vllm_engine, "placement_group", lambda *a, **k: NS(ready=lambda: None))
    monkeypatch.setattr(vllm_engine, "PlacementGroupSchedulingStrategy", lambda **k: None)
    monkeypatch.setattr(vllm_engine.ray, "get", lambda x: x)
    vllm_engine.create_vllm_engines(1, 1, "m", 0, False, False, True, 128)
    assert seen["dtype"] == "bfloat16" == str(VLLM_ENGINE_DTYPE).replace("torch.", "")
    src = inspect.getsource(vllm_worker_wrap.WorkerWrap.update_weight)
    assert "assert dtype == self.model_config.dtype" in src


# ----------------------------------------------------------------------------- rooms


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            for a in node.names:
                yield f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name


def test_megatron_room_does_not_import_the_cpu_mode():
    bad = {}
    for f in sorted((REPO / "openrlhf_lpo" / "megatron").glob("*.py")):
        hits = [m for m in _imports(f) if m in ("openrlhf_lpo.cpu.mode", "openrlhf_lpo.cpu.megatron_redirect")
                or m.startswith(("openrlhf_lpo.cpu.", "openrlhf_lpo.cpu.megatron_redirect."))]
        if hits:
            bad[f.name] = hits
    assert bad == {}


def test_cpu_mode_patches_megatron_on_import():
    """In a fresh process: the CPU mode's import hook applies the megatron redirection as soon as
    megatron.core is imported (nothing in the Megatron room asks for it)."""
    code = (
        "import json, sys\n"
        "from openrlhf_lpo.cpu import mode as cpu\n"
        "cpu.enable_cpu_mode()\n"
        "assert 'openrlhf_lpo.cpu.megatron_redirect' not in sys.modules\n"
        "import megatron.core\n"
        "from openrlhf_lpo.cpu import megatron_redirect as cpu_megatron\n"
        "print(json.dumps({'active': cpu_megatron.is_active()}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), LPO_CPU_MODE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"active": True}


def test_lpo_train_checks_the_placement_before_any_actor():
    """The --backend megatron layout fit that lpo-train's start-up check (cli/capacity.py) uses on the GPUs per
    node of the Ray cluster it joined: what fits is logged, what does not is the reason naming the numbers."""
    from openrlhf_lpo.cli import capacity
    from openrlhf_lpo.megatron import flags  # noqa: F401  (registers the fit)

    args = _args(tp=2, gpn=4, engines=4)
    args.backend = "megatron"
    reason, line = capacity.layout_fit(args, [8.0])
    assert reason is None and line.startswith("[megatron] placement on the Ray cluster fits: node 0: Megatron actor "
                                              "TP group x2")
    big = _args(tp=4, gpn=8, engines=4, vtp=2)
    big.backend = "megatron"
    reason, line = capacity.layout_fit(big, [8.0])
    assert line is None and re.search(r"--backend megatron: .*needs 16 GPUs .* nodes have \[8\] GPUs", reason)
    assert capacity.shortfall(big, [8.0, 8.0]) is None  # two nodes: each block on one


def test_partial_rollout_pause_resets_the_prefix_cache_before_the_weight_sync():
    """Cluster review F13 against the installed code: with --train.partial_rollout_enable OpenRLHF wraps the
    weight broadcast in pause_generation / resume_generation; its pause is vLLM's ``mode="keep"`` with the
    default ``clear_cache=True``, and vLLM 0.29 completes that pause only after ``_finish_pause`` ->
    ``_reset_caches(reset_running_requests=True)``: the running requests are preempted (their KV dropped,
    recomputed at resume under the new weights) and the prefix cache is reset before any weight arrives.
    The Megatron actor's own reset after the sync (``--vllm.enable_prefix_caching``) then finds no block in
    use. OpenRLHF's engine method discards vLLM's boolean, so this contract is what guards the
    combination: if upstream ever pauses with ``clear_cache=False`` or stops preempting, this fails."""
    import inspect

    from openrlhf.trainer import ppo_trainer_async
    from openrlhf.trainer.ray import vllm_engine
    from vllm.v1.engine import core
    from vllm.v1.engine.async_llm import AsyncLLM

    src = inspect.getsource(ppo_trainer_async.TrainingActor.broadcast_to_vllm)
    assert src.index('"pause_generation"') < src.index("super().broadcast_to_vllm()") < src.index('"resume_generation"')
    assert 'self.llm.pause_generation(mode="keep")' in inspect.getsource(vllm_engine.RolloutRayActor.pause_generation)
    assert inspect.signature(AsyncLLM.pause_generation).parameters["clear_cache"].default is True
    assert "engine._finish_pause(clear_cache)" in inspect.getsource(core.EngineCoreProc.pause_scheduler)
    assert "self._reset_caches()" in inspect.getsource(core.EngineCore._finish_pause)
    assert inspect.signature(core.EngineCore._reset_caches).parameters["reset_running_requests"].default is True
    sched = inspect.getsource(__import__("vllm.v1.core.sched.scheduler", fromlist=["Scheduler"]).Scheduler.reset_prefix_cache)
    assert "if reset_running_requests:" in sched and "self._preempt_request(" in sched
