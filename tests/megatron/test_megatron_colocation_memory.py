"""The colocated Megatron memory plan (openrlhf_lpo/megatron/colocation_memory.py) and the host memory per node
(openrlhf_lpo/megatron/host_memory.py) against hand computations.

Each phase's figures are worked out here from the model's dimensions with the documented formula (parameter
counts written out layer by layer, not taken from memory.py), for a tiny Qwen3 (exact bytes, allowances chosen
small) and for the Qwen3-8B shape the 8B recipe colocates on one 8 x 80 GB node: generation, training, weight
sync and the checkpoint save (cluster review 3, G1: the save no longer brings the actor's state back). The fit
checks stop a plan that does not fit, GPU or host memory, and name the flags to change; a multi-node layout is
planned per node.
"""

import json
from types import SimpleNamespace

import pytest

from openrlhf_lpo.cli.flags import FlagError
from openrlhf_lpo.megatron.colocation_memory import (GENERATION, HF_EXPORT, SAVE, SAVE_CHECKPOINT, SAVE_TRANSIENTS,
                                                     SYNC, TRAINING, check_colocated_fit, colocated_memory,
                                                     colocated_plan_lines, kv_cache_bytes_per_token,
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
    assert sync["total"] == pytest.approx(2 * p_s + 40_000 + 2 * p_s + 2 * 128 * 64 + 3 * 512 * 2**20, rel=1e-12)  # 3 buckets
    # checkpoint save: vLLM's weights awake + asleep, no actor state (read from host memory), the transients of the
    # largest tensor, the MLP's fused fc1 [2 x 128, 64] = 16384 elements (> the 128 x 64 embedding): its fp32 shard
    # (8192 at TP2) and that shard copied from the host, the TP gather list and the unsharded tensor (16384 each)
    save = mem[SAVE]
    assert save[SAVE_TRANSIENTS] == 4 * (8192 + 8192 + 16384 + 16384) == 196_608
    assert save[SAVE_CHECKPOINT] == pytest.approx(2 * p_s + 40_000 + 196_608, rel=1e-12)
    # --ckpt.save_hf: the bf16 weights come back and the largest tensor is gathered (list + whole, bf16)
    assert save[HF_EXPORT] == pytest.approx(2 * p_s + 40_000 + 2 * p_s + 2 * (2 * 16384), rel=1e-12)
    assert save["total"] == save[HF_EXPORT]
    without_hf = colocated_memory(TINY, 2, 1, 2, 16, 8, vllm_tp=2, gpu_memory_utilization=0.5, gpu_memory_gb=0.002,
                                  overhead_gb=0.0, vllm_context_gb=1e-5, vllm_asleep_gb=4e-5, save_hf=False)[SAVE]
    assert HF_EXPORT not in without_hf and without_hf["total"] == save[SAVE_CHECKPOINT]


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
    assert sync["total"] == pytest.approx(2 * total + 2e9 + 2 * p_s + 2 * 151936 * 4096 + 3 * 512 * 2**20 + 3e9, rel=1e-12)
    # the save: the embedding's fp32 shard [75968, 4096] twice, its TP gather list and the whole tensor; the HF
    # export (the larger) brings back the bf16 weights and gathers the embedding (bf16, list + whole)
    E = 75968 * 4096
    assert mem[SAVE][SAVE_TRANSIENTS] == 4 * (2 * E + 2 * 2 * E)
    assert mem[SAVE]["total"] == pytest.approx(2 * total + 2e9 + 2 * p_s + 2 * 2 * 151936 * 4096 + 3e9, rel=1e-12)
    assert round(mem[SAVE]["total"] / 1e9, 1) == 32.1 and round(mem[SAVE][SAVE_CHECKPOINT] / 1e9, 1) == 28.8


def test_the_14b_save_fits_because_nothing_comes_back():
    """Cluster review 3, G1: the save used to bring the whole actor state back (bf16 weights, fp32 gradient buffer,
    main params and moments: 44.3 GB at TP4 x DP2) while vLLM's weights were awake: 31.5 + 44.3 + 3 + the save's
    7.8 GB of transients = 86.6 GB > 80. Read from host memory it needs the transients only; the HF export, which
    brings the bf16 weights back, sets the phase at 45.0 GB."""
    total, p_s = _by_hand(5120, 40, 40, 8, 128, 17408, 151936, tp=4)
    E = 151936 * 5120 // 4
    transients = 4 * (2 * E + 2 * 4 * E)
    vllm = 2 * total + 2e9
    before = vllm + (2 + 4 + 12 / 2) * p_s + 3e9 + transients
    assert before / 1e9 > 80
    mem = colocated_memory(QWEN3_14B, 4, 1, 2, 5120, 4096, vllm_tp=1, gpu_memory_utilization=0.85)[SAVE]
    assert mem[SAVE_TRANSIENTS] == transients
    assert mem[SAVE_CHECKPOINT] == pytest.approx(vllm + transients + 3e9, rel=1e-12)
    assert mem["total"] == pytest.approx(vllm + 2 * p_s + 2 * 2 * 151936 * 5120 + 3e9, rel=1e-12)
    assert round(mem["total"] / 1e9, 1) == 45.0 and mem["total"] < 80e9


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
        ds=SimpleNamespace(zero_stage=3, enable_sleep=True), ckpt=SimpleNamespace(save_hf=True), dry_run=True)
    ns.megatron.params_dtype, ns.megatron.host_memory_gb, ns.vllm.enable_sleep = "bf16", None, True
    for key, value in over.items():
        group, name = key.split("__")
        setattr(getattr(ns, group), name, value)
    return ns


