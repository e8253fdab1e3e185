"""Megatron actor on CPU/gloo in TP=2, PP=2, TP2xPP2 and DP2 (distributed optimizer) layouts.

References are independent of megatron (see mcore_checks/references.py): the HF model in float64 run on
each unpadded sequence, and a plain torch step (autograd, clip_grad_norm_, AdamW) in float64.
Also: packed sequences (alone / left-padded by 300 / packed with others), no S x S tensor at
S=4096, activation recompute, clip-higher, the off-policy target s_t, layout-changing resumes,
Llama / Mistral, per-rank weight reads, TP groups within nodes, collectives on the group's device.
Each test first asserts that the world's checks it reads ran ok (``world_checks``: a failure names the
check and carries its traceback).
"""

import pytest

from .mcore_checks import ORDER
from .mcore_records import world_checks

pytestmark = pytest.mark.e2e  # the shared 4-rank Megatron gloo world

LAYOUTS_Q3 = [
    "tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp1pp2_distopt", "tp2pp1_distopt",
]


# every lpo/* metric the DeepSpeed trainer logs for an LPO update with --lpo.end_kl (no behaviour correction)
DEEPSPEED_LPO_METRICS = {
    "lpo/kl_start", "lpo/kl_last", "lpo/kl_end", "lpo/entropy_p_start", "lpo/entropy_p_last", "lpo/entropy_p_end",
    "lpo/entropy_target", "lpo/degenerate_frac", "lpo/tau_mean", "lpo/tau_max", "lpo/tau_min", "lpo/abs_coef_mean",
    "lpo/two_pass", "lpo/one_pass_windows", "lpo/shortcut_windows", "lpo/pre_pass_windows", "lpo/groups",
    "lpo/divergence_start", "lpo/divergence_last", "lpo/divergence_end",
}


# the checks whose records are the layouts' (``<model>/tp<T>pp<P>[_distopt]/<loss>/mbs<M>``)
LAYOUT_CHECKS = ("layouts_qwen3_tied", "checkpoint_export", "layouts_qwen3_untied", "layouts_qwen2_untied",
                 "layouts_llama_untied", "layouts_mistral_untied")


def _is_layout(key):
    return "/" in key and "wrong_" not in key


def _layout_records(mcore_world):
    for checks in world_checks(mcore_world, *LAYOUT_CHECKS):
        for key, rec in checks.items():
            if _is_layout(key):
                yield key, rec


def test_every_check_has_its_outcome_on_every_rank(mcore_world):
    """The runner recorded every check of the world on every rank, in order, and the world held together
    (the barrier after each check passed). A check that raised is its own tests' failure, not this one's."""
    for r in mcore_world:
        assert "error" not in r, f"rank {r['rank']} failed before its first check:\n{r['error']}"
        assert "world_broken" not in r, f"rank {r['rank']}: {r['world_broken']}"
        assert list(r["status"]) == list(ORDER), (r["rank"], list(r["status"]))


def test_every_layout_ran(mcore_world):
    keys = set(world_checks(mcore_world, *LAYOUT_CHECKS)[0])
    for lay in LAYOUTS_Q3:
        mbs = 4 if lay == "tp2pp2" else 2
        assert f"qwen3_tied/{lay}/listwise/mbs{mbs}" in keys
    for k in ("qwen3_untied/tp2pp2/listwise/mbs4", "qwen2_untied/tp1pp1/listwise/mbs2",
              "qwen2_untied/tp2pp2/listwise/mbs4", "qwen3_tied/tp2pp2/listwise_surrogate/mbs1",
              "qwen3_tied/tp2pp1/pg/mbs2", "qwen3_tied/wrong_qkv",
              "qwen3_tied/tp2pp1/listwise@pointwise@fwd/mbs2", "qwen3_tied/tp1pp2/listwise@listwise@js/mbs2",
              "qwen3_tied/tp2pp2/listwise_surrogate@pointwise@fwd/mbs1",
              "qwen3_tied/tp1pp2/pg_hi/mbs2", "llama_untied/tp2pp1/listwise/mbs2", "llama_untied/tp1pp2/listwise/mbs2",
              "mistral_untied/tp2pp1/listwise/mbs2", "mistral_untied/tp1pp2/listwise/mbs2"):
        assert k in keys


