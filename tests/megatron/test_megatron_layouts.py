"""Megatron actor on CPU/gloo in TP=2, PP=2, TP2xPP2 and DP2 (distributed optimizer) layouts.

References are independent of megatron (see mcore_worker.py): the HF model in float64 run on
each unpadded sequence, and a plain torch step (autograd, clip_grad_norm_, AdamW) in float64.
"""

import pytest

LAYOUTS_Q3 = [
    "tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp1pp2_distopt", "tp2pp1_distopt",
]


def _checks(mcore_world):
    for r in mcore_world:
        assert r["ok"], f"rank {r['rank']} failed:\n{r.get('error')}"
    return [r["checks"] for r in mcore_world]


def _layout_records(mcore_world):
    for checks in _checks(mcore_world):
        for key, rec in checks.items():
            if "wrong_qkv" not in key and key != "policy_actor":
                yield key, rec


def test_every_layout_ran(mcore_world):
    keys = set(_checks(mcore_world)[0])
    for lay in LAYOUTS_Q3:
        mbs = 4 if lay == "tp2pp2" else 2
        assert f"qwen3_tied/{lay}/listwise/mbs{mbs}" in keys
    for k in ("qwen3_untied/tp2pp2/listwise/mbs4", "qwen2_untied/tp1pp1/listwise/mbs2",
              "qwen2_untied/tp2pp2/listwise/mbs4", "qwen3_tied/tp2pp2/listwise_surrogate/mbs1",
              "qwen3_tied/tp2pp1/pg/mbs2", "qwen3_tied/wrong_qkv",
              "qwen3_tied/tp2pp1/listwise@pointwise@fwd/mbs2", "qwen3_tied/tp1pp2/listwise@listwise@js/mbs2"):
        assert k in keys


def test_log_probs_match_hf_and_tp1(mcore_world):
    for checks in _checks(mcore_world):
        for key, rec in checks.items():
            if "wrong_qkv" in key or key == "policy_actor":
                continue
            assert rec["logp_vs_hf"] < 1e-5, (key, rec["logp_vs_hf"])
            model = key.split("/")[0]
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


def test_names_and_export_round_trip_bit_exact(mcore_world):
    for key, rec in _layout_records(mcore_world):
        assert rec["names_match"], key
        assert rec["export_bitexact"], key


def test_wrong_qkv_layout_is_caught(mcore_world):
    for checks in _checks(mcore_world):
        assert checks["qwen3_tied/wrong_qkv"]["logp_vs_hf"] > 1e-2


def test_checkpoint_resume_reproduces_step_two(mcore_world):
    for checks in _checks(mcore_world):
        rec = checks["qwen3_tied/tp1pp2_distopt/listwise/mbs2"]
        assert rec["resume_client_state"] == 1
        assert rec["step2_moved"] > rec["weights_moved"]  # step 2 happened
        assert rec["resume_grad_norm_diff"] < 1e-9
        assert rec["resume_weights_diff"] < 1e-9


def test_policy_actor_wrapper_fit_sync_resume(mcore_world):
    """The Ray policy-actor class (driven without a Ray cluster, TP2 x DP2): two fit()
    iterations, weight sync into an HF rollout stand-in, checkpoint + HF save, resume."""
    for checks in _checks(mcore_world):
        rec = checks["policy_actor"]
        assert rec["fit_steps"] == 1.0 and rec["fit_grad_norm"] > 0
        assert rec["resume_states"] == {"episode": 1}
        assert rec["resume_vs_saved"] == 0.0  # resumed weights are the checkpointed ones
        assert rec["hf_ckpt_vs_saved"] == 0.0  # the HF checkpoint holds the same weights
        assert rec["iter2_moved"] > 5e-4
        assert rec["resume_iter2_diff"] < 1e-6
        assert abs(rec["grad_norm_iter2"][0] - rec["grad_norm_iter2"][1]) < 1e-6
    rank0 = _checks(mcore_world)[0]["policy_actor"]
    assert rank0["engine_updates"] == 1
    assert rank0["engine_vs_actor"] < 1e-5  # the engine scores with the actor's weights
    # --lpo.end_kl over the DP group (each DP rank holds half the groups) vs brute force on HF
    got, ref = rank0["end_kl"]
    assert abs(got - ref) < 1e-5 and abs(rank0["start_kl"][0] - rank0["start_kl"][1]) < 1e-6
    assert abs(got - rank0["start_kl"][0]) > 1e-5 and rank0["end_groups"] == 4
    got, ref = rank0["pg_end_kl"]  # the same metrics from a GRPO (group_norm) fit()
    assert abs(got - ref) < 1e-5 and rank0["pg_moved"] > 1e-5