def test_the_14b_recipe_fits_and_prints_every_phase(tmp_path):
    args = _args(tmp_path, QWEN3_14B, megatron__tp=4)
    check_colocated_fit(args)
    text = "\n".join(colocated_plan_lines(args))
    assert "generation (actor offloaded to the host, vLLM awake): 71.5 GB" in text
    assert "training (vLLM asleep, actor loaded: old-log-prob forward and update): 56.7 GB" in text
    assert "actor parameters, gradient buffers, optimizer state (on the host): 0.0 GB" in text
    assert "checkpoint save (vLLM weights awake; the actor's state read from host memory): 45.0 GB" in text
    assert "WARNING" not in text and "per node" not in text  # one node, one stage


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


QWEN3_32B = dict(QWEN3_8B, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, intermediate_size=25600)


def test_a_save_that_does_not_fit_stops_naming_the_flags(tmp_path):
    """Qwen3-32B's whole weights on one GPU (vLLM TP1, 65.5 GB) at 0.9 of a 77 GB GPU: generation (72.8 GB), the KV
    cache and training fit, the save does not: the HF export brings the actor's bf16 weights back (77.7 GB); without
    --ckpt.save_hf the checkpoint alone (vLLM's weights, 7.0 GB of transients) still needs 77.5 GB."""
    over = dict(megatron__tp=8, megatron__pp=2, megatron__sequence_parallel=True, megatron__gpu_memory_gb=77.0,
                actor__num_nodes=2, vllm__num_engines=16, vllm__gpu_memory_utilization=0.9)
    with pytest.raises(FlagError, match=r"the checkpoint save needs 77\.7 GB per GPU .*the HF export brings .*raise "
                                        r"--vllm\.tensor_parallel_size .*drop --ckpt\.save_hf"):
        check_colocated_fit(_args(tmp_path, QWEN3_32B, **over))
    with pytest.raises(FlagError, match=r"the checkpoint save needs 77\.5 GB per GPU .*the save's transients 7\.0 GB"):
        check_colocated_fit(_args(tmp_path, QWEN3_32B, ckpt__save_hf=False, **over))


def test_several_nodes_are_planned_node_by_node(tmp_path):
    """Qwen3-32B colocated on 2 nodes (TP8 x PP2, 8 engines x TP2): node 0 holds stage 0, node 1 stage 1; each line
    is the plan of its own stage's parameters (node_layout: node-major ranks, stage (r // tp) % pp)."""
    from openrlhf_lpo.megatron.memory import node_layout

    assert node_layout(16, 8, 8, 2) == [(0, 0, 7, [0]), (1, 8, 15, [1])]
    assert node_layout(16, 8, 2, 4) == [(0, 0, 7, [0, 1, 2, 3]), (1, 8, 15, [0, 1, 2, 3])]  # TP2 x PP4 x DP2
    args = _args(tmp_path, QWEN3_32B, megatron__tp=8, megatron__pp=2, megatron__sequence_parallel=True,
                 actor__num_nodes=2, vllm__tensor_parallel_size=2)
    check_colocated_fit(args)
    lines = colocated_plan_lines(args)
    for node in (0, 1):
        mem = colocated_memory(QWEN3_32B, 8, 2, 1, 5120, 4096, vllm_tp=2, gpu_memory_utilization=0.85,
                               sequence_parallel=True, stage=node)
        want = (f"  node {node} (ranks {8 * node}-{8 * node + 7}, stage {node}): " +
                ", ".join(f"{ph} {mem[ph]['total'] / 1e9:.1f}" for ph in (GENERATION, TRAINING, SYNC, SAVE)))
        assert want in lines, (want, lines)
        assert all(mem[ph]["total"] < 80e9 for ph in (GENERATION, TRAINING, SYNC, SAVE))


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
    assert len(with_ref) == len(base) + 4  # generation, training, sync and save


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


# ----------------------------------------------------------------------------- host memory per node (G2)


