"""lpo-train end to end with the research flags at once (divergence schedule, entropy switch, temperature scale, replay), and a resume that keeps them.

Run A: local Ray, OpenRLHF's trainer and actors with the LPO subclasses, DeepSpeed ZeRO-2 on gloo with
two data-parallel ranks, the CPU rollout engine, a tiny offline Qwen3, the vowel-fraction reward
(research_reward.py, which also logs every scored query), 4 rollout batches of 4 prompts x K=4,
micro-batches of 2 (groups split: c from s_t in the first window, a no-grad pre-pass after), and

    --lpo.divergence_schedule alpha:0.5@0,tv@1,rev --lpo.divergence_switch_entropy 1000
    --lpo.divergence_switch_window 2          (parametric names; by step, then by entropy once)
    --lpo.temperature_scale 0.5
    --lpo.replay_batches 2 --lpo.replay_ratio 1 --lpo.replay_max_abs_s 5

with a checkpoint every 2 steps.

Run B is run A's job with ``--ckpt.auto_resume 2``, preempted twice as a cluster would: a Ray worker (a
policy actor) is SIGKILLed in step 3, after the step-2 checkpoint, then the restarted attempt's driver as its
actors start on its new Ray cluster. The supervisor restarts it from global_step2 both times, and steps 3 and
4 must train exactly as run A did: the same divergence (the switch kept), the same replayed groups (the
buffer restored) and run A's final weights, bit for bit (same seed: seeded prompt order, per-request engine
seeds, canonical group order, the window shuffle keyed by DeepSpeed's restored step count). Each attempt
starts a Ray cluster of its own, which dies with it.
"""

import os
import re
import signal
import subprocess
import time

import pytest
import torch

from e2e_common import REPO, base_args, load_weights, max_weight_diff, ray_actor_pids, read_jsonl, run_cli, run_env, \
    run_supervised, tb_scalars, tb_steps, write_prompts

pytestmark = pytest.mark.e2e  # an lpo-train run with the research flags, and the same job preempted twice

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
    # run B: the same job, supervised, preempted twice (a lost worker, then a lost driver)
    args_b = [a.replace(str(out_a), str(out_b)) for a in args_a] + ["--ckpt.auto_resume", "2",
                                                                     "--ckpt.auto_resume_delay", "0"]
    env_b = run_env({"LPO_E2E_REWARD_LOG": str(root / "rewards_b.jsonl")}, shared_ray=False)
    rc, wall_b, text_b, kills = run_supervised(args_b, env_b, root / "run_b.log", worker_class="LPOPolicyActor",
                                               kill_after="global_step2")
    assert rc == 0, f"run B (supervised) failed (rc={rc}); tail:\n{text_b[-6000:]}"
    print(f"\n[e2e research] run A {wall_a:.0f}s, supervised run B {wall_b:.0f}s with kills {kills}")
    return {"a": tb_scalars(out_a / "tb"), "b": tb_scalars(out_b / "tb"), "log_a": text_a, "log_b": text_b,
            "rewards_a": read_jsonl(log_a), "out_a": out_a, "out_b": out_b, "model": tiny_model_dir, "kills": kills}


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


def test_the_lost_worker_is_one_of_the_run_s_own():
    """The preemption picks its Ray worker among the supervised run's descendants only: the other xdist
    worker's runs (and this worker's shared cluster) have ``ray::LPOPolicyActor`` processes on the same
    machine. When the pick scanned the whole machine, a CI run saw run B finish with no restart after its
    worker kill: the kill had most likely hit another run's actor."""
    title = 'exec -a "ray::LPOPolicyActor.train" sleep 60'
    outside = subprocess.Popen(["bash", "-c", title])
    run = subprocess.Popen(["bash", "-c", f"({title}) & wait"])
    try:
        for _ in range(100):
            mine = ray_actor_pids("LPOPolicyActor", run.pid)
            if mine:
                break
            time.sleep(0.05)
        assert len(mine) == 1 and mine[0] not in (run.pid, outside.pid)
        assert ray_actor_pids("LPOPolicyActor", outside.pid) == []  # its own title is not a descendant
        assert ray_actor_pids("LPOCriticActor", run.pid) == []
    finally:
        for pid in ray_actor_pids("LPOPolicyActor", run.pid):  # before their parent: none is orphaned
            os.kill(pid, signal.SIGKILL)
        for proc in (outside, run):
            proc.kill()
            proc.wait()


def test_auto_resume_survives_a_lost_worker_and_a_lost_driver(research_runs):
    """Both preemptions are restarts from global_step2, each logged with its cause; the last attempt ends at
    run A's last checkpoint."""
    log = research_runs["log_b"]
    assert [k[0] for k in research_runs["kills"]] == ["worker", "driver"]
    worker_death = re.search(r"attempt 1 died \((exit \d+: [^)]*)\); restart 1/2 from global_step2", log)
    assert worker_death and ("ActorDied" in worker_death.group(1) or "RayActorError" in worker_death.group(1)), \
        log[-4000:]
    assert "attempt 2 died (killed by SIGKILL); restart 2/2 from global_step2" in log
    assert "the run finished after 2 restarts" in log
    # attempt 2 was killed while its actors started (before they loaded anything); attempt 3 resumed
    assert log.count("Loading the checkpoint") == 1
    second = log[log.index("attempt 2: pid"):log.index("attempt 2 died")]
    assert "[placement]" in second and "Loading the checkpoint" not in second
    for out in (research_runs["out_a"], research_runs["out_b"]):
        actor_ckpt = out / "ckpt" / "_actor"
        assert [s for s in (1, 2, 3, 4) if (actor_ckpt / f"global_step{s}").is_dir()] == [2, 4]  # every 2 steps
        assert (actor_ckpt / "latest").read_text().strip() == "global_step4"


def test_a_resumed_run_keeps_the_switch_the_buffer_and_the_weights(research_runs):
    a, b = research_runs["a"], research_runs["b"]
    assert tb_steps(b) == list(range(1, STEPS + 1))  # steps 3 and 4 as the last attempt logged them
    for key in ("lpo/divergence_stage", "lpo/divergence_switched_at", "lpo/replay_fingerprint", "lpo/replay_groups",
                "lpo/replay_age_mean"):
        assert [b[f"train/{key}"][s] for s in (3, 4)] == [a[f"train/{key}"][s] for s in (3, 4)], key
    assert b["train/lpo/divergence_stage"][3] == 2.0  # still switched after the restarts
    # the checkpoints kept their replay buffers next to the actor's
    for out in (research_runs["out_a"], research_runs["out_b"]):
        assert sorted(p.name for p in (out / "ckpt" / "_lpo_replay").iterdir()) == ["global_step2.pt",
                                                                                     "global_step4.pt"]


def test_a_resumed_run_with_replay_ends_at_the_same_weights(research_runs):
    """The twice-restarted run ends at the uninterrupted run's weights, bit for bit. It failed (8.9e-3) while
    the research restore, which reads the checkpoint states after the first rollout, rewound the per-request
    seeds' prompt position (request_seeds.py)."""
    wa, wb = load_weights(research_runs["out_a"] / "final"), load_weights(research_runs["out_b"] / "final")
    init = load_weights(research_runs["model"])
    moved, diff = max_weight_diff(wa, init), max_weight_diff(wa, wb)
    print(f"\n[e2e research] auto-resumed vs uninterrupted: max |dw| {diff:.3g} (moved {moved:.3g})")
    assert moved > 1e-4
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"max |dw| {diff:.3g}"
