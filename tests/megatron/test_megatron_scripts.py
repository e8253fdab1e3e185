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
            "ROLLOUT_MICRO_BATCH_SIZE")


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
