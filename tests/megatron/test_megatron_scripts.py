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
            "VLLM_ENGINES", "VLLM_TP", "ACTOR_NODES", "ACTOR_GPUS")


@pytest.fixture(scope="module")
def layout_model(tmp_path_factory):
    from openrlhf_lpo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tp8") / "q3", arch="qwen3", hidden_size=64, num_layers=4,
                            num_heads=8, num_kv_heads=8, head_dim=8, intermediate_size=128)


def _args(script, model):
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    env = {k: v for k, v in os.environ.items() if k not in KEEP_OUT}
    env.update(LPO_PRINT_ARGS="1", METHOD="lpo_fwd", MODEL=model)
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
