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

Run B is run A's job with ``--ckpt.auto_resume 2`` on a simulated two-node cluster (``ray.cluster_utils.Cluster``,
one for the module: a head without GPUs, where the driver runs, and a node with the GPUs), preempted twice as
a cluster would: the GPU node is lost (its raylet and workers SIGKILLed) in step 3, after the step-2
checkpoint; the restarted attempt waits for GPUs (``--ckpt.auto_resume_wait``: not a failed attempt), the node
comes back a little later, and the restarted driver is SIGKILLed as its actors start. The supervisor restarts
it from global_step2 both times, and steps 3 and 4 must train exactly as run A did: the same divergence (the
switch kept), the same replayed groups (the buffer restored) and run A's final weights, bit for bit (same seed:
seeded prompt order, per-request engine seeds, canonical group order, the window shuffle keyed by DeepSpeed's
restored step count). On the same cluster, a node whose ``--ckpt.path`` is its own disk (a worker node in a
mount namespace of its own) makes the start-up check refuse the path, naming that node.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from e2e_common import REPO, after, base_args, load_weights, max_weight_diff, read_jsonl, run_cli, run_env, \
    run_supervised, tb_scalars, tb_steps, write_prompts

pytestmark = pytest.mark.e2e  # an lpo-train run with the research flags, and the same job preempted twice

STEPS = 4
FLAGS = ["--lpo.divergence_schedule", "alpha:0.5@0,tv@1,rev", "--lpo.divergence_switch_entropy", "1000",
         "--lpo.divergence_switch_window", "2", "--lpo.temperature_scale", "0.5",
         "--lpo.replay_batches", "2", "--lpo.replay_ratio", "1", "--lpo.replay_max_abs_s", "5",
         "--ckpt.save_steps", "2", "--ckpt.max_num", "4"]


# the simulated cluster: the head is the driver's node (no CPU or GPU slots: every actor runs on the other node,
# as on the run's own one-node cluster); run B needs 3 GPUs (2 actor ranks, 1 engine)
HEAD = {"num_cpus": 0, "num_gpus": 0}
GPU_NODE = {"num_cpus": 8, "num_gpus": 4, "object_store_memory": 1 << 30}
QUIET = {"enable_worker_prestart": False, "prestart_worker_first_driver": False,  # workers get each job's env
         "health_check_period_ms": 1000, "health_check_failure_threshold": 3}  # a lost node is seen in ~3 s


@pytest.fixture(scope="module")
def sim_cluster():
    from ray.cluster_utils import Cluster

    from shared_ray import private_ray_tmpdir, remove_ray_tmpdir

    with private_ray_tmpdir() as tmp:  # not recorded where other runs' plain ray.init() would join it
        cluster = Cluster(initialize_head=True, head_node_args=dict(HEAD, include_dashboard=False,
                                                                    object_store_memory=256 << 20, _system_config=QUIET))
    gpu_nodes = [cluster.add_node(**GPU_NODE)]
    cluster.wait_for_nodes()
    try:
        yield {"cluster": cluster, "gpu_nodes": gpu_nodes, "tmp": tmp}
    finally:
        with private_ray_tmpdir(tmp):
            cluster.shutdown()
        remove_ray_tmpdir(tmp)


def _preemptions(cluster, gpu_nodes, latest: Path, after_s: float = 2.0):
    """Run B's events (``e2e_common.run_supervised``): lose the GPU node once checkpoint global_step2 is whole;
    ``after_s`` seconds after the restarted attempt says it waits for GPUs, add a node like it back; SIGKILL that
    attempt's driver as its actors start (its ``[placement]`` line)."""
    seen = {}

    def lose_node(text, now):
        if latest.exists() and latest.read_text().strip() == "global_step2":  # steps take ~1 s: step 3 runs
            node = gpu_nodes.pop()
            cluster.remove_node(node, allow_graceful=False)
            return "node lost", node.node_id[:8]

    def node_back(text, now):
        second = after(text, "attempt 2: pid")
        if second and "waiting for the GPUs" in second:
            if now - seen.setdefault("waiting", now) >= after_s:
                node = cluster.add_node(**GPU_NODE)
                gpu_nodes.append(node)
                return "node back", node.node_id[:8]

    def kill_driver(text, now):
        second = after(text, "attempt 2: pid")
        if second and "[placement]" in second:  # the restarted run's actors are starting
            pid = int(second.split("attempt 2: pid", 1)[1].split()[0])
            os.kill(pid, signal.SIGKILL)
            return "driver", pid

    return [lose_node, node_back, kill_driver]


