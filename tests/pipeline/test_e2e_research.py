"""lpo-train end to end with the research flags at once (divergence schedule, entropy switch, temperature scale, replay), and a resume that keeps them.

Run A: local Ray, OpenRLHF's trainer and actors with the LPO subclasses, DeepSpeed ZeRO-2 on gloo with
two data-parallel ranks, the CPU rollout engine, a tiny offline Qwen3, the vowel-fraction reward
(research_reward.py, which also logs every scored query), 4 rollout batches of 4 prompts x K=4,
micro-batches of 2 (groups split: c from s_t in the first window, a no-grad pre-pass after), and

    --lpo.divergence_schedule alpha:0.5@0,tv@1,rev --lpo.divergence_switch_entropy 1000
    --lpo.divergence_switch_window 2          (parametric names; by step, then by entropy once)
    --lpo.temperature_scale 0.5
    --lpo.replay_batches 2 --lpo.replay_ratio 1 --lpo.replay_max_abs_s 5

with a checkpoint every 2 steps. Run B resumes from run A's step-2 checkpoint (copied, ``latest``
pointing at it: what a run killed right after that checkpoint leaves) with ``--ckpt.load_enable``
and must train steps 3 and 4 exactly as run A did: the same divergence (the switch kept), the same
replayed groups (the buffer restored) and the same final weights.
"""

import shutil

import pytest

from e2e_common import REPO, base_args, load_weights, max_weight_diff, read_jsonl, run_cli, run_env, tb_scalars, \
    tb_steps, write_prompts

pytestmark = pytest.mark.e2e  # lpo-train runs with the research flags, and a resume

STEPS = 4
FLAGS = ["--lpo.divergence_schedule", "alpha:0.5@0,tv@1,rev", "--lpo.divergence_switch_entropy", "1000",
         "--lpo.divergence_switch_window", "2", "--lpo.temperature_scale", "0.5",
         "--lpo.replay_batches", "2", "--lpo.replay_ratio", "1", "--lpo.replay_max_abs_s", "5",
         "--ckpt.save_steps", "2", "--ckpt.max_num", "4"]


@pytest.fixture(scope="module")
def research_runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("research")
    data = write_prompts(root / "prompts.jsonl", 4 * STEPS)
    out_a, out_b = root / "run_a", root / "run_b"
    args_a = base_args(tiny_model_dir, data, out_a, dp=2, micro=2, train=8,
                       estimator=("lpo",), extra=FLAGS + ["--reward.remote_url",
                                                          str(REPO / "tests" / "pipeline" / "research_reward.py")])
    log_a = root / "rewards_a.jsonl"
    rc, wall_a, text_a = run_cli(args_a, run_env({"LPO_E2E_REWARD_LOG": str(log_a)}), root / "run_a.log")
    assert rc == 0, f"run A failed (rc={rc}); tail:\n{text_a[-6000:]}"
    # run B: run A's state right after its step-2 checkpoint
    (out_b / "ckpt" / "_actor").mkdir(parents=True)
    shutil.copytree(out_a / "ckpt" / "_actor" / "global_step2", out_b / "ckpt" / "_actor" / "global_step2")
    (out_b / "ckpt" / "_actor" / "latest").write_text("global_step2")
    (out_b / "ckpt" / "_lpo_replay").mkdir()
    shutil.copy(out_a / "ckpt" / "_lpo_replay" / "global_step2.pt", out_b / "ckpt" / "_lpo_replay")
    args_b = [a.replace(str(out_a), str(out_b)) for a in args_a] + ["--ckpt.load_enable"]
    rc, wall_b, text_b = run_cli(args_b, run_env({"LPO_E2E_REWARD_LOG": str(root / "rewards_b.jsonl")}),
                                 root / "run_b.log")
    assert rc == 0, f"run B (resume) failed (rc={rc}); tail:\n{text_b[-6000:]}"
    print(f"\n[e2e research] run A {wall_a:.0f}s, resumed run B {wall_b:.0f}s")
    return {"a": tb_scalars(out_a / "tb"), "b": tb_scalars(out_b / "tb"), "log_a": text_a, "log_b": text_b,
            "rewards_a": read_jsonl(log_a), "out_a": out_a, "out_b": out_b, "model": tiny_model_dir}


def _col(tb, key):
    return [tb[f"train/{key}"][s] for s in sorted(tb[f"train/{key}"])]


