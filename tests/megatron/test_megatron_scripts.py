"""The Megatron recipes state the cluster they fit in their header, and that cluster fits them.

Each ``train_*_megatron.sh`` says ``# Cluster: N node(s) x G GPUs``; its flags (parsed by the
lpo-train parser against a tiny model with Qwen3-8B/14B's head layout) are placed on exactly that
cluster by the same check lpo-train runs against ``ray.nodes()`` before any actor starts, and do not
fit a cluster with one node (or half the GPUs) less.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from openrlhf_lpo.megatron.cluster import PlacementError, demands_from_args, plan_placement

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "examples" / "scripts").glob("train_*_megatron.sh"))
KEEP_OUT = ("MODEL", "EXTRA_ARGS", "METHOD", "BACKEND", "MEGATRON_TP", "MEGATRON_PP", "NNODES", "GPUS_PER_NODE",
            "VLLM_ENGINES", "VLLM_TP", "ACTOR_NODES", "ACTOR_GPUS", "MEGATRON_SP", "MEGATRON_VPP",
            "ROLLOUT_MICRO_BATCH_SIZE", "COLOCATE", "FAMILY", "VLLM_GPU_MEMORY_UTILIZATION")


@pytest.fixture(scope="module")
def layout_model(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tp8") / "q3", arch="qwen3", hidden_size=64, num_layers=4,
                            num_heads=8, num_kv_heads=8, head_dim=8, intermediate_size=128)


def _args(script, model, **overrides):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    env = {k: v for k, v in os.environ.items() if k not in KEEP_OUT}
    env.update(LPO_PRINT_ARGS="1", METHOD="lpo_fwd", MODEL=model, **overrides)
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    return build_parser_and_parse(out.stdout.splitlines())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_header_cluster_fits_and_a_smaller_one_does_not(script, layout_model):
    m = re.search(r"^# Cluster: (\d+) nodes? x (\d+) GPUs", script.read_text(), re.M)
    assert m, f"{script.name} does not state its cluster in the header"
    nodes, gpus = int(m.group(1)), int(m.group(2))
    args = _args(script, layout_model)
    demands = demands_from_args(args)
    placed = plan_placement([gpus] * nodes, demands)
    assert sum(g for node in placed for _, g in node) == nodes * gpus  # the recipe uses the whole cluster
    smaller = [gpus] * (nodes - 1) if nodes > 1 else [gpus // 2]
    with pytest.raises(PlacementError, match="cannot place the run"):
        plan_placement(smaller, demands)


# the real configs of the recipes' models (dimensions only) and the memory formula's layout per script
MODEL_CONFIGS = {"train_math_qwen3_8b_megatron.sh": "qwen3-8b", "train_math_qwen3_14b_megatron.sh": "qwen3-14b",
                 "train_math_qwen3_32b_megatron.sh": "qwen3-32b",
                 "train_math_r1_distill_llama_70b_megatron.sh": "deepseek-r1-distill-llama-70b"}


@pytest.mark.parametrize("pp_override", [None, "2"], ids=["recipe", "MEGATRON_PP=2"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_old_log_prob_forward_fills_the_pipeline(script, pp_override, layout_model):
    """Cluster review 2, N3: with PP > 1 each old-log-prob call is one pipeline schedule of rollout / train
    micro-batch micro-batches; every Megatron recipe (and its MEGATRON_PP=2 variant) resolves to >= 4 x pp
    of them, so the dry run prints every pass at >= 80% efficiency (M/(M+pp-1)) and no warning."""
    from openrlhf_lpo.megatron.pipeline_plan import pipeline_plan_lines

    args = _args(script, layout_model, **({"MEGATRON_PP": pp_override} if pp_override else {}))
    pp = args.megatron.pp
    lines = pipeline_plan_lines(args)
    if pp == 1:
        assert lines == [] and args.rollout.micro_batch_size == 2  # the task's chunk stays
        return
    m = args.rollout.micro_batch_size // args.train.micro_batch_size
    assert m >= 4 * pp, (script.name, args.rollout.micro_batch_size, args.train.micro_batch_size, pp)
    text = "\n".join(lines)
    assert f"old-log-prob forward: {m} micro-batch(es) -> {m / (m + pp - 1):.1%}" in text, text
    assert m / (m + pp - 1) >= 0.8 and "WARNING" not in text, text


def test_the_derived_chunk_yields_to_rollout_micro_batch_size(layout_model):
    """ROLLOUT_MICRO_BATCH_SIZE overrides the derived chunk (configs/backends/megatron.sh)."""
    script = next(s for s in SCRIPTS if "70b" in s.name)
    assert _args(script, layout_model).rollout.micro_batch_size == 16  # 4 x PP4 x micro-batch 1
    assert _args(script, layout_model, ROLLOUT_MICRO_BATCH_SIZE="32").rollout.micro_batch_size == 32


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_header_peaks_are_the_memory_formula(script, layout_model):
    """Cluster review 2, N9: the header's forward/backward, optimizer-step and overall peaks (and the two new
    transients) are memory.actor_memory at the script's own layout (tp, pp, dp, SP, recompute, distributed
    optimizer as its flags resolve) and the real model's config."""
    import json

    from openrlhf_lpo.megatron.memory import GB, actor_memory
    from openrlhf_lpo.core.config import dp_size

    args = _args(script, layout_model)
    hf = json.loads((REPO / "examples" / "model_configs" / MODEL_CONFIGS[script.name] / "config.json").read_text())
    m = actor_memory(hf, args.megatron.tp, args.megatron.pp, dp_size(args), 5120, 4096,
                     sequence_parallel=args.megatron.sequence_parallel,
                     recompute=args.actor.gradient_checkpointing_enable,
                     distributed_optimizer=args.megatron.distributed_optimizer)
    header = " ".join(line.lstrip("# ") for line in script.read_text().splitlines() if line.startswith("#"))
    for phrase, key in (("forward/backward {:.1f} GB", "forward/backward peak"),
                        ("CE / entropy temporaries {:.1f} GB", "CE / entropy temporaries, fp32 3 x [A, V/tp]"),
                        ("optimizer step {:.1f} GB", "optimizer step peak"),
                        ("AdamW foreach sqrt(v) {:.1f} GB", "optimizer step temporaries (AdamW foreach sqrt(v), fp32)"),
                        ("peak {:.1f} GB with a 3 GB allowance", "peak")):
        assert phrase.format(m[key] / GB) in header, (script.name, phrase.format(m[key] / GB))