def test_log_probs_match_hf_and_tp1(mcore_world):
    """Every layout and architecture (Llama 3 RoPE scaling, Mistral) against HF float64."""
    for checks in world_checks(mcore_world, *LAYOUT_CHECKS):
        for key, rec in checks.items():
            if not _is_layout(key):
                continue
            assert rec["logp_vs_hf"] < 1e-5, (key, rec["logp_vs_hf"])
            model = key.split("/")[0]
            if f"{model}/tp1pp1/listwise/mbs2" not in checks:
                continue
            tp1 = checks[f"{model}/tp1pp1/listwise/mbs2"]["logp"]
            diff = max(abs(a - b) for ra, rb in zip(rec["logp"], tp1) for a, b in zip(ra, rb))
            assert diff < 1e-5, (key, diff)


def test_grad_norm_same_in_every_layout_and_reference(mcore_world):
    for key, rec in _layout_records(mcore_world):
        rel = abs(rec["grad_norm"] - rec["grad_norm_ref"]) / rec["grad_norm_ref"]
        assert rel < 1e-5, (key, rec["grad_norm"], rec["grad_norm_ref"])
        if "/listwise/" in key:
            assert rec["grad_norm"] > 0.5  # clipping (max norm 0.5) is active, not vacuous


def test_updated_weights_match_plain_torch_step(mcore_world):
    for key, rec in _layout_records(mcore_world):
        assert rec["weights_moved"] > 5e-4, key  # lr 1e-3: the step really moved weights
        assert rec["weights_vs_ref"] < 1e-5, (key, rec["weights_vs_ref"])


def test_update_is_the_gradient_step_not_only_its_signs(mcore_world):
    """Adam with lr = eps = 1e5 and no clipping is an SGD step of lr 1: the exported update equals
    minus the float64 plain-torch gradient element by element, and its norm is the gradient's norm,
    which differs between the two losses (a sign-only update, lr * sign(g), would have the same norm
    for both)."""
    for checks in world_checks(mcore_world, "update_magnitude"):
        rec = checks["update_magnitude"]
        for name, r in rec.items():
            assert r["max_grad"] > 1e-2, (name, r)  # a real gradient
            assert r["update_vs_sgd_rel"] < 1e-4, (name, r)
            assert abs(r["update_norm"] / r["grad_norm_ref"] - 1) < 1e-4, (name, r)
            assert abs(r["grad_norm"] / r["grad_norm_ref"] - 1) < 1e-5, (name, r)
        norms = sorted(r["grad_norm_ref"] for r in rec.values())
        assert norms[1] > 1.1 * norms[0], rec  # the two losses differ in size, and the updates follow


def test_names_and_export_round_trip_bit_exact(mcore_world):
    for key, rec in _layout_records(mcore_world):
        assert rec["names_match"], key
        assert rec["export_bitexact"], key


def test_wrong_qkv_layout_and_rope_scaling_are_caught(mcore_world):
    for checks in world_checks(mcore_world, "layouts_qwen3_tied", "layouts_llama_untied"):
        assert checks["qwen3_tied/wrong_qkv"]["logp_vs_hf"] > 1e-2
        assert checks["llama_untied/wrong_rope"]["logp_vs_hf"] > 1e-4  # Llama 3.1 RoPE scaling matters


def test_clip_higher_is_honoured(mcore_world):
    """--actor.eps_clip_low_high 0.2 0.28 on ratios in (1.2, 1.28): the step follows the asymmetric
    reference, which differs from the symmetric one."""
    for checks in world_checks(mcore_world, "layouts_qwen3_tied"):
        rec = checks["qwen3_tied/tp1pp2/pg_hi/mbs2"]
        assert abs(rec["grad_norm"] - rec["grad_norm_ref"]) / rec["grad_norm_ref"] < 1e-5
        assert abs(rec["grad_norm_ref"] - rec["grad_norm_sym_ref"]) / rec["grad_norm_ref"] > 1e-2
        assert rec["weights_vs_ref"] < 1e-5


