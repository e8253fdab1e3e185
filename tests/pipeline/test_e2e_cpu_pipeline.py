"""End to end on the CPU: the real OpenRLHF Ray pipeline with LPO trains, and a resume continues it.

One module-scoped set of runs of ``python -m openrlhf_lpo.cli.train_ppo_ray --algo.advantage.estimator
lpo`` (local Ray, the stock trainer/actors plus the LPO subclasses, DeepSpeed ZeRO-2 on gloo with two
data-parallel ranks, a tiny random Qwen3 built offline, the CPU rollout engine). The reward is the
fraction of vowels in the response (tests/pipeline/toy_reward.py): continuous, so every group is
informative and the listwise gradient is never zero. 14 prompts in batches of 4: steps 1-3 hold 4
groups (two optimizer windows each: the first from s_t, the second after a no-grad pre-pass), step 4
is the partial last batch of 2 groups.

* run A: the four steps uninterrupted;
* run B: the same command killed (SIGKILL, the whole process group) as soon as the step-2
  checkpoint is complete, then relaunched with ``--ckpt.load_enable``: it must train steps 3 and 4
  and end with run A's weights (same seed: per-request engine seeds, canonical group order, the
  window shuffle keyed by DeepSpeed's restored step count).
"""

import pytest
import torch

from e2e_common import (base_args, load_weights, logged_steps, max_weight_diff, read_jsonl, run_cli, run_env,
                        tb_scalars, write_prompts)


@pytest.fixture(scope="module")
def e2e(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data = write_prompts(root / "prompts.jsonl", 14)
    out_a, out_b = root / "run_a", root / "run_b"
    env_a = run_env({"LPO_CPU_PARITY_LOG": str(root / "parity_a.jsonl")})
    rc_a, wall_a, log_a = run_cli(base_args(tiny_model_dir, data, out_a, dp=2), env_a, root / "run_a.log")
    assert rc_a == 0, f"run A failed (rc={rc_a}); tail:\n{log_a[-6000:]}"
    env_b = run_env({"LPO_CPU_PARITY_LOG": str(root / "parity_b.jsonl")})
    args_b = base_args(tiny_model_dir, data, out_b, dp=2)
    rc_b1, wall_b1, log_b1 = run_cli(args_b, env_b, root / "run_b1.log", stop_at_checkpoint="global_step2")
    env_b2 = run_env({"LPO_CPU_PARITY_LOG": str(root / "parity_b2.jsonl")})
    rc_b2, wall_b2, log_b2 = run_cli(args_b + ["--ckpt.load_enable"], env_b2, root / "run_b2.log")
    assert rc_b2 == 0, f"run B (resume) failed (rc={rc_b2}); tail:\n{log_b2[-6000:]}"
    print(f"\n[e2e] run A {wall_a:.0f}s, run B killed after step 2 at {wall_b1:.0f}s, resume {wall_b2:.0f}s")
    return {"root": root, "model": tiny_model_dir, "out_a": out_a, "out_b": out_b, "log_a": log_a,
            "log_b1": log_b1, "rc_b1": rc_b1, "log_b2": log_b2, "parity_a": read_jsonl(root / "parity_a.jsonl"),
            "parity_b2": read_jsonl(root / "parity_b2.jsonl"), "tb_a": tb_scalars(out_a / "tb")}


def test_every_step_trains_with_informative_groups(e2e):
    assert logged_steps(e2e["log_a"]) == [1, 2, 3, 4]
    assert "LPOTrainer" in e2e["log_a"] and "CPURolloutEngine" in e2e["log_a"]
    tb = e2e["tb_a"]
    steps = [1, 2, 3, 4]
    for key in ("train/lpo/abs_coef_mean", "train/actor_grad_norm", "train/lpo/degenerate_frac",
                "train/lpo/groups", "train/rollout/num_samples"):
        assert sorted(tb[key]) == steps, key
    assert all(tb["train/lpo/abs_coef_mean"][s] > 1e-3 for s in steps)  # non-zero listwise coefficients
    assert all(tb["train/actor_grad_norm"][s] > 1e-3 for s in steps)  # a real gradient reached DeepSpeed
    assert all(tb["train/lpo/degenerate_frac"][s] < 1.0 for s in steps)
    # 14 prompts in batches of 4: the last batch is partial, 2 groups (one per rank), one window
    assert [tb["train/lpo/groups"][s] for s in steps] == [4.0, 4.0, 4.0, 2.0]
    assert [tb["train/rollout/num_samples"][s] for s in steps] == [16.0, 16.0, 16.0, 8.0]
    assert [tb["train/lpo/shortcut_windows"][s] for s in steps] == [1.0, 1.0, 1.0, 1.0]
    assert [tb["train/lpo/pre_pass_windows"][s] for s in steps] == [1.0, 1.0, 1.0, 0.0]


def test_weight_sync_logprob_parity_and_the_policy_moves(e2e):
    records = e2e["parity_a"]
    assert len(records) == 4, "one weight sync per step"
    for r in records:
        assert r["max_abs_diff"] <= 1e-4 and r["tol"] == 1e-4
        diff = max(abs(a - b) for a, b in zip(r["actor_log_probs"], r["engine_log_probs"]))
        assert diff == pytest.approx(r["max_abs_diff"], abs=1e-12)
        assert len(r["engine_log_probs"]) == r["num_tokens"] > 20
    # every update moved the policy: the probe's log-probs change from sync to sync
    for a, b in zip(records, records[1:]):
        assert max(abs(x - y) for x, y in zip(a["actor_log_probs"], b["actor_log_probs"])) > 1e-4

    # independent: the saved final model, evaluated here, gives the engine's last numbers
    from transformers import AutoModelForCausalLM

    ids = records[-1]["probe_ids"]

    def probe_log_probs(path):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
        finally:
            torch.set_num_threads(threads)
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        return lp.double()

    engine_last = torch.tensor(records[-1]["engine_log_probs"], dtype=torch.float64)
    final = probe_log_probs(str(e2e["out_a"] / "final"))
    initial = probe_log_probs(e2e["model"])
    assert (final - engine_last).abs().max() < 1e-4
    assert (initial - final).abs().max() > 1e-3


def test_resume_trains_the_remaining_steps_to_the_same_weights(e2e):
    actor_ckpt = e2e["out_a"] / "ckpt" / "_actor"
    # one directory per step, the oldest pruned by --ckpt.max_num (default 3)
    assert [s for s in (1, 2, 3, 4) if (actor_ckpt / f"global_step{s}").is_dir()] == [2, 3, 4]
    assert (actor_ckpt / "latest").read_text().strip() == "global_step4"
    # run B died after its step-2 checkpoint (SIGKILL) ...
    assert e2e["rc_b1"] != 0 and logged_steps(e2e["log_b1"])[:2] == [1, 2]
    assert 4 not in logged_steps(e2e["log_b1"])
    # ... and the relaunch loaded it and trained exactly the steps that were left
    assert "Loading the checkpoint" in e2e["log_b2"]
    assert logged_steps(e2e["log_b2"]) == [3, 4]
    a, b = load_weights(e2e["out_a"] / "final"), load_weights(e2e["out_b"] / "final")
    init = load_weights(e2e["model"])
    moved = max_weight_diff(a, init)
    diff = max_weight_diff(a, b)
    print(f"\n[e2e] resumed vs uninterrupted: max |dw| {diff:.3g} (the run moved the weights by {moved:.3g})")
    assert moved > 1e-3 and diff < 1e-5 * max(moved, 1.0)
