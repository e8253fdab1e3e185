"""The colocated Megatron memory plan (openrlhf_lpo/megatron/colocation_memory.py) against hand computations.

Each phase's figures are worked out here from the model's dimensions with the documented formula (parameter
counts written out layer by layer, not taken from memory.py), for a tiny Qwen3 (exact bytes, allowances chosen
small) and for the Qwen3-8B shape the 8B recipe colocates on one 8 x 80 GB node. The fit check stops a plan that
does not fit and names the flags to change.
"""

import json
from types import SimpleNamespace

import pytest

from openrlhf_lpo.cli.flags import FlagError
from openrlhf_lpo.megatron.colocation_memory import (GENERATION, SYNC, TRAINING, check_colocated_fit,
                                                     colocated_memory, colocated_plan_lines, kv_cache_bytes_per_token,
                                                     vllm_weight_bytes)
from openrlhf_lpo.megatron.memory import Shape

TINY = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 128,
        "tie_word_embeddings": False}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "tie_word_embeddings": False, "max_position_embeddings": 32768}
QWEN3_14B = dict(QWEN3_8B, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=17408)


def _by_hand(h, L, heads, kv, hd, f, V, tp):
    """(parameters of the model, parameters of one TP rank): q/k/v/o and the SwiGLU MLP sharded, the two norms and
    Qwen3's q/k norms of each layer and the final norm replicated, embedding and output layer sharded (untied)."""
    q, k = heads * hd, kv * hd
    sharded = h * (q + 2 * k) + q * h + 3 * h * f
    replicated = 2 * h + 2 * hd
    total = L * (sharded + replicated) + 2 * V * h + h
    per_rank = (L * sharded + 2 * V * h) // tp + L * replicated + h
    return total, per_rank