def test_packed_sequences_same_alone_left_padded_and_packed(mcore_world):
    """A sequence's log-probs alone, left-padded by 300 tokens and packed with three others agree
    to 1e-5 (and with HF float64) in TP1, TP2 and PP2; each rank read exactly its own shard of the
    safetensors checkpoint (a fraction of the model when tp*pp > 1)."""
    for checks in world_checks(mcore_world, "packing"):
        rec = checks["packing"]
        for lay in ("tp1pp1", "tp2pp1", "tp1pp2"):
            r = rec[lay]
            assert r["packed_vs_alone"] < 1e-5 and r["left300_vs_alone"] < 1e-5, (lay, r)
            assert r["packed_vs_hf"] < 1e-5 and r["left300_vs_hf"] < 1e-5, (lay, r)
            assert r["weights_read"] == r["local_numel"], (lay, r)
        assert rec["tp1pp1"]["weights_read"] == rec["hf_numel"]
        assert rec["tp2pp1"]["weights_read"] < 0.55 * rec["hf_numel"]
        assert rec["tp1pp2"]["weights_read"] < 0.6 * rec["hf_numel"]


def test_no_s_by_s_tensor_at_4096_tokens(mcore_world):
    """No op output with two dimensions >= S in the log-prob pass and a training step at S=4096;
    the monitor does flag megatron's stock masked attention (negative control, rank 0)."""
    for checks in world_checks(mcore_world, "no_sxs"):
        rec = checks["no_sxs"]
        assert rec["hits"] == [] and rec["S"] == 4096
        assert rec["max_numel"] < 4096 * 4096 // 8
    assert world_checks(mcore_world, "no_sxs")[0]["no_sxs"]["control_hits"] > 0


def test_gradient_checkpointing_maps_to_megatron_recompute(mcore_world):
    for checks in world_checks(mcore_world, "recompute"):
        off, on = checks["recompute"]["recompute=False"], checks["recompute"]["recompute=True"]
        assert off["granularity"] is None and on["granularity"] == "full"
        assert on["layer_calls"] == 2 * off["layer_calls"] > 0  # every layer re-run in the backward
        assert on["grad_norm"] == off["grad_norm"] and checks["recompute"]["weights_diff"] == 0.0


def test_off_policy_target_composes(mcore_world):
    """w* = softmax(R/tau + s_t) with s against the behaviour log-probs: zero gradient for equal
    rewards at the start of the update (not without s_t); brute-force step with informative rewards."""
    for checks in world_checks(mcore_world, "offpolicy"):
        rec = checks["offpolicy"]
        assert rec["s_t_abs_max"] > 0.02
        assert rec["equal_rewards_grad_norm"] < 1e-5 < 1e-2 < rec["without_s_t_grad_norm"]
        assert abs(rec["grad_norm"] - rec["grad_norm_ref"]) / rec["grad_norm_ref"] < 1e-5
        assert rec["weights_vs_ref"] < 1e-5


def test_checkpoints_resume_in_another_layout(mcore_world):
    """TP2 -> TP1 and PP2 (distributed optimizer) -> TP2 continue the uninterrupted run (Adam
    moments restored: without them step 2 differs); TP1 -> PP2 restores the tied output layer;
    --ckpt.max_num 1 keeps one directory; a crash mid-save leaves 'latest' on the last whole one."""
    for checks in world_checks(mcore_world, "reshard"):
        for name in ("tp2_to_tp1", "pp2_to_tp2"):
            r = checks["reshard"][name]
            assert r["client_ok"] and r["step"] == 2
            assert r["loaded_vs_saved"] == 0.0
            assert r["step2_moved"] > 5e-4 and r["step2_vs_continued"] < 1e-6, r
            assert abs(r["grad_norm"][0] - r["grad_norm"][1]) < 1e-6
        r = checks["reshard"]["tp2_to_tp1"]
        assert r["no_moments_vs_continued"] > 1e-4
        assert r["dirs_after_prune"] == ["global_step2"] and r["latest"] == "global_step2"
        assert r["crash_raised"] and r["latest_after_crash"] == "global_step2"
        assert "global_step3" not in r["dirs_after_crash"]
        assert r["tp1_to_pp2_vs_saved"] == 0.0


def test_tp_groups_must_stay_inside_a_node(mcore_world):
    for checks in world_checks(mcore_world, "nodes"):
        rec = checks["nodes"]
        assert rec["AABB_tp2"] == "ok"
        assert "ranks [0, 1, 2, 3] spans nodes ['A', 'B']" in rec["AABB_tp4"]
        assert "--megatron.tp 2" in rec["ABAB_tp2"] and "spans nodes" in rec["ABAB_tp2"]


def test_collective_tensors_on_the_group_device(mcore_world):
    """Every tensor handed to a torch.distributed collective during the whole run (megatron's own,
    the actor's stats and --lpo.end_kl metrics, checkpoint gathers) sits on its group's device."""
    for checks in world_checks(mcore_world, "census"):
        assert checks["collectives"]["calls"] > 1000
        assert checks["collectives"]["mismatches"] == []


