"""Sequence parallelism, virtual pipeline stages, the context-parallel and MoE refusals, and the
32B / 70B recipes (cluster, dry run, memory table).

The shared gloo world (4 ranks; the checks of ``mcore_checks/parallel.py``, ``sp_vpp_layouts`` and
``vpp_checkpoints``, after the others) checks against independent references: HF in
float64 per unpadded sequence (log-probs), plain-torch float64 autograd (gradients, through an
SGD-like Adam step), SP off and VPP 1 (the same quantities in the plain layouts). Each world test first
asserts that the checks it reads ran ok (``world_checks``: a failure names the check and its traceback).
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from openrlhf_lpo.testing.tiny import build_tiny_model

from .mcore_records import world_checks
from .test_megatron_flags import _argv as flag_argv
from .test_megatron_flags import _parse

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "scripts"
MODEL_CONFIGS = REPO / "examples" / "model_configs"


# ----------------------------------------------------------------------------- the gloo world


LAYOUTS = ("tp2", "tp2_sp", "tp2pp2_sp_recompute", "pp2_vpp2", "tp2pp2_vpp2_sp")


def test_every_layout_matches_hf_in_log_probs_and_gradients(mcore_world):
    """Log-probs vs HF float64 (< 1e-5) and the gradient of the listwise loss vs float64 autograd,
    element-wise (< 1e-4 of the largest entry), in every SP / VPP layout; the export is bit-exact."""
    for checks in world_checks(mcore_world, "sp_vpp_layouts"):
        for name in LAYOUTS:
            rec = checks["sp_vpp_layouts"][name]
            assert rec["logp_vs_hf"] < 1e-5, (name, rec["logp_vs_hf"])
            assert rec["grad_vs_hf_rel"] < 1e-4, (name, rec["grad_vs_hf_rel"])
            assert abs(rec["grad_norm"] - 4.2748802) < 1e-4, (name, rec["grad_norm"])  # the float64 reference
            assert rec["export_bitexact"] and rec["names_match"], name


def test_sequence_parallel_equals_sp_off_and_splits_the_sequence(mcore_world):
    """SP on == SP off (TP2): log-probs to float tolerance, gradients element-wise. Each rank's
    layers see T/tp rows of the packed row, which was padded (per sequence) to a multiple of TP;
    without the TP sum of the norms' gradients (each rank saw half the tokens) the gradient is wrong."""
    for checks in world_checks(mcore_world, "sp_vpp_layouts"):
        rec = checks["sp_vpp_layouts"]["tp2_sp"]
        assert rec["logp_vs_sp_off"] < 1e-5
        assert rec["grad_vs_sp_off_rel"] < 1e-5
        assert rec["no_norm_reduce_grad_vs_hf_rel"] > 1e-2  # negative control
        for name in ("tp2_sp", "tp2pp2_sp_recompute", "tp2pp2_vpp2_sp"):
            r = checks["sp_vpp_layouts"][name]
            if not r.get("layer_rows"):  # a later pipeline stage: its first layer is not in chunk 0
                continue
            assert all(t % 2 == 0 for t in r["packed_tokens"]), r
            assert r["layer_rows"][: len(r["packed_tokens"])] == [t // 2 for t in r["packed_tokens"]], r
            assert sum(r["packed_tokens"]) > sum(r["real_tokens"])  # some sequences were padded


def test_virtual_pipeline_chunks_and_schedule_padding(mcore_world):
    """PP2 x VPP2: two chunks per rank holding the interleaved layers (rank p, chunk v -> layer 2v+p
    of 4); micro-batch counts not divisible by PP are padded with loss-free micro-batches (1 -> 2 in
    training, 3 -> 4 in a log-prob pass) and the results are unchanged."""
    for rank, checks in enumerate(world_checks(mcore_world, "sp_vpp_layouts")):
        for name in ("pp2_vpp2", "tp2pp2_vpp2_sp"):
            rec = checks["sp_vpp_layouts"][name]
            pp_rank = rank % 2 if name == "pp2_vpp2" else rank // 2
            assert rec["chunks"] == 2 and rec["chunk_offsets"] == [pp_rank, 2 + pp_rank], (name, rank, rec)
            assert rec["three_micro_batches"] == 4 and rec["three_vs_hf"] < 1e-5
        assert checks["sp_vpp_layouts"]["pp2_vpp2"]["train_micro_batches"] == 2


def test_virtual_pipeline_checkpoints_resume_in_another_layout(mcore_world):
    """Saved at PP2 x VPP2 after one step: loaded into PP2 x VPP1 and TP2 x PP1 bit-exactly, and
    step 2 there equals the uninterrupted VPP2 run; a VPP1 checkpoint loads into VPP2 bit-exactly."""
    for checks in world_checks(mcore_world, "vpp_checkpoints"):
        rec = checks["vpp_checkpoints"]
        assert rec["meta_layout"]["vpp"] == 2 and rec["meta_layout"]["pp"] == 2
        assert rec["step2_moved"] > 5e-4
        for name in ("vpp2_to_vpp1", "vpp2_to_tp2"):
            r = rec[name]
            assert r["client_ok"] and r["loaded_vs_saved"] == 0.0, (name, r)
            assert r["step2_vs_continued"] < 1e-6, (name, r)
            assert abs(r["grad_norm"][0] - r["grad_norm"][1]) < 1e-6, (name, r)
        assert rec["vpp1_to_vpp2_vs_saved"] == 0.0


def test_stage_parameter_counts_match_the_built_chunks(mcore_world):
    """openrlhf_lpo.megatron.memory's per-rank parameter count (the memory tables) equals the elements
    of the chunks megatron built, in every layout."""
    for checks in world_checks(mcore_world, "sp_vpp_layouts"):
        for name in LAYOUTS:
            rec = checks["sp_vpp_layouts"][name]
            assert rec["local_numel"] == rec["memory_rank_parameters"], (name, rec)


# ----------------------------------------------------------------------------- flags (no world)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("q3l4") / "q3", arch="qwen3", hidden_size=64, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


def _argv(d, *extra):
    return flag_argv(d, "--vllm.num_engines", "1", "--backend", "megatron", *extra)


def test_sequence_parallel_and_vpp_flags_reach_the_actor_config(four_layers):
    from openrlhf_lpo.megatron.ray_actor import megatron_config_from_args

    cfg = megatron_config_from_args(_parse(_argv(four_layers, "--megatron.tp", "2", "--megatron.pp", "2",
                                                 "--megatron.vpp", "2", "--megatron.sequence_parallel")))
    assert (cfg.tp, cfg.pp, cfg.vpp, cfg.sequence_parallel) == (2, 2, 2, True)
    assert megatron_config_from_args(_parse(_argv(four_layers))).sequence_parallel is False


@pytest.mark.parametrize("extra,needle", [
    (["--megatron.sequence_parallel"], "--megatron.sequence_parallel needs --megatron.tp > 1"),
    (["--megatron.cp", "2"], "--megatron.cp 2: context parallelism is not supported by --backend megatron: "
                             "megatron-core 0.16.1 runs it only inside Transformer Engine's attention"),
    (["--ds.ring_attn_size", "2"], "--ds.ring_attn_size > 1 is not supported with --backend megatron: context "
                                   "parallelism is not supported"),
    (["--megatron.vpp", "2"], "--megatron.vpp 2 needs --megatron.pp > 1"),
])
def test_parallelism_refusals_exit_2_saying_why_and_what_instead(four_layers, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        _parse(_argv(four_layers, *extra))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    if "cp" in needle or "ring" in needle:
        assert "--megatron.sequence_parallel" in err and "--ds.ring_attn_size" in err  # what to use instead


def test_the_actor_refuses_sequence_parallel_without_tp():
    """Checked again where the actor is built (a namespace that skipped the CLI), before any process group."""
    from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig

    with pytest.raises(ValueError, match="--megatron.sequence_parallel needs --megatron.tp > 1"):
        MegatronActor({"model_type": "qwen3"}, MegatronActorConfig(tp=1, sequence_parallel=True))


def test_mixture_of_experts_models_are_refused_with_the_plan(tmp_path, capsys):
    """Qwen3-30B-A3B's config (model_type qwen3_moe, 128 experts, top-8): exit 2, the reason, where the
    plan is, and the way out; the same config parses on DeepSpeed."""
    moe = tmp_path / "qwen3-30b-a3b"
    moe.mkdir()
    (moe / "config.json").write_text((MODEL_CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    with pytest.raises(SystemExit) as e:
        _parse(_argv(str(moe)))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "does not support mixture-of-experts models yet (model_type 'qwen3_moe')" in err
    assert "docs/megatron.md" in err and "DeepSpeed backend" in err
    assert "Mixture of experts" in (REPO / "docs" / "megatron.md").read_text()
    assert _parse(flag_argv(str(moe))).backend == "deepspeed"


def test_packed_rows_pad_to_the_multiple_sp_needs_and_to_one_length():
    """SP: every sequence padded at its tail to a multiple of TP (cu_seqlens over the padded lengths);
    VPP: a trailing pad segment brings a row to the pass's common length; action positions unchanged."""
    import torch

    from openrlhf_lpo.megatron import packing

    seq = torch.tensor([[0, 7, 8, 9], [5, 6, 0, 0]])
    am = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    pk = packing.pack_micro_batch(seq, am, 2, pad_multiple=2)
    assert pk.cu_seqlens.tolist() == [0, 4, 6] and pk.num_tokens % 2 == 0 and pk.seq_lens == [3, 2]
    assert pk.tokens[0].tolist() == [7, 8, 9, 0, 5, 6]
    assert pk.action_index[pk.action_valid].tolist() == [0, 1]  # 8 and 9 are predicted at packed positions 0, 1
    wide = packing.pad_to_tokens(pk, 10)
    assert wide.cu_seqlens.tolist() == [0, 4, 6, 10] and wide.tokens[0].tolist()[6:] == [0] * 4
    assert wide.position_ids[0].tolist()[6:] == [0, 1, 2, 3] and wide.max_seqlen == 4
    assert torch.equal(wide.action_index, pk.action_index) and packing.pad_to_tokens(pk, 6) is pk
    with pytest.raises(ValueError, match="cannot pad a packed row of 6 tokens to 4"):
        packing.pad_to_tokens(pk, 4)


# ----------------------------------------------------------------------------- memory formula


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("qwen3", False), ("qwen2", False), ("llama", False)])
def test_parameter_count_equals_the_hf_model(arch, tied):
    """The memory tables' parameter count against the elements of an HF model of that architecture."""
    from transformers import AutoModelForCausalLM

    from openrlhf_lpo.megatron.memory import Shape
    from openrlhf_lpo.testing.tiny import tiny_config

    cfg = tiny_config(arch, vocab_size=96, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
                      intermediate_size=80, tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_config(cfg)
    assert Shape.of(cfg.to_dict()).parameters == sum(p.numel() for p in hf.parameters())


# ----------------------------------------------------------------------------- 32B / 70B recipes

RECIPES = {  # script -> (real config, nodes x GPUs, GPUs needed, tp, pp, vLLM TP): colocated, every GPU shared
    "train_math_qwen3_32b_megatron.sh": ("qwen3-32b", 2, 16, 8, 2, 2),
    "train_math_r1_distill_llama_70b_megatron.sh": ("deepseek-r1-distill-llama-70b", 4, 32, 8, 4, 4),
}


def _env(**kw):
    drop = ("MODEL", "DATA", "EXTRA_ARGS", "METHOD", "BACKEND", "MEGATRON_TP", "MEGATRON_PP", "MEGATRON_SP",
            "MEGATRON_VPP", "NNODES", "GPUS_PER_NODE", "VLLM_ENGINES", "VLLM_TP", "ACTOR_NODES", "ACTOR_GPUS",
            "LPO_PRINT_ARGS", "LPO_DRY_RUN")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(kw)
    return env


@pytest.fixture(scope="module")
def math_data(tmp_path_factory):
    import json

    p = tmp_path_factory.mktemp("data") / "math.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"p{i}", "label": "1"}) + "\n" for i in range(7500)))
    return str(p)


@pytest.fixture(scope="module")
def large_dry_runs(math_data, tmp_path_factory):
    """``MODEL=<dir with the real config.json> LPO_DRY_RUN=1 bash <script>`` for both recipes, batched: each
    script's ``LPO_PRINT_ARGS=1`` flags (bash only) plus ``--dry-run``, run in one Python process
    (tests/pipeline/dry_run_batch.py, the imports paid once). That a script's own dry run prints what its
    batched job prints is tests/pipeline/test_dry_run.py's HANDOFF test. Returns {script: (printed flags,
    CompletedProcess)}."""
    import sys

    if str(REPO / "tests" / "pipeline") not in sys.path:
        sys.path.insert(0, str(REPO / "tests" / "pipeline"))
    from dry_run_batch import run_batch

    root = tmp_path_factory.mktemp("large_dry")
    jobs, printed = [], {}
    for script, (config, *_rest) in RECIPES.items():
        env = _env(MODEL=str(MODEL_CONFIGS / config), DATA=math_data, RAY_ADDRESS="",
                   EXTRA_ARGS="--preflight off")  # a config-only folder: no weights
        printed[script] = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True, text=True, check=True,
                                         cwd=str(root), env=dict(env, LPO_PRINT_ARGS="1")).stdout.splitlines()
        jobs.append({"name": script, "env": env, "argv": printed[script] + ["--dry-run"]})
    return {script: (printed[script], out) for script, out in run_batch(jobs, root, timeout=600).items()}


@pytest.mark.e2e
@pytest.mark.parametrize("script", sorted(RECIPES))
def test_large_recipe_dry_run_with_the_real_config_and_its_cluster(script, large_dry_runs):
    """The script's dry run with the real config prints the plan (every layout rule checked against the real
    dimensions; ``--preflight off``, whose model check rightly refuses a folder without weights); the header's
    cluster holds the flags exactly and one node fewer does not; colocated across nodes, each node's phases and
    host memory are printed (cluster review 3, G4)."""
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.megatron.cluster import PlacementError, demands_from_args, plan_placement

    config, nodes, gpus, tp, pp, vllm_tp = RECIPES[script]
    printed, out = large_dry_runs[script]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "flags are valid; nothing was started" in out.stdout and f"GPUs needed: {gpus}\n" in out.stdout
    assert f"actor: {gpus} (megatron actor, TP {tp} x PP {pp} x DP 1; shared with vLLM engines)" in out.stdout
    header = re.search(r"^# Cluster: (\d+) nodes x (\d+) GPUs", (SCRIPTS / script).read_text(), re.M)
    assert (int(header.group(1)), int(header.group(2))) == (nodes, 8)
    args = build_parser_and_parse(printed)
    assert (args.megatron.tp, args.megatron.pp, args.megatron.sequence_parallel) == (tp, pp, True)
    demands = demands_from_args(args)
    placed = plan_placement([8] * nodes, demands)
    assert sum(g for node in placed for _, g in node) == nodes * 8
    with pytest.raises(PlacementError, match="cannot place the run"):
        plan_placement([8] * (nodes - 1), demands)
    # what the plan prints for the real shapes: rank-to-node map, memory, disk, pipeline efficiency
    import json

    from openrlhf_lpo.cli.disk import human_size
    from openrlhf_lpo.megatron.memory import GB, Shape, actor_memory

    lines = [line.strip() for line in out.stdout.splitlines()]
    actor_nodes = gpus // 8
    for node in range(actor_nodes):
        assert f"node {node}: ranks {8 * node}-{8 * node + 7} = replica 0 stage {node % pp} (TP 8 each)" in lines
    hf = json.loads((MODEL_CONFIGS / config / "config.json").read_text())
    mem = actor_memory(hf, tp, pp, 1, 5120, 4096, sequence_parallel=True, recompute=True)
    assert f"peak {mem['peak'] / GB:.1f} GB (with the CUDA context / NCCL allowance)" in out.stdout
    assert mem["peak"] < 80e9 * 0.9  # fits an 80 GB GPU with room
    P = Shape.of(hf).parameters
    kept = args.ckpt.max_num + 1  # the new checkpoint is whole before the oldest goes
    total = kept * 12 * P + kept * 2 * P + 2 * P  # fp32 params + moments, bf16 exports (rotated alike), final
    assert f"{kept} megatron checkpoint(s) of {human_size(12 * P)}" in out.stdout
    assert out.stdout.count(f" = {human_size(total)}\n") == 1
    effs = [float(x) for x in re.findall(r"micro-batch\(es\) -> ([0-9.]+)%", out.stdout)]
    assert len(effs) == 2 and min(effs) >= 80.0 and "  WARNING: " not in out.stdout
    # colocated across nodes: every phase planned per node (each node's own stage), and the host memory per node
    from openrlhf_lpo.megatron.colocation_memory import GENERATION, SAVE, SYNC, TRAINING, colocated_memory
    from openrlhf_lpo.megatron.host_memory import node_host_memory

    host = node_host_memory(hf, tp=tp, pp=pp, dp=1, gpus_per_node=8, colocated=True, vllm_tp=vllm_tp)
    for node in range(actor_nodes):
        per = colocated_memory(hf, tp, pp, 1, 5120, 4096, vllm_tp=vllm_tp, gpu_memory_utilization=0.85,
                               sequence_parallel=True, stage=node)
        assert (f"node {node} (ranks {8 * node}-{8 * node + 7}, stage {node}): " +
                ", ".join(f"{ph} {per[ph]['total'] / GB:.1f}" for ph in (GENERATION, TRAINING, SYNC, SAVE))) in lines
        assert max(per[ph]["total"] for ph in (GENERATION, TRAINING, SYNC, SAVE)) <= 80e9
        assert f"node {node} (ranks {8 * node}-{8 * node + 7}): {host[node][3]['total'] / GB:.1f} GB" in lines


@pytest.mark.parametrize("script", sorted(RECIPES))
def test_recipe_header_memory_is_the_formula(script):
    """The per-GPU numbers in the script header are :func:`memory.actor_memory` at the recipe's
    layout and shapes (5120-token micro-batch, 4096 action tokens, SP, recompute)."""
    import json

    from openrlhf_lpo.megatron.memory import GB, actor_memory

    config, nodes, gpus, tp, pp, _ = RECIPES[script]
    hf = json.loads((MODEL_CONFIGS / config / "config.json").read_text())
    dp = gpus // (tp * pp)  # colocated: the actor takes every GPU
    m = actor_memory(hf, tp, pp, dp, 5120, 4096, sequence_parallel=True, recompute=True)
    text = (SCRIPTS / script).read_text()
    for key, label in (("bf16 weights", "bf16 weights"), ("fp32 gradient buffer", "fp32 grads"),
                       ("fp32 main params + Adam moments", "Adam moments")):
        assert f"{label} {m[key] / GB:.1f} GB" in text, (key, m[key] / GB)
    assert f"~ {m['static total'] / GB:.0f} GB" in text
    assert f"{m['parameters per GPU'] / 1e9:.2f}B" in text


def test_preflight_names_the_virtual_pipeline_layout_of_a_checkpoint(tmp_path):
    """``lpo-train``'s resume line says VPP when the checkpoint was written with it (layout-free: it
    resumes anyway) and stays as before at VPP 1."""
    import json
    from types import SimpleNamespace

    from openrlhf_lpo.megatron import checkpoint, preflight

    said = []
    ctx = SimpleNamespace(model=SimpleNamespace(config=None), say=said.append)
    for vpp in (2, 1):
        tag = tmp_path / f"vpp{vpp}" / "global_step1"
        tag.mkdir(parents=True)
        (tag / "meta.json").write_text(json.dumps({"format": checkpoint.FORMAT, "step": 1,
                                                   "layout": {"tp": 1, "pp": 2, "vpp": vpp, "dp": 2}}))
        preflight.check_resume(ctx, str(tag.parent), str(tag))
    assert "written at TP1 PP2 VPP2 DP2; layout-free" in said[0]
    assert "written at TP1 PP2 DP2; layout-free" in said[1]
