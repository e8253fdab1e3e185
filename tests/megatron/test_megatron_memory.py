"""The transients of ``openrlhf_lpo.megatron.memory`` (cluster review 2, N9) against hand computations: the
CE / entropy temporaries, torch AdamW's foreach ``sqrt(v)`` at the optimizer step, the stated allowance for
the CUDA context and NCCL buffers, and the one GPU measurement of a step's peak."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_lpo.megatron.memory import GB, actor_memory

REPO = Path(__file__).resolve().parents[2]
QWEN3_32B = json.loads((REPO / "examples" / "model_configs" / "qwen3-32b" / "config.json").read_text())


def _qwen3_32b_stage_params_per_gpu(tp: int) -> int:
    """By hand, Qwen3-32B at PP2: the last stage (32 layers, final norm, untied output layer) holds the
    most; everything is split over TP except the RMSNorm weights (2 per layer + q/k norms, final norm)."""
    h, q, k, f, V = 5120, 64 * 128, 8 * 128, 25600, 151936
    per_layer_sharded = h * (q + 2 * k) + q * h + 3 * h * f
    norms = 32 * (2 * h + 2 * 128) + h
    return (32 * per_layer_sharded + V * h) // tp + norms


def test_transients_of_the_32b_recipe_by_hand():
    T, A, tp = 5120, 4096, 8
    m = actor_memory(QWEN3_32B, tp, 2, 1, T, A, sequence_parallel=True, recompute=True)
    P = _qwen3_32b_stage_params_per_gpu(tp)
    assert m["parameters per GPU"] == P == 2_047_931_392
    # three fp32 [A, V/tp] tensors of the detached entropy (x - m, exp, product)
    assert m["CE / entropy temporaries, fp32 3 x [A, V/tp]"] == 3 * 4 * A * 151936 / tp
    # torch AdamW foreach: one fp32 sqrt(v) per main-param element (DP1: every element of the stage)
    assert m["optimizer step temporaries (AdamW foreach sqrt(v), fp32)"] == 4 * P
    assert m["optimizer step peak"] == (2 + 4 + 12 + 4) * P
    schedule = (18 * P + 64 * T * 2 * 5120 / tp  # static, layer inputs (SP + recompute)
                + m["one recomputed layer"] + 2 * T * 151936 / tp + 4 * A * 151936 / tp + 12 * A * 151936 / tp)
    assert m["forward/backward peak"] == pytest.approx(schedule, rel=1e-12)
    assert m["CUDA context + NCCL buffers (allowance)"] == 3e9
    assert m["peak"] == pytest.approx(max(schedule, 22 * P) + 3e9, rel=1e-12)
    assert round(m["peak"] / GB, 1) == 48.1  # the recipe header and docs/megatron.md say so


def test_the_adam_temporaries_follow_the_optimizer_shard():
    """Distributed optimizer over DP2: each rank steps half of the main params; without it, all of them."""
    P = _qwen3_32b_stage_params_per_gpu(8)
    dist2 = actor_memory(QWEN3_32B, 8, 2, 2, 5120, 4096, sequence_parallel=True)
    assert dist2["optimizer step temporaries (AdamW foreach sqrt(v), fp32)"] == 4 * P / 2
    assert dist2["optimizer step peak"] == 6 * P + 12 * P / 2 + 4 * P / 2
    full = actor_memory(QWEN3_32B, 8, 2, 2, 5120, 4096, sequence_parallel=True, distributed_optimizer=False)
    assert full["optimizer step temporaries (AdamW foreach sqrt(v), fp32)"] == 4 * P
    assert actor_memory(QWEN3_32B, 8, 2, 1, 5120, 4096, overhead_gb=1.5)["CUDA context + NCCL buffers (allowance)"] \
        == 1.5e9


def test_step_peak_matches_the_h200_measurement():
    """docs/megatron.md, run on one H200: a Qwen3-1.7B-shaped model (bf16, TP1, no distributed optimizer)
    peaked at 35.4 GiB in its first step (torch's allocator count, so without the allowance). 22 bytes per
    parameter -- weights 2, fp32 grads 4, main params 4, moments 8, AdamW's sqrt(v) 4 -- give 35.2 GiB; the
    static 18 bytes alone (28.8 GiB) missed 6.6 GiB."""
    cfg = {"model_type": "qwen3", "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936,
           "tie_word_embeddings": True}
    m = actor_memory(cfg, 1, 1, 1, 5120, 4096, recompute=True, distributed_optimizer=False, overhead_gb=0.0)
    assert m["parameters"] == pytest.approx(1.72e9, rel=3e-3)
    assert m["static total"] / 2**30 == pytest.approx(28.8, abs=0.05)
    assert m["optimizer step peak"] / 2**30 == pytest.approx(35.4, abs=0.3)


def test_cli_prints_the_new_rows():
    out = subprocess.run([sys.executable, "-m", "openrlhf_lpo.megatron.memory",
                          str(REPO / "examples" / "model_configs" / "deepseek-r1-distill-llama-70b"), "--tp", "8",
                          "--pp", "4", "--dp", "1", "--sp"], capture_output=True, text=True, check=True, cwd=str(REPO))
    lines = out.stdout.splitlines()
    assert "optimizer step temporaries (AdamW foreach sqrt(v), fp32): 9.08 GB" in lines
    assert "optimizer step peak: 49.96 GB" in lines and "peak: 52.96 GB" in lines
    assert lines.index("forward/backward peak: 43.10 GB") < lines.index("peak: 52.96 GB")