def test_checkpoint_resume_reproduces_step_two(mcore_world):
    for checks in world_checks(mcore_world, "checkpoint_export"):
        rec = checks["qwen3_tied/tp1pp2_distopt/listwise/mbs2"]
        assert rec["resume_client_state"] == 1
        assert rec["step2_moved"] > rec["weights_moved"]  # step 2 happened
        assert rec["resume_grad_norm_diff"] < 1e-9
        assert rec["resume_weights_diff"] < 1e-9


def test_checkpoint_writers_alone_hold_full_tensors_and_tp2_pp2_resumes(mcore_world):
    """TP2 x PP2: each rank holds, during the save, exactly the full fp32 tensors it writes (gathered to it, not
    all-gathered to every TP rank), the two TP ranks of a stage share the writing, and the run resumes."""
    per_rank = [checks["qwen3_tied/tp2pp2/listwise/mbs4"] for checks in world_checks(mcore_world, "checkpoint_export")]
    assert len(per_rank) == 4
    total = per_rank[0]["save_accounting"]["checkpoint_tensors"]
    for rec in per_rank:
        acc = rec["save_accounting"]
        assert acc["all_gather"] == 0 and acc["gather"] > 0, acc
        assert acc["full"] == acc["written_tensors"] and acc["full_bytes"] == acc["written_bytes"] > 0, acc
        assert acc["written_tensors"] < total / 2  # a rank holds part of its stage, not the stage or the model
        assert rec["resume_client_state"] == 1
        assert rec["resume_grad_norm_diff"] < 1e-9 and rec["resume_weights_diff"] < 1e-9
        assert rec["step2_moved"] > rec["weights_moved"]
    assert sum(rec["save_accounting"]["full"] for rec in per_rank) == total


def test_weight_stream_reaches_rank0_once_per_tensor(mcore_world):
    """TP2 x PP2 (rank = tp + 2 pp): the stream to rank 0 gives it the same tensors bit for bit as the stream to
    every rank, with no PP broadcast; stage 1's TP rank 0 sends each of its tensors once, rank 0 receives them,
    the TP rank 1s and the other ranks receive nothing."""
    acc = [checks["qwen3_tied/tp2pp2/listwise/mbs4"]["export_accounting"]
           for checks in world_checks(mcore_world, "checkpoint_export")]
    assert len(acc) == 4 and acc[0]["same_tensors"]
    old, new = [a["all_ranks"] for a in acc], [a["rank0"] for a in acc]
    n = old[0]["tensors"]
    assert n > 10 and all(o["tensors"] == n and o["broadcast"] > 0 for o in old)  # before: every rank, every tensor
    assert new[0]["tensors"] == n and new[0]["bytes"] == old[0]["bytes"]
    assert [a["tensors"] for a in new[1:]] == [0, 0, 0] and [a["bytes"] for a in new[1:]] == [0, 0, 0]
    assert all(a["broadcast"] == 0 and a["all_gather"] == 0 for a in new)
    assert new[2]["send"] == new[0]["recv"] > 0 and new[0]["send"] == 0 and new[2]["recv"] == 0
    assert all(a["send"] == a["recv"] == 0 for a in (new[1], new[3]))
    assert new[2]["send"] < old[2]["broadcast"]  # only its own stage's tensors leave stage 1


