"""Training options of the Megatron actor on gloo (the shared 4-rank world of
conftest.py; the numbers come from the checks of tests/megatron/mcore_checks/, the references are independent):

* KL loss (k1/k2/k3 against reference log-probs) and the entropy bonus: token means over the window,
  grad norm and weights vs a float64 plain-torch step, TP1 / TP2 / PP2, listwise and PG;
* learning-rate schedules: the sequence of a Megatron run equals the one OpenRLHF's DeepSpeed path
  builds (``DeepspeedStrategy._ds_init_train_model``, run here with a stand-in for deepspeed.initialize),
  and a resume continues it; every scheduler OpenRLHF can run gives the same sequence;
* the listwise off-policy target (``--algo.advantage.is_correction_level token``, clip and mask) through
  ``fit``, window by window against the float64 reference, with the first-window shortcut (forwards counted);
* token-budget micro-batches (TP2 x PP2 and PP2 x DP2 with unequal token totals): counts agreed, exact;
* a partial GRPO batch dealt 520 vs 512 samples finishes with equal step counts on both replicas;
* no host syncs of ours inside the schedule, CE / entropy on response rows only, rope fusion with TE.

Each world test first asserts that the checks it reads ran ok (``world_checks``: a failure names the check
and carries its traceback).
"""

import math
from types import SimpleNamespace as NS
from unittest import mock

import pytest
import torch

from .mcore_records import world_checks


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# ----------------------------------------------------------------------------- KL loss and entropy bonus


def test_kl_loss_and_entropy_bonus_match_the_float64_reference(mcore_world):
    """The actor's settings parsed from ``--algo.kl.estimator / --algo.kl.init_coef / --actor.entropy_coef``
    (mcore_checks/update_maths.py, ``kl_entropy``), the reference computing the named estimator itself."""
    for checks in world_checks(mcore_world, "kl_entropy"):
        rec = checks["kl_entropy"]
        assert set(rec) == {"tp1pp1/listwise/k3", "tp2pp1/listwise/k1", "tp1pp2/pg/k2"}
        for key, r in rec.items():
            assert _rel(r["grad_norm"], r["grad_norm_ref"]) < 1e-5, (key, r)
            assert r["weights_vs_ref"] < 1e-5, (key, r)
            # the terms change the step (the check is not vacuous) and the KL is a real number
            assert _rel(r["grad_norm_ref"], r["grad_norm_without_terms"]) > 1e-2, (key, r)
            assert r["kl"] > 1e-3, (key, r)


# ----------------------------------------------------------------------------- learning-rate schedules