def test_schedule_by_step_then_by_entropy(research_runs):
    tb = research_runs["a"]
    assert tb_steps(tb) == list(range(1, STEPS + 1))
    # step 1: alpha:0.5 (stage 0); step 2: tv by step (@1); after step 2 the 2-step mean entropy (< 1000)
    # fires the switch: steps 3 and 4 move on to rev, the stage after tv
    assert _col(tb, "lpo/divergence_stage") == [0.0, 1.0, 2.0, 2.0]
    assert _col(tb, "lpo/divergence_switched_at") == [-1.0, 2.0, 2.0, 2.0]
    running = tb["train/lpo/entropy_running_mean"][2]
    assert running == pytest.approx((tb["train/response_entropy"][1] + tb["train/response_entropy"][2]) / 2, rel=1e-5)
    # the divergence each update trained with is logged: D(w*, P) at the start is that divergence of
    # P_t = softmax(s_t) (0 on-policy at step 1: P_t uniform, w* with tau = 0.5 std)
    for s in range(1, STEPS + 1):
        assert tb["train/lpo/divergence_start"][s] > 0 and tb["train/lpo/divergence_last"][s] >= 0
    assert tb["train/lpo/shortcut_windows"][1] == 1.0 and tb["train/lpo/pre_pass_windows"][1] >= 1.0


def test_temperature_scale_gives_the_logged_tau(research_runs):
    """Step 1 (nothing to replay yet): lpo/tau_mean = 0.5 x the mean unbiased std of each prompt's K
    rewards, recomputed here from the reward log."""
    import statistics

    rows = research_runs["rewards_a"][:16]  # the first rollout batch: 4 prompts x K=4
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"], []).append(r["reward"])
    assert len(by_prompt) == 4 and all(len(v) == 4 for v in by_prompt.values())
    stds = [statistics.stdev(v) for v in by_prompt.values() if max(v) > min(v)]
    tb = research_runs["a"]
    assert tb["train/lpo/tau_mean"][1] == pytest.approx(0.5 * sum(stds) / len(stds), rel=1e-5)
    assert tb["train/lpo/tau_max"][1] == pytest.approx(0.5 * max(stds), rel=1e-5)


def test_replay_trains_whole_replayed_groups(research_runs):
    tb = research_runs["a"]
    fresh = _col(tb, "lpo/replay_fresh_groups")
    replayed = _col(tb, "lpo/replay_groups")
    assert fresh == [4.0] * STEPS
    assert replayed[0] == 0.0 and all(r > 0 for r in replayed[1:])  # the buffer is empty at step 1
    # every drawn group is trained, dropped as stale or dropped to keep the two ranks equal
    assert _col(tb, "lpo/replay_drawn") == [0.0, 4.0, 4.0, 4.0]  # ratio 1: one per fresh group, once there are any
    for s in range(1, STEPS + 1):
        drawn = tb["train/lpo/replay_drawn"][s]
        assert drawn == tb["train/lpo/replay_groups"][s] + tb["train/lpo/replay_dropped_stale"][s] + \
            tb["train/lpo/replay_dropped_layout"][s]
        assert (tb["train/lpo/replay_groups"][s] + 4) % 2 == 0  # equal per rank
        # the trainer saw the fresh and the replayed groups
        assert tb["train/lpo/groups"][s] == 4.0 + tb["train/lpo/replay_groups"][s]
    assert _col(tb, "lpo/replay_buffer_groups") == [4.0, 8.0, 8.0, 8.0]
    for s in range(2, STEPS + 1):
        assert 0.0 < tb["train/lpo/replay_ess"][s] <= 1.0
        assert 0.0 < tb["train/lpo/replay_abs_s_mean"][s] <= tb["train/lpo/replay_abs_s_max"][s] <= 5.0
        assert 1.0 <= tb["train/lpo/replay_age_mean"][s] <= 2.0
    # rollout metrics count fresh samples only
    assert _col(tb, "rollout/num_samples") == [16.0] * STEPS


def test_a_resumed_run_keeps_the_switch_the_buffer_and_the_weights(research_runs):
    a, b = research_runs["a"], research_runs["b"]
    assert tb_steps(b) == [3, 4]
    for key in ("lpo/divergence_stage", "lpo/divergence_switched_at", "lpo/replay_fingerprint", "lpo/replay_groups",
                "lpo/replay_age_mean"):
        assert [b[f"train/{key}"][s] for s in (3, 4)] == [a[f"train/{key}"][s] for s in (3, 4)], key
    assert b["train/lpo/divergence_stage"][3] == 2.0  # still switched after the restart
    # the checkpoints kept their replay buffers next to the actor's
    names = sorted(p.name for p in (research_runs["out_a"] / "ckpt" / "_lpo_replay").iterdir())
    assert names == ["global_step2.pt", "global_step4.pt"]


def test_a_resumed_run_with_replay_ends_at_the_same_weights(research_runs):
    """The resumed run ends at the uninterrupted run's weights. It failed (8.9e-3) while the research
    restore, which reads the checkpoint states after the first rollout, rewound the per-request seeds'
    prompt position (request_seeds.py)."""
    wa, wb = load_weights(research_runs["out_a"] / "final"), load_weights(research_runs["out_b"] / "final")
    init = load_weights(research_runs["model"])
    moved, diff = max_weight_diff(wa, init), max_weight_diff(wa, wb)
    print(f"\n[e2e research] resumed vs uninterrupted: max |dw| {diff:.3g} (moved {moved:.3g})")
    assert moved > 1e-4 and diff < 1e-5 * max(moved, 1.0)