def test_policy_actor_wrapper_fit_sync_resume(mcore_world):
    """The Ray policy-actor class (driven without a Ray cluster, TP2 x DP2): two fit()
    iterations, weight sync into an HF rollout stand-in, checkpoint + HF save, resume."""
    per_rank = world_checks(mcore_world, "policy_actor")
    for checks in per_rank:
        rec = checks["policy_actor"]
        assert rec["fit_steps"] == 1.0 and rec["fit_grad_norm"] > 0
        assert rec["resume_states"] == {"episode": 1}
        assert rec["resume_vs_saved"] == 0.0  # resumed weights are the checkpointed ones
        assert rec["hf_ckpt_vs_saved"] == 0.0  # the HF checkpoint holds the same weights
        assert rec["iter2_moved"] > 5e-4
        assert rec["resume_iter2_diff"] < 1e-6
        assert abs(rec["grad_norm_iter2"][0] - rec["grad_norm_iter2"][1]) < 1e-6
    rank0 = per_rank[0]["policy_actor"]
    assert rank0["engine_updates"] == 1
    assert rank0["engine_vs_actor"] < 1e-5  # the engine scores with the actor's weights
    # --lpo.end_kl over the DP group (each DP rank holds half the groups) vs brute force on HF
    got, ref = rank0["end_kl"]
    assert abs(got - ref) < 1e-5 and abs(rank0["start_kl"][0] - rank0["start_kl"][1]) < 1e-6
    assert abs(got - rank0["start_kl"][0]) > 1e-5 and rank0["end_groups"] == 4
    # the lpo/* metrics of the DeepSpeed trainer (core/listwise_metrics.update_metrics), with values that
    # agree with the brute-force ones: the trained divergence is fwd, so divergence_* = kl_* (up to this check's
    # float32 w*, whose sum is 1 to 1e-7: the end-KL statistics assume sum w* = 1, the divergence does not)
    m = rank0["lpo_metrics"]
    assert DEEPSPEED_LPO_METRICS <= set(m), DEEPSPEED_LPO_METRICS - set(m)
    assert abs(m["lpo/divergence_start"] - m["lpo/kl_start"]) < 1e-6 and abs(m["lpo/divergence_end"] - got) < 1e-5
    if rank0["fit_steps"] == 1:  # one window at the rollout's parameters: s_last = s_t - 0.01, the same softmax
        assert abs(m["lpo/kl_last"] - m["lpo/divergence_start"]) < 1e-7
    assert m["lpo/groups"] == 4 and m["lpo/abs_coef_mean"] > 0
    # the schedule's switch reached fit, and the resumed run (same divergence call) repeats update 2 exactly
    assert rank0["iter2_divergence"] == "rev"
    got, ref = rank0["pg_end_kl"]  # the same metrics from a GRPO (group_norm) fit()
    assert abs(got - ref) < 1e-5 and rank0["pg_moved"] > 1e-5


def test_weight_stream_to_vllm_engines(mcore_world):
    """Towards vLLM engines, in buckets of --megatron.sync_bucket_mb 0.0125 (13107 bytes): bf16 tensors (the engines'
    dtype, whatever the actor's) unpacked from each broadcast buffer equal the export bit for bit, in order; one
    update_weight_bucket per bucket, numbered 0, 1, ... and on over the next sync; small tensors share buckets,
    a tensor larger than a bucket goes alone; prefix caches reset once after the last bucket; --vllm.sync_with_ray
    broadcasts the same buffers with Ray collectives."""
    rec = world_checks(mcore_world, "policy_actor")[0]["policy_actor"]
    assert rec["vllm_names_ok"] and rec["vllm_values_ok"]
    assert rec["vllm_dtypes"] == ["torch.bfloat16"] and rec["vllm_buffers"] == ["torch.uint8"]
    buckets = rec["vllm_buckets"]
    n = len(buckets)
    assert rec["vllm_seqs"] == list(range(n)) and rec["vllm_empty_cache"] == [n - 1]
    assert all(k == 1 for k, size in buckets if size > 13107) and any(size > 13107 for _, size in buckets)
    assert any(k > 1 for k, _ in buckets) and all(size <= 13107 for k, size in buckets if k > 1)
    tensors = sum(k for k, _ in buckets)
    assert n < tensors, buckets  # fewer calls than tensors (the 8B count: benchmarks/weight_sync_buckets.py)
    assert rec["vllm_last_sync"] == {"route": "broadcast", "tensors": tensors, "buckets": n, "calls": n, "seq": n}
    assert rec["vllm_reset_last"]
    count, expect = rec["ray_sync_count"]
    assert count == expect == n and rec["ray_sync_ok"] and rec["ray_sync_no_reset"]
    assert rec["ray_sync_seqs"] == list(range(n, 2 * n))  # the sender's numbers run on over the run


def test_layout_changes_release_their_process_groups(mcore_world):
    """Every layout change re-initialises megatron's parallel state; the groups of the old layout are shut
    down (each gloo group's TCP loop keeps polling otherwise). At the end only WORLD, the last layout's
    groups and the few a check makes itself may be live, not one set per layout change."""
    for checks in world_checks(mcore_world, "census"):
        g = checks["groups"]
        assert g["held"] > 0
        assert g["live"] <= g["held"] + 1 + 4, g