# --------------------------------------------------------------------------- colocation (issue 32 item 4)
ONE_NODE = ["train_math_qwen3_8b_megatron.sh", "train_math_qwen3_14b_megatron.sh"]
SPLIT = {"train_math_qwen3_8b_megatron.sh": (1, 4, 4, 8), "train_math_qwen3_14b_megatron.sh": (1, 8, 8, 16)}


def _run(script, **env):
    base = {k: v for k, v in os.environ.items() if k not in KEEP_OUT}
    return subprocess.run(["bash", str(script)], env=dict(base, LPO_PRINT_ARGS="1", METHOD="lpo_fwd", **env),
                          capture_output=True, text=True)


@pytest.mark.parametrize("name", ONE_NODE)
def test_one_node_recipes_share_every_gpu_and_colocate_0_splits(name, layout_model):
    """configs/backends/megatron.sh: on one node the actor takes all 8 GPUs and 8 engines x TP1 share them with
    OpenRLHF's hybrid-engine flags; COLOCATE=0 gives back the split layout (8B: 4 + 4 GPUs on one node; 14B:
    the actor on node A, 8 engines on node B), which the placement check puts on 2 x 8 GPUs."""
    from openrlhf_lpo.cli import plan

    script = REPO / "examples" / "scripts" / name
    args = _args(script, layout_model)
    assert (args.train.colocate_all, args.vllm.enable_sleep, args.ds.enable_sleep) == (True, True, True)
    assert (args.actor.num_nodes, args.actor.num_gpus_per_node) == (1, 8)
    assert (args.vllm.num_engines, args.vllm.tensor_parallel_size, args.vllm.gpu_memory_utilization) == (8, 1, 0.85)
    assert plan.gpus_needed(args) == 8
    split = _args(script, layout_model, COLOCATE="0")
    nodes, actor_gpus, engines, needed = SPLIT[name]
    assert not (split.train.colocate_all or split.vllm.enable_sleep or split.ds.enable_sleep)
    assert (split.actor.num_nodes, split.actor.num_gpus_per_node, split.vllm.num_engines) == (nodes, actor_gpus, engines)
    assert plan.gpus_needed(split) == needed
    plan_placement([8] * (needed // 8), demands_from_args(split))


MULTI_NODE = {  # script -> (colocated nodes, vLLM TP, COLOCATE=0: nodes, actor nodes)
    "train_math_qwen3_32b_megatron.sh": (2, 2, 4, 2),
    "train_math_r1_distill_llama_70b_megatron.sh": (4, 4, 8, 4),
}


@pytest.mark.parametrize("name", sorted(MULTI_NODE))
def test_multi_node_recipes_colocate_and_colocate_0_splits(name, layout_model):
    """Cluster review 3, G4: the 32B and 70B recipes colocate across their nodes by default (the actor on every GPU,
    8 engines sharing them, each inside a node); COLOCATE=0 gives back the split layout on twice the nodes."""
    from openrlhf_lpo.cli import plan

    nodes, vllm_tp, split_nodes, actor_nodes = MULTI_NODE[name]
    script = REPO / "examples" / "scripts" / name
    args = _args(script, layout_model)
    assert (args.train.colocate_all, args.vllm.enable_sleep, args.ds.enable_sleep) == (True, True, True)
    assert (args.actor.num_nodes, args.actor.num_gpus_per_node) == (nodes, 8)
    assert (args.vllm.num_engines, args.vllm.tensor_parallel_size) == (8 * nodes // vllm_tp, vllm_tp)
    assert plan.gpus_needed(args) == 8 * nodes
    placed = plan_placement([8] * nodes, demands_from_args(args))
    assert [sum(g for _, g in node) for node in placed] == [8] * nodes
    split = _args(script, layout_model, COLOCATE="0")
    assert not (split.train.colocate_all or split.vllm.enable_sleep or split.ds.enable_sleep)
    assert (split.actor.num_nodes, split.vllm.num_engines) == (actor_nodes, 8)
    assert plan.gpus_needed(split) == 8 * split_nodes
    plan_placement([8] * split_nodes, demands_from_args(split))


def test_colocation_knobs_refused_with_what_to_set():
    eight = REPO / "examples" / "scripts" / "train_math_qwen3_8b_megatron.sh"
    cases = [({"VLLM_ENGINES": "4"}, "VLLM_ENGINES 4 x VLLM_TP 1 must share exactly the actor's 8 GPUs"),
             ({"ACTOR_GPUS": "4"}, "the actor takes every GPU (NNODES 1 x GPUS_PER_NODE 8), got ACTOR_NODES= "
                                   "ACTOR_GPUS=4; unset them, or set COLOCATE=0"),
             ({"COLOCATE": "2"}, "COLOCATE must be 1 (actor and vLLM engines share every GPU) or 0"),
             ({"FAMILY": "async", "COLOCATE": "1"}, "async engines generate while the actor trains")]
    for env, message in cases:
        out = _run(eight, **env)
        assert out.returncode == 2 and message in out.stderr, (env, out.stderr)
    # async on one node: the split layout by default (actor 4 GPUs, 4 engines), no sleep flags
    printed = _run(REPO / "examples" / "scripts" / "train_math_qwen3_8b_async.sh", BACKEND="megatron")
    assert printed.returncode == 0, printed.stderr
    flags = printed.stdout.splitlines()
    assert "--train.colocate_all" not in flags and flags[flags.index("--actor.num_gpus_per_node") + 1] == "4"


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_header_phases_are_the_colocated_plan(name, layout_model):
    """The header's figures are colocation_memory and host_memory at the script's layout and the real model's
    config (what lpo-train --dry-run prints for it): every phase of the most loaded stage, each within 80 GB, and
    the fullest node's host memory (cluster review 3, G1 / G2 / G4)."""
    import json

    from openrlhf_lpo.core.config import dp_size
    from openrlhf_lpo.megatron.colocation_memory import GENERATION, SAVE, SYNC, TRAINING, colocated_memory
    from openrlhf_lpo.megatron.host_memory import node_host_memory
    from openrlhf_lpo.megatron.memory import GB

    script = REPO / "examples" / "scripts" / name
    args = _args(script, layout_model)
    hf = json.loads((REPO / "examples" / "model_configs" / MODEL_CONFIGS[name] / "config.json").read_text())
    m = args.megatron
    mem = colocated_memory(hf, m.tp, m.pp, dp_size(args), 5120, 4096, vllm_tp=args.vllm.tensor_parallel_size,
                           gpu_memory_utilization=args.vllm.gpu_memory_utilization,
                           sequence_parallel=m.sequence_parallel, save_hf=args.ckpt.save_hf)
    header = " ".join(line.lstrip("# ") for line in script.read_text().splitlines() if line.startswith("#"))
    for phrase, phase in (("generation {:.1f} GB", GENERATION), ("training {:.1f} GB", TRAINING),
                          ("weight sync {:.1f} GB", SYNC), ("checkpoint save {:.1f} GB", SAVE)):
        assert phrase.format(mem[phase]["total"] / GB) in header, (name, phrase.format(mem[phase]["total"] / GB))
        assert mem[phase]["total"] <= 80e9, (name, phase)
    assert f"~{mem[GENERATION]['KV cache tokens (at most)'] / 1000:.0f}k tokens" in header
    host = max(rows["total"] for *_, rows in node_host_memory(
        hf, tp=m.tp, pp=m.pp, dp=dp_size(args), gpus_per_node=args.actor.num_gpus_per_node, colocated=True,
        vllm_tp=args.vllm.tensor_parallel_size, save_hf=args.ckpt.save_hf))
    assert f"{host / GB:.1f} GB" in header, (name, host / GB)
    need = int(re.search(r">= (\d+) GB of host memory", header).group(1))
    assert host <= 0.95 * need * GB, (name, host / GB, need)


def test_the_14b_recipe_with_its_real_config_plans_every_phase_or_stops(capsys):
    """Parsed with Qwen3-14B's config.json (dimensions only): the plan's phases; at MEGATRON_TP=1 the actor's
    training phase cannot fit 80 GB and the parse stops (exit 2) naming the flags; with --megatron.host_memory_gb
    of a 512 GB node the host plan (709.8 GB) stops it, naming the flags."""
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.megatron.colocation_memory import colocated_plan_lines

    script = REPO / "examples" / "scripts" / "train_math_qwen3_14b_megatron.sh"
    model = str(REPO / "examples" / "model_configs" / "qwen3-14b")
    out = _run(script, MODEL=model)
    text = "\n".join(colocated_plan_lines(build_parser_and_parse(out.stdout.splitlines())))
    assert "generation (actor offloaded to the host, vLLM awake): 71.5 GB" in text
    assert "training (vLLM asleep, actor loaded: old-log-prob forward and update): 56.7 GB" in text
    assert "checkpoint save (vLLM weights awake; the actor's state read from host memory): 45.0 GB" in text
    bad = _run(script, MODEL=model, MEGATRON_TP="1")
    with pytest.raises(SystemExit) as e:
        build_parser_and_parse(bad.stdout.splitlines())
    assert e.value.code == 2
    assert "training needs 130.2 GB per GPU" in capsys.readouterr().err
    small = _run(script, MODEL=model, EXTRA_ARGS="--megatron.host_memory_gb 512")
    with pytest.raises(SystemExit) as e:
        build_parser_and_parse(small.stdout.splitlines())
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "needs 709.8 GB of host memory on node 0" in err and "--megatron.host_memory_gb 512" in err, err