def test_host_memory_by_hand():
    """host_memory.py, written out: a rank's host pool (bf16 weights + fp32 main params + Adam moments over DP, the
    gradient buffer dropped, rounded up to 4 KiB), vLLM's tensors of one TP rank (they add up to its weights) and
    its sleep backups (torch's segments, each rounded up to a power of two)."""
    from openrlhf_lpo.megatron.host_memory import actor_pool_bytes, node_host_memory, vllm_backup_bytes, vllm_tensor_bytes

    _, p_s = _by_hand(64, 4, 4, 2, 16, 128, 128, tp=2)
    tiny = Shape.of(TINY)
    assert actor_pool_bytes(tiny, 2, 1, 2) == 663_552 == -(-(2 * p_s + 12 * p_s // 2) // 4096) * 4096
    assert actor_pool_bytes(tiny, 2, 1, 2, params_dtype="fp32") == -(-(4 * p_s + 8 * p_s // 2) // 4096) * 4096
    assert sum(vllm_tensor_bytes(tiny, 2)) == vllm_weight_bytes(tiny, 2) == 2 * p_s
    assert vllm_backup_bytes(tiny, 2) == 2 * 2**20  # every tensor under 1 MiB: one 2 MiB segment
    # Qwen3-8B at TP1, per layer: QKV 48 MiB -> 64, o 32 -> 32, gate-up 192 -> 256, down 96 -> 128 MiB; embedding and
    # output layer 1187 MiB (1188 in 2 MiB segments) -> 2048 MiB each; the norms share one 2 MiB segment
    MiB = 2**20
    assert vllm_backup_bytes(Shape.of(QWEN3_8B), 1) == (36 * (64 + 32 + 256 + 128) + 2 * 2048 + 2) * MiB
    # one 8-GPU node of the 8B recipe, colocated: 8 pools of TP2 x DP4, 8 vLLM backups, 2 checkpoint writers (TP
    # ranks of the first replica: 2 GiB + the unsharded fp32 embedding and its shard for the one holding it, fc1 for
    # the other), rank 0's HF export buffer, 16 processes
    _, p8 = _by_hand(4096, 36, 32, 8, 128, 12288, 151936, tp=2)
    [(node, first, last, rows)] = node_host_memory(QWEN3_8B, tp=2, pp=1, dp=4, gpus_per_node=8, colocated=True)
    assert (node, first, last) == (0, 0, 7)
    pool = -(-(2 * p8 + 12 * p8 // 4) // 4096) * 4096
    vh, fc1 = 151936 * 4096, 2 * 12288 * 4096
    want = [8 * pool, 8 * vllm_backup_bytes(Shape.of(QWEN3_8B), 1),
            2 * (2 * 2**30 + 4 * fc1 * 1.5) + 4 * (vh - fc1) * 1.5, 4 * 2**30 + 2 * vh, 16 * 6e9]
    assert [rows[k] for k in rows if k != "total"] == pytest.approx(want, rel=1e-12)
    assert rows["total"] == pytest.approx(sum(want), rel=1e-12) and round(rows["total"] / 1e9, 1) == 453.3
    # split (COLOCATE=0): no pools, no vLLM backups on the actor's node
    [(_, _, _, split)] = node_host_memory(QWEN3_8B, tp=2, pp=1, dp=2, gpus_per_node=4, colocated=False)
    assert not any("pool" in k or "vLLM" in k for k in split)


def test_host_memory_check_names_the_flags(tmp_path, monkeypatch):
    """--megatron.host_memory_gb: the fullest node above 95% of it stops the parse (flags named); unset, a dry run
    only prints the plan; a launch on a machine with an accelerator checks its own memory; 0 turns it off."""
    from openrlhf_lpo.megatron import device
    from openrlhf_lpo.megatron.host_memory import _validate, host_plan_lines, machine_memory_gb

    args = _args(tmp_path, QWEN3_14B, megatron__host_memory_gb=700.0)  # needs 709.8 GB
    with pytest.raises(FlagError, match=r"needs 709\.8 GB of host memory on node 0 .*above 95% of "
                                        r"--megatron\.host_memory_gb 700: set --megatron\.host_memory_gb .*"
                                        r"--actor\.num_nodes.*--vllm\.tensor_parallel_size .*COLOCATE=0"):
        _validate(args)
    _validate(_args(tmp_path, QWEN3_14B, megatron__host_memory_gb=748.0))  # 709.8 <= 0.95 x 748
    _validate(_args(tmp_path, QWEN3_14B, megatron__host_memory_gb=0.0))
    with pytest.raises(FlagError, match=r"--megatron\.host_memory_gb must be >= 0"):
        _validate(_args(tmp_path, QWEN3_14B, megatron__host_memory_gb=-1.0))
    unset = _args(tmp_path, QWEN3_14B)
    _validate(unset)  # a dry run: printed, not checked
    text = "\n".join(host_plan_lines(unset))
    assert "host memory per node (megatron/host_memory.py; not checked: pass --megatron.host_memory_gb" in text
    assert "  node 0 (ranks 0-7): 709.8 GB" in text
    launch = _args(tmp_path, QWEN3_14B)
    launch.dry_run = False
    _validate(launch)  # no accelerator here: unchecked
    monkeypatch.setattr(device, "accelerator_available", lambda: True)  # a launch on a GPU machine of this memory
    with pytest.raises(FlagError, match=rf"above 95% of this machine's {machine_memory_gb():.0f} GB"):
        _validate(launch)