def test_tiny_qwen3_every_phase_by_hand():
    # h 64, 4 layers, q 64, k 32, FFN 128, V 128: a layer shards 8192 + 4096 + 24576 and replicates 160
    total, p_s = _by_hand(64, 4, 4, 2, 16, 128, 128, tp=2)
    assert (total, p_s) == (164544, 82624)
    shape = Shape.of(TINY)
    assert vllm_weight_bytes(shape, 1) == 2 * total and vllm_weight_bytes(shape, 2) == 2 * p_s
    assert kv_cache_bytes_per_token(shape, 2) == 2 * 4 * 1 * 16 * 2  # K and V, 4 layers, 1 KV head per rank
    assert kv_cache_bytes_per_token(shape, 4) == 2 * 4 * 1 * 16 * 2  # 2 KV heads over 4 ranks: one each (replicated)
    # TP2 x DP2, distributed optimizer, full recompute, a 16-token micro-batch with 8 action tokens; vLLM TP2 at
    # 0.5 of a 2e6-byte GPU; allowances: actor 0, vLLM context 1e4 bytes, vLLM asleep 4e4 bytes
    mem = colocated_memory(TINY, 2, 1, 2, 16, 8, vllm_tp=2, gpu_memory_utilization=0.5, gpu_memory_gb=0.002,
                           overhead_gb=0.0, vllm_context_gb=1e-5, vllm_asleep_gb=4e-5)
    static = 2 * p_s + 4 * p_s + 12 * p_s // 2  # 991,488
    fwd_bwd = (static + 2 * 64 * 16 * 4  # layer inputs kept by recompute, bf16 [T, h] x L
               + 2 * (4 * 64 + (2 * 64 + 2 * 32 + 3 * 128) // 2) * 16  # one recomputed layer
               + 2 * 16 * 64 + 4 * 8 * 64 + 12 * 8 * 64)  # logits bf16, action rows fp32, CE / entropy temporaries
    step = static + 4 * p_s // 2  # AdamW's sqrt(v) per main-param element of the rank
    assert (static, fwd_bwd, step) == (991488, 1027328, 1156736)
    gen, train, sync = mem[GENERATION], mem[TRAINING], mem[SYNC]
    assert gen["total"] == pytest.approx(1_000_000 + 10_000, rel=1e-12)  # budget + vLLM's context + actor 0
    assert gen["actor parameters, gradient buffers, optimizer state (on the host)"] == 0
    assert gen["  of which KV cache + activation peak"] == pytest.approx(1_000_000 - 2 * p_s - 30_000, rel=1e-12)
    assert gen["KV cache tokens (at most)"] == pytest.approx((1_000_000 - 2 * p_s - 30_000) / 256, rel=1e-12)
    assert train["actor static (bf16 weights, fp32 gradient buffer, main params + Adam moments)"] == static
    assert train["actor forward/backward peak"] == fwd_bwd and train["actor optimizer step peak"] == step
    assert train["total"] == pytest.approx(max(fwd_bwd, step) + 40_000, rel=1e-12)  # vLLM asleep keeps 4e4
    # vLLM weights + asleep, the actor's bf16 weights, the output layer gathered whole (bf16)
    assert sync["total"] == pytest.approx(2 * p_s + 40_000 + 2 * p_s + 2 * 128 * 64, rel=1e-12)


def test_qwen3_8b_colocated_on_one_node_by_hand():
    """The 8B recipe's figures (docs/megatron.md): actor TP2 x DP4, 8 engines x TP1 at 0.85 of 80 GB."""
    total, p_s = _by_hand(4096, 36, 32, 8, 128, 12288, 151936, tp=2)
    assert (total, p_s) == (8_190_735_360, 4_095_521_792)
    T, A, V2, h, L = 5120, 4096, 151936 // 2, 4096, 36
    static = 2 * p_s + 4 * p_s + 12 * p_s // 4
    fwd_bwd = (static + 2 * h * T * L + 2 * (4 * h + (2 * 4096 + 2 * 1024 + 3 * 12288) // 2) * T
               + 2 * T * V2 + 4 * A * V2 + 12 * A * V2)
    step = static + 4 * p_s // 4
    mem = colocated_memory(QWEN3_8B, 2, 1, 4, T, A, vllm_tp=1, gpu_memory_utilization=0.85, gpu_memory_gb=80)
    gen, train, sync = mem[GENERATION], mem[TRAINING], mem[SYNC]
    assert fwd_bwd == 44_535_141_376 and step == 40_955_217_920
    assert train["actor forward/backward peak"] == fwd_bwd and train["actor optimizer step peak"] == step
    assert train["total"] == pytest.approx(fwd_bwd + 3e9 + 2e9, rel=1e-12)  # actor allowance 3 GB, vLLM asleep 2 GB
    assert round(train["total"] / 1e9, 1) == 49.5
    assert gen["total"] == pytest.approx(0.85 * 80e9 + 0.5e9 + 3e9, rel=1e-12) and round(gen["total"] / 1e9, 1) == 71.5
    kv = 0.85 * 80e9 - 2 * total - 1.5e9
    assert gen["KV cache tokens (at most)"] == pytest.approx(kv / (2 * 36 * 8 * 128 * 2), rel=1e-12)  # 339,888
    assert sync["total"] == pytest.approx(2 * total + 2e9 + 2 * p_s + 2 * 151936 * 4096 + 3e9, rel=1e-12)


def _args(tmp_path, hf, **over):
    """The namespace the fit check reads: a colocated Megatron run of ``hf`` (recipe settings), ``over`` replacing
    ``group.field`` values."""
    (tmp_path / "config.json").write_text(json.dumps(hf))
    ns = SimpleNamespace(
        backend="megatron",
        megatron=SimpleNamespace(tp=4, pp=1, sequence_parallel=False, distributed_optimizer=True, gpu_memory_gb=80.0),
        actor=SimpleNamespace(model_name_or_path=str(tmp_path), num_nodes=1, num_gpus_per_node=8,
                              gradient_checkpointing_enable=True),
        train=SimpleNamespace(colocate_all=True, async_enable=False, micro_batch_size=1),
        vllm=SimpleNamespace(num_engines=8, tensor_parallel_size=1, gpu_memory_utilization=0.85),
        data=SimpleNamespace(max_len=5120), rollout=SimpleNamespace(max_new_tokens=4096),
        algo=SimpleNamespace(kl=SimpleNamespace(init_coef=0.0)), ref=SimpleNamespace(offload=False),
        ds=SimpleNamespace(zero_stage=3))
    for key, value in over.items():
        group, name = key.split("__")
        setattr(getattr(ns, group), name, value)
    return ns


def test_the_14b_recipe_fits_and_prints_both_phases(tmp_path):
    args = _args(tmp_path, QWEN3_14B, megatron__tp=4)
    check_colocated_fit(args)
    text = "\n".join(colocated_plan_lines(args))
    assert "generation (actor offloaded to the host, vLLM awake): 71.5 GB" in text
    assert "training (vLLM asleep, actor loaded: old-log-prob forward and update): 56.7 GB" in text
    assert "actor parameters, gradient buffers, optimizer state (on the host): 0.0 GB" in text
    assert "WARNING" not in text


def test_a_phase_that_does_not_fit_stops_naming_the_flags(tmp_path):
    with pytest.raises(FlagError, match=r"training needs 130\.2 GB per GPU .*raise --megatron\.tp or --megatron\.pp"):
        check_colocated_fit(_args(tmp_path, QWEN3_14B, megatron__tp=1))
    # 0.99 x 80 + 0.5 + 3 = 82.7 > 80: the largest utilization that fits is (80 - 3.5) / 80 = 0.956 -> 0.95
    with pytest.raises(FlagError, match=r"generation needs 82\.7 GB .*--vllm\.gpu_memory_utilization to at most 0\.95"):
        check_colocated_fit(_args(tmp_path, QWEN3_14B, vllm__gpu_memory_utilization=0.99))
    with pytest.raises(FlagError, match=r"leaves no KV cache .*raise --vllm\.gpu_memory_utilization or "
                                        r"--vllm\.tensor_parallel_size"):
        check_colocated_fit(_args(tmp_path, QWEN3_14B, vllm__gpu_memory_utilization=0.35))  # 28 GB < 29.5 weights
    with pytest.raises(FlagError, match=r"does not fit 60 GB per GPU \(--megatron\.gpu_memory_gb 60\)"):
        check_colocated_fit(_args(tmp_path, QWEN3_14B, megatron__gpu_memory_gb=60.0, vllm__gpu_memory_utilization=0.5))


def test_no_check_when_off_or_not_colocated(tmp_path):
    check_colocated_fit(_args(tmp_path, QWEN3_14B, megatron__tp=1, megatron__gpu_memory_gb=0.0))
    split = _args(tmp_path, QWEN3_14B, megatron__tp=1, train__colocate_all=False)
    check_colocated_fit(split)
    assert colocated_plan_lines(split) == []
    assert colocated_plan_lines(_args(tmp_path, QWEN3_14B, train__async_enable=True)) == []


def test_a_reference_model_counts_in_every_phase(tmp_path):
    """--algo.kl.init_coef > 0: the DeepSpeed reference shares the GPUs; ZeRO-3 shards its bf16 weights over 8."""
    base = colocated_plan_lines(_args(tmp_path, QWEN3_14B))
    with_ref = colocated_plan_lines(_args(tmp_path, QWEN3_14B, algo__kl=SimpleNamespace(init_coef=0.01)))
    ref = 2 * 14_768_307_200 / 8 / 1e9  # Qwen3-14B's parameters (40 layers, untied)
    assert _by_hand(5120, 40, 40, 8, 128, 17408, 151936, tp=1)[0] == 14_768_307_200
    assert f"reference model (DeepSpeed, bf16): {ref:.1f} GB" in "\n".join(with_ref)
    assert len(with_ref) == len(base) + 3


def test_colocated_placement_counts_each_gpu_once():
    """cluster.demands_from_args: colocated engines sit on the actor's GPUs, so the 14B recipe (TP4 x DP2 with 8
    engines x TP1) needs one 8-GPU node, not two; an engine wider than the actor's TP group makes the block that
    must share a node lcm(tp, vllm_tp) GPUs; a colocated reference model takes no GPU of its own."""
    from openrlhf_lpo.megatron import cluster

    def run(tp, vtp, engines, colocate=True, kl=0.0):
        return SimpleNamespace(megatron=SimpleNamespace(tp=tp, pp=1),
                               actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=8),
                               vllm=SimpleNamespace(num_engines=engines, tensor_parallel_size=vtp),
                               train=SimpleNamespace(colocate_all=colocate, colocate_actor_ref=False, async_enable=False),
                               algo=SimpleNamespace(kl=SimpleNamespace(init_coef=kl)),
                               ref=SimpleNamespace(num_nodes=1, num_gpus_per_node=8))

    placed = cluster.plan_placement([8], cluster.demands_from_args(run(4, 1, 8)))
    assert [sum(g for _, g in node) for node in placed] == [8]
    with pytest.raises(cluster.PlacementError, match="needs 8 GPUs"):
        cluster.plan_placement([4, 4], cluster.demands_from_args(run(8, 1, 8)))
    assert [(d.gpus, d.count) for d in cluster.demands_from_args(run(1, 2, 4, kl=0.01))] == [(2, 4)]
    with pytest.raises(cluster.PlacementError, match="needs 16 GPUs"):  # split: engines on GPUs of their own
        cluster.plan_placement([8], cluster.demands_from_args(run(4, 1, 8, colocate=False)))