@pytest.fixture(scope="module")
def research_runs(tiny_model_dir, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("research")
    data = write_prompts(root / "prompts.jsonl", 4 * STEPS)
    out_a, out_b = root / "run_a", root / "run_b"
    args_a = base_args(tiny_model_dir, data, out_a, dp=2, micro=2, train=8,
                       estimator=("lpo",), extra=FLAGS + ["--reward.remote_url",
                                                          str(REPO / "tests" / "pipeline" / "research_reward.py")])
    log_a = root / "rewards_a.jsonl"
    rc, wall_a, text_a = run_cli(args_a, run_env({"LPO_E2E_REWARD_LOG": str(log_a)}), root / "run_a.log")
    assert rc == 0, f"run A failed (rc={rc}); tail:\n{text_a[-6000:]}"
    sim_cluster = request.getfixturevalue("sim_cluster")  # started now: no idle cluster beside run A
    # run B: the same job, supervised, on the simulated cluster: its GPU node lost, then the restarted driver
    args_b = [a.replace(str(out_a), str(out_b)) for a in args_a] + ["--ckpt.auto_resume", "2",
                                                                     "--ckpt.auto_resume_delay", "0"]
    env_b = run_env({"LPO_E2E_REWARD_LOG": str(root / "rewards_b.jsonl"), "LPO_CPU_MODE": "1",
                     "RAY_ADDRESS": sim_cluster["cluster"].address}, shared_ray=False)
    events = _preemptions(sim_cluster["cluster"], sim_cluster["gpu_nodes"], out_b / "ckpt" / "_actor" / "latest")
    rc, wall_b, text_b, kills = run_supervised(args_b, env_b, root / "run_b.log", events)
    assert rc == 0, f"run B (supervised) failed (rc={rc}, events {kills}); tail:\n{text_b[-6000:]}"
    print(f"\n[e2e research] run A {wall_a:.0f}s, supervised run B {wall_b:.0f}s with events {kills}")
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


def test_auto_resume_survives_a_lost_node_and_a_lost_driver(research_runs):
    """Both preemptions are restarts from global_step2, each logged with its cause; the restart after the lost
    node waits for its GPUs (not counted: N = 2 allows exactly the two deaths), checks that the returned node
    sees --ckpt.path, and the last attempt ends at run A's last checkpoint."""
    log = research_runs["log_b"]
    assert [k[0] for k in research_runs["kills"]] == ["node lost", "node back", "driver"]
    # the driver stops on whichever error reaches it first: Ray's (ActorDied, ActorUnavailable) or gloo's (a peer
    # rank's connection closed)
    assert re.search(r"attempt 1 died \(exit [1-9]\d*: \S*(Error|Exception)\b.*\); restart 1/2 from global_step2",
                     log), log[-4000:]
    second = log[log.index("attempt 2: pid"):log.index("attempt 2 died")]
    waiting = re.search(r"waiting for the GPUs \(free per node: no node with GPUs\): this recipe needs 3 GPUs "
                        r"\(actor 2, vLLM engines 1\) but the Ray cluster has 0; .*up to (\d+) s more "
                        r"\(--ckpt.auto_resume_wait\); waiting is not a failed attempt", second)
    assert waiting and int(waiting.group(1)) > 1700, second[-4000:]  # the default budget: 30 minutes
    assert re.search(r"the GPUs the run needs are there after \d+ s of waiting", second)
    assert "one storage, seen by all 2 nodes of the run" in second
    assert "attempt 2 died (killed by SIGKILL); restart 2/2 from global_step2" in log
    assert "the run finished after 2 restarts" in log
    assert "lpo-train auto-resume: CPU mode on for every attempt: LPO_CPU_MODE=1" in log  # decided once
    # attempt 2 was killed while its actors started (before they loaded anything); attempt 3 resumed
    assert log.count("Loading the checkpoint") == 1
    assert "[placement]" in second and "Loading the checkpoint" not in second
    for out in (research_runs["out_a"], research_runs["out_b"]):
        actor_ckpt = out / "ckpt" / "_actor"
        assert [s for s in (1, 2, 3, 4) if (actor_ckpt / f"global_step{s}").is_dir()] == [2, 4]  # every 2 steps
        assert (actor_ckpt / "latest").read_text().strip() == "global_step4"
        assert not list((out / "ckpt").glob(".lpo_shared_storage_*"))  # the check's markers are gone


def _descendants_and(pid):
    """The processes of a ``ray start --block`` node (its raylet, workers...), the command last."""
    import psutil

    root = psutil.Process(pid)
    return root.children(recursive=True) + [root]


def test_a_node_local_ckpt_path_is_refused_naming_the_node(sim_cluster, tmp_path, capsys):
    """A third node whose --ckpt.path is its own disk: ``ray start`` joins the module's cluster from a mount
    namespace of its own with a tmpfs over the path. The start-up check (one task per GPU node writes and reads
    a marker) refuses the path with exit 2, naming that node and the fix, not the GPU node that shares it (run B
    logs the same check passing on the two nodes)."""
    import ray

    from openrlhf_lpo.cli import shared_storage

    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount needs CAP_SYS_ADMIN): no node-local path to test")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cluster = sim_cluster["cluster"]
    ray_cli = Path(sys.executable).parent / "ray"
    local = subprocess.Popen(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs lpo-node-disk {ckpt} && exec {ray_cli} "
                              f"start --address={cluster.address} --num-cpus 1 --num-gpus 1 --block "
                              "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                             start_new_session=True, env=dict(os.environ, RAY_TMPDIR=sim_cluster["tmp"]))
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        known = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        t0 = time.time()
        while time.time() - t0 < 120:
            new = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in known]
            if new:
                break
            assert local.poll() is None, "the node-local worker node did not start"
            time.sleep(0.5)
        assert new, "the node-local worker node did not join"
        args = SimpleNamespace(ckpt=SimpleNamespace(path=str(ckpt), save_steps=2, load_enable=False))
        t0 = time.time()
        with pytest.raises(SystemExit) as exc:
            shared_storage.check_or_exit(args, look_s=1.0)
        refused_s = time.time() - t0
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert f"lpo-train: --ckpt.path {ckpt} is not one storage that every node of the run sees (the driver's " \
               "node and every node with GPUs: 3)" in err
        bad = [line for line in err.splitlines() if line.startswith("  ") and not line.startswith("  Put ")]
        assert len(bad) == 1 and f"node {new[0][:8]})" in bad[0], err  # the namespace node only, by its id
        assert "does not see the marker the driver wrote in" in bad[0]
        assert "Put --ckpt.path (and --ckpt.output_dir) on a filesystem every node mounts" in err
        assert list(ckpt.iterdir()) == []  # the markers are removed
        print(f"\n[e2e research] node-local --ckpt.path refused in {refused_s:.1f} s")
    finally:
        ray.shutdown()
        if local.poll() is None:
            for p in _descendants_and(local.pid):
                p.kill()
            local.wait()


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