def upstream_lr_sequence(name, warmup_ratio, min_lr_ratio, steps, n, lr=1e-3):
    """The learning rate of each of the first ``n`` optimizer steps of OpenRLHF 0.11.2's DeepSpeed actor:
    ``DeepspeedStrategy._ds_init_train_model`` builds the scheduler factory it hands deepspeed.initialize;
    DeepSpeed's engine calls the factory on its optimizer and steps it after every optimizer step. Only
    deepspeed.initialize is replaced (by that behaviour: AdamW from the optimizer config, then the factory)."""
    from openrlhf.utils.deepspeed import deepspeed as ds_mod
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy

    seen = {}

    def fake_config(optim_dict=None, *, max_norm=None):
        seen["optim"] = optim_dict
        return {}

    def fake_initialize(model, optimizer, model_parameters, lr_scheduler, config, args, dist_init_required):
        opt = torch.optim.AdamW(model_parameters, lr=seen["optim"]["params"]["lr"])
        return model, opt, None, lr_scheduler(opt)

    strategy = DeepspeedStrategy.__new__(DeepspeedStrategy)
    strategy.ds_tensor_parallel_size = 1
    strategy.deepcompile = False
    strategy.get_ds_train_config = fake_config
    cfg = dict(optim="adam", muon={}, adam={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
               lr_scheduler=name, lr_warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio, max_norm=1.0,
               scheduler_steps=steps)
    with mock.patch.object(ds_mod.deepspeed, "initialize", fake_initialize):
        _, opt, sched = strategy._ds_init_train_model(torch.nn.Linear(2, 2), cfg)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_lr_sequence_equals_the_deepspeed_runs_and_resumes(mcore_world):
    """OpenRLHF's defaults (cosine_with_min_lr, warmup 0.03, min 0.1) over 40 steps: warmup steps 0, 1
    (ceil(1.2) = 2), then the cosine; the Megatron optimizer's groups hold exactly that lr when it
    steps, step 0 (lr 0) leaves the weights untouched, and a resume after step 3 continues the sequence."""
    ds = upstream_lr_sequence("cosine_with_min_lr", 0.03, 0.1, 40, 6)
    assert ds[0] == 0.0 and ds[2] == pytest.approx(1e-3) and ds[5] < ds[3] < ds[2]
    for checks in world_checks(mcore_world, "lr_schedule"):
        rec = checks["lr_schedule"]
        assert rec["lrs"] == pytest.approx(ds, rel=1e-12, abs=1e-15)
        assert [g[0] for g in rec["optimizer_group_lrs"]] == pytest.approx(ds, rel=1e-9, abs=1e-15)
        assert all(len(g) == 1 for g in rec["optimizer_group_lrs"])  # every group of the optimizer
        assert rec["step0_moved"] == 0.0
        assert rec["resumed_lrs"] == pytest.approx(ds[3:], rel=1e-12)
        assert rec["actor_lr_after"] == pytest.approx(upstream_lr_sequence("cosine_with_min_lr", 0.03, 0.1, 40, 7)[6])


SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr"]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_every_scheduler_openrlhf_runs_gives_the_deepspeed_sequence(name):
    from openrlhf_lpo.megatron.schedule import LRSchedule

    ds = upstream_lr_sequence(name, 0.1, 0.2, 30, 30, lr=2e-6)
    mine = LRSchedule(2e-6, name, 0.1, 0.2, total_steps=30)
    seq = []
    for _ in range(30):
        seq.append(mine.lr)
        mine.step()
    assert seq == pytest.approx(ds, rel=1e-12, abs=1e-20)
    if name != "constant":
        assert len(set(round(x, 18) for x in ds)) > 2  # a schedule that moves


def test_a_resumed_lr_schedule_continues_the_deepspeed_sequence(tmp_path):
    """What a Megatron checkpoint stores of the schedule and restores into a fresh actor's schedule
    (``with_schedule`` / ``restore_schedule``, the calls of ``MegatronActor.save/load_checkpoint``), written
    and read back as the checkpoint does (``torch.save``, ``load_client_state``): saved after step 3, the
    resumed schedule gives steps 4-6 of OpenRLHF's DeepSpeed sequence, not step 1 again. A checkpoint of
    another schedule is refused by name."""
    from openrlhf_lpo.megatron.checkpoint import load_client_state
    from openrlhf_lpo.megatron.schedule import LRSchedule, restore_schedule, with_schedule

    ds = upstream_lr_sequence("cosine_with_min_lr", 0.1, 0.1, 20, 6)
    make = lambda name="cosine_with_min_lr": LRSchedule(1e-3, name, 0.1, 0.1, total_steps=20)  # noqa: E731
    run, path = make(), tmp_path / "client_state.pt"
    for i in range(3):
        run.step()
    torch.save(with_schedule({"episode": 2}, run), path)
    fresh = make()
    rest = restore_schedule(load_client_state(str(path)), fresh)
    assert rest == {"episode": 2}
    resumed = []
    for _ in range(3):
        resumed.append(fresh.lr)
        fresh.step()
    assert resumed == pytest.approx(ds[3:6], rel=1e-12) and len(set(ds[:4])) == 4  # a moving part of the schedule
    with pytest.raises(ValueError, match="'cosine_with_min_lr'.*--actor.lr_scheduler is 'linear'"):
        restore_schedule(load_client_state(str(path)), make("linear"))


def test_schedulers_openrlhf_cannot_run_are_refused_and_the_list_is_complete():
    """transformers' other names fail on the DeepSpeed side too (they need arguments OpenRLHF does not
    pass, or a metric at every step): refused at parse time with the reason."""
    from transformers.trainer_utils import SchedulerType

    from openrlhf_lpo.megatron.schedule import check_lr_scheduler

    refused = sorted(set(t.value for t in SchedulerType) - set(SCHEDULERS))
    assert refused == ["greedy", "reduce_lr_on_plateau", "warmup_stable_decay"]
    for name in refused:
        with pytest.raises(Exception):
            upstream_lr_sequence(name, 0.1, 0.2, 10, 2)
        with pytest.raises(ValueError, match=f"--actor.lr_scheduler {name}: OpenRLHF's scheduler construction"):
            check_lr_scheduler(name, 0.1, 0.2)
    for name in SCHEDULERS:
        check_lr_scheduler(name, 0.03, 0.1)


def test_the_policy_actor_gives_the_scheduler_openrlhfs_max_steps():
    from openrlhf_lpo.megatron.ray_actor import megatron_config_from_args

    args = NS(megatron=NS(tp=1, pp=1), actor=NS(adam=NS(lr=1e-6), max_norm=1.0, lr_scheduler="cosine_with_min_lr",
                                                 lr_warmup_ratio=0.03, min_lr_ratio=0.1),
              train=NS(micro_batch_size=1, seed=1), rollout=NS(temperature=1.0))
    cfg = megatron_config_from_args(args)
    assert (cfg.lr_scheduler, cfg.lr_warmup_ratio, cfg.min_lr_ratio) == ("cosine_with_min_lr", 0.03, 0.1)


# ----------------------------------------------------------------------------- off-policy target / shortcut


def test_listwise_off_policy_target_through_fit_is_exact(mcore_world):
    """is_correction clip and mask: s_t = delta equals the independent numpy delta, every step's grad norm
    and the final weights equal the window-by-window float64 reference (2 windows x 2 epochs)."""
    for checks in world_checks(mcore_world, "offpolicy_fit"):
        for mode in ("clip", "mask"):
            r = checks["offpolicy_fit"][mode]
            assert r["delta_vs_ref"] < 1e-6 and r["delta_abs_max"] > 0.05, r
            assert len(r["grad_norms"]) == 4
            for got, ref in zip(r["grad_norms"], r["grad_norms_ref"]):
                assert abs(got - ref) <= 1e-5 * max(ref, 1.0), (mode, r)
            assert r["weights_vs_ref"] < 1e-5 and r["weights_moved"] > 1e-3, r


def test_first_window_takes_c_from_s_t_without_a_forward(mcore_world):
    """Micro-batches of 1 < K split groups: window 1 of epoch 1 takes c = dD/ds(s_t) (no forward), the
    three later windows one no-grad pre-pass each. Forwards counted: 8 training micro-batches + 3 x 2
    pre-pass micro-batches = 14 (a pre-pass in every window, as before, gives 16)."""
    for checks in world_checks(mcore_world, "offpolicy_fit"):
        for mode in ("clip", "mask"):
            r = checks["offpolicy_fit"][mode]
            assert r["modes"] == ["shortcut", "pre_pass", "pre_pass", "pre_pass"]
            assert r["shortcut_windows"] == 1.0 and r["pre_pass_windows"] == 3.0
            train = sum(len(m) for m in r["micro"])
            assert train == 8 and r["forwards"] == train + 3 * 2


# ----------------------------------------------------------------------------- token budgets


def test_token_budget_micro_batches_agree_and_are_exact(mcore_world):
    per_rank = world_checks(mcore_world, "dynamic_batching")
    for key in ("tp2pp2/lpo_whole", "tp2pp2/lpo_split", "tp2pp2/grpo", "pp2dp2/lpo_whole", "pp2dp2/lpo_split",
                "pp2dp2/grpo"):
        recs = [c["dynamic_batching"][key] for c in per_rank]
        counts = recs[0]["counts_all_ranks"]
        assert all(c == counts[0] for c in counts), (key, counts)  # every rank ran the same number of micro-batches
        for r in recs:
            assert _rel(r["grad_norm"], r["grad_norm_ref"]) < 1e-5, (key, r)
            assert r["weights_vs_ref"] < 1e-5, (key, r)
            toks = r["micro_tokens"][0]
            assert len(set(toks)) > 1 or key.startswith("pp2dp2"), (key, toks)  # unequal token counts
        expected_mode = {"lpo_whole": "one_pass", "lpo_split": "shortcut", "grpo": "pg"}[key.split("/")[1]]
        assert recs[0]["modes"] == [expected_mode]
    # PP2 x DP2: the replicas' own first-fit counts differ (replica 1 holds the longest groups), the
    # agreed count is their maximum
    dp2 = [c["dynamic_batching"]["pp2dp2/grpo"] for c in per_rank]
    local = [r["local_count"] for r in dp2]
    assert local[0] != local[2] and all(len(r["micro"][0]) == max(local) for r in dp2)
    # the budget is respected wherever a sample fits it
    whole = per_rank[0]["dynamic_batching"]["tp2pp2/lpo_whole"]
    assert max(whole["micro_tokens"][0]) <= whole["budget"]


# ----------------------------------------------------------------------------- F1, F11


def test_partial_pg_batch_with_unequal_shares_finishes(mcore_world):
    """66 vs 64 samples, window 64 (F1's 520 vs 512 at window 512, scaled down): both replicas run 2 optimizer
    steps (33 + 33, 32 + 32); before,
    replica 0 ran 2 and replica 1 one, and the world hung in the second step's gradient all-reduce."""
    recs = [c["pg_partial_batch"] for c in world_checks(mcore_world, "pg_partial_batch")]
    assert [r["samples"] for r in recs] == [66, 66, 64, 64]
    assert all(r["optimizer_steps"] == 2.0 for r in recs)
    assert [r["windows"] for r in recs] == [[33, 33]] * 2 + [[32, 32]] * 2
    assert all(math.isfinite(g) and g > 0 for r in recs for g in r["grad_norms"])


def test_no_host_syncs_in_the_loss_path_and_response_rows_only(mcore_world):
    for checks in world_checks(mcore_world, "syncs_and_rows"):
        rec = checks["syncs_and_rows"]
        assert rec["predictable_tokens"] > 1.5 * rec["response_tokens"]  # prompts are long enough to matter
        assert rec["logp_ce_rows"] == rec["response_tokens"] and rec["logp_zero_outside_mask"] == 0.0
        keys = [k for k in rec if "/micro" in k]
        assert len(keys) == 4
        for k in keys:
            assert rec[k]["syncs"] == [], (k, rec[k]["syncs"])
            # megatron's own: none from the THD RoPE any more (it made 6 per layer per micro-batch)
            assert not [w for w in rec[k]["other_syncs"] if w.startswith("rope_utils.py")], (k, rec[k]["other_syncs"])
        assert rec["rope"]["installed"]
        for case in ("one", "three"):  # the recipes' one sequence per micro-batch, and a packed row
            assert rec["rope"][case]["equal"] and rec["rope"][case]["syncs"] == [] and rec["rope"][case]["moved"] > 0.1
            assert rec[k]["ce_rows"] == rec[k]["local_response_tokens"], (k, rec[k])
        assert rec["apply_rope_fusion"] is False  # CPU: megatron's unfused THD RoPE (no TE)
        assert rec["te_overrides"] == {"apply_rope_fusion": True}  # with TE: its fused THD kernel


# ----------------------------------------------------------------------------- offload between phases


def test_offload_round_trip_is_bit_exact_and_leaves_nothing_resident(mcore_world):
    """The Megatron actor's parameters, DDP gradient buffers, main-grad views, the distributed optimizer's main
    fp32 shards and Adam moments go to host memory and back at TP2 and at PP2 (mcore_checks/offload.py): every
    byte is equal, none stays on the device in between, and the next step equals a run without the round trip
    (and without the sleeps before it, whose gradients came back zeroed, not copied)."""
    for checks in world_checks(mcore_world, "offload"):
        for name, r in checks["offload"].items():
            assert r["tracked_bytes"] > 0 and r["moved_bytes"] == r["tracked_bytes"], name
            assert r["resident_after_offload"] == 0 and r["param_bytes_after_offload"] == 0, name
            assert r["optimizer_bytes_after_offload"] == 0, name
            assert r["ddp_buffers"] >= 2 and r["optimizer_state"] > 0 and r["main_shards"] > 0, name
            assert r["main_grads"] > 0, name
            assert r["bit_exact"] and r["step2_equal"] and r["step2_optimizer_equal"], name


def _pool_by_hand(regions):
    """The host pool's bytes after these regions: each starts at the next multiple of 64, the end rounded up to
    4096 (a page: the smallest power-of-two slab)."""
    end = 0
    for n in regions:
        end = -(-end // 64) * 64 + n
    return -(-end // 4096) * 4096


def test_the_actors_sleep_drops_gradients_reuses_one_pool_and_saves_from_host_memory(mcore_world):
    """Cluster review 3, G1 and G2, on the Ray actor's sleep and checkpoint mixins (mcore_checks/offload.py, TP2 and
    PP2, distributed optimizer, bf16): the gradient buffers are dropped (never copied) and zeroed on every wake; the
    weights and optimizer state fill one host pool whose size is the same after every cycle and equals its
    regions rounded up as planned, made of power-of-two slabs; what a rank copies is the plan's formula (its
    parameters per memory.rank_parameters, bf16 in megatron's padded DDP buffer; 12 bytes per element of main
    params and moments, each element owned by one DP rank; Adam's step counters); the checkpoint saved asleep
    brings no tracked byte back to the device and writes the same tensors as a save made awake."""
    owned = {}
    for checks in world_checks(mcore_world, "offload"):
        for name, r in checks["offload"].items():
            sl = r["sleep"]
            first = sl["first_sleep"]
            assert sl["rank_params"] == sl["plan_rank_params"] > 0, (name, sl["rank_params"], sl["plan_rank_params"])
            assert first["weights_bytes"] == sl["param_buffer_bytes"] >= 2 * sl["rank_params"], name  # + padding
            assert first["grad_bytes_dropped"] == sl["grad_buffer_bytes"] == 2 * first["weights_bytes"], name
            assert first["param_bytes_resident"] == 0 and first["tracked_bytes_resident"] == 0, name
            owned.setdefault((name, sl["stage"], sl["tp_rank"]), []).append(
                (first["state_bytes"] - sl["step_bytes"], sl["plan_rank_params"], sl["dp"]))
            cycles = [e for e in sl["sleeps"][1:] if e["state_bytes"]]  # the full sleeps after each reload
            assert len(cycles) == 3 and all((e["weights_bytes"], e["state_bytes"], e["grad_bytes_dropped"]) ==
                                            (first["weights_bytes"], first["state_bytes"], first["grad_bytes_dropped"])
                                            for e in cycles), (name, sl["sleeps"])
            assert sl["grads_zeroed_on_wake"] == [True, True, True], name
            # one pool, the same size after every sleep, as planned from its regions
            pool = _pool_by_hand(sl["regions"])
            assert sl["pool_bytes"] == [pool] * 4 and first["host_pool_bytes"] == pool, (name, sl["pool_bytes"], pool)
            assert sum(sl["regions"]) == first["weights_bytes"] + first["state_bytes"], name
            assert sum(sl["slabs"]) == pool and all(n & (n - 1) == 0 for n in sl["slabs"]), (name, sl["slabs"])
            assert sl["weights_only"]["param_bytes"] > 0 and sl["weights_only"]["state_resident"] == 0, name
            # the save: awake, then asleep from host memory; nothing came back; the same files
            awake, asleep = sl["saves"]
            assert not awake["state_offloaded"] and asleep["state_offloaded"], name
            assert asleep["resident_bytes_max"] == 0 and sl["asleep_after_save"] == 0, name
            assert asleep["planned_transient_bytes"] > 0, name
            assert sl["save_files_equal"] and sl["save_tensors"] > 0, name
    for key, parts in owned.items():  # main params + two moments, 12 bytes per element, over the DP group
        assert len(parts) == parts[0][2] == 2, key
        assert sum(p for p, _, _ in parts) == 12 * parts[0][1], (key, parts)


# ----------------------------------------------------------------------------- colocated weight route (IPC)


def test_ipc_weight_route_hands_over_the_nccl_routes_tensors_bit_for_bit(mcore_world):
    """--train.colocate_all's weight route (openrlhf_lpo/megatron/weight_sync.py, mcore_checks/weight_ipc.py) with the
    shared-memory stand-in for CUDA IPC, at TP2 and PP2 (DP2), fp32 and bf16, in buckets of 13107 bytes: the four
    ranks (one host: one node group, rank 0 its leader) hand over a handle of each bucket keyed by their own device;
    a receiver rebuilds all four ranks' handles (three from other processes) and each unpacked tensor equals the NCCL
    route's tensor (export_hf_weights(dst=0)) bit for bit, names, order, dtype and shape included; one call per
    bucket, numbered on from the previous sync; small tensors share buckets, larger ones go alone; the last bucket
    carries empty_cache=True and the prefix-cache reset comes after it."""
    checks = world_checks(mcore_world, "weight_ipc")
    bucket = int(0.0125 * (1 << 20))
    for rank, c in enumerate(checks):
        assert sorted(c["weight_ipc"]) == ["pp2/bf16", "pp2/fp32", "tp2/bf16", "tp2/fp32"]
        for name, r in c["weight_ipc"].items():
            assert r["tensors"] == 46, (rank, name)  # the tiny qwen3's HF tensors (tied: no lm_head)
            assert len(set(r["device_ids"])) == 4 and r["route_ranks"] == [0, 1, 2, 3], (rank, name)
            assert r["calls"] == (r["buckets"] if rank == 0 else 0) and r["engines"] == (rank == 0), (rank, name)
    for layout in ("tp2", "pp2"):
        fp32, bf16 = checks[0]["weight_ipc"][f"{layout}/fp32"], checks[0]["weight_ipc"][f"{layout}/bf16"]
        assert fp32["seqs"] == list(range(fp32["buckets"]))
        assert bf16["seqs"] == list(range(fp32["buckets"], fp32["buckets"] + bf16["buckets"]))  # one sender
        assert bf16["buckets"] < fp32["buckets"] < 46  # fewer calls than tensors; fewer still at half the bytes
    for name, r in checks[0]["weight_ipc"].items():
        assert r["nccl_tensors"] == r["tensors"] and r["names_equal"], name
        assert r["handles_per_tensor"] == [4] and r["keys_equal_device_ids"], name
        assert r["mismatches"] == [], (name, r["mismatches"][:5])
        assert r["dtypes"] == (["torch.bfloat16"] if name.endswith("bf16") else ["torch.float32"]), name
        assert r["empty_cache"] == [r["buckets"] - 1] and r["reset_last"], name
        sizes = r["per_bucket"]  # [tensors, [buffer bytes of the 4 handles]]
        assert all(len(b) == 1 for _, b in sizes), name  # every rank packs the same buckets
        assert all(k == 1 for k, b in sizes if b[0] > bucket) and any(b[0] > bucket for _, b in sizes), name
        assert any(k > 1 for k, _ in sizes), name
        assert r["elements"] > 150_000, name
